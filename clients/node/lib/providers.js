'use strict';
// The official `openai` and `@anthropic-ai/sdk` packages' calls, booked by the
// ledger: a fetch to give their clients (`new OpenAI({ fetch: ledgerFetch(laneClient) })`,
// `new Anthropic({ fetch: ... })`). Every create call (POST .../chat/completions,
// .../responses, Anthropic's .../v1/messages) is reserved from the bytes of
// its body and its max tokens, then ended by the client's one outcome table
// (lib/outcomes.js) through LaneClient.call: settled with the response's usage,
// refunded on any 4xx, UNKNOWN on a timeout, a lost connection, or a 5xx
// without usage. Every other request passes through, unbooked.
//
// - A request that never left (no connection could be made: refused, a DNS
//   failure, unreachable, undici's connect timeout, a certificate refused in
//   the TLS handshake) is refunded as never sent, as the Python client's
//   transport does for httpx's ConnectError and ConnectTimeout (see neverSent
//   below). A timeout or a lost connection once connected may have been
//   billed: UNKNOWN.
// - Streams are handed on at once; their usage comes from the last chunk that
//   carries one (chat: asked for with stream_options.include_usage; responses:
//   the response.completed event), and the booking ends when the stream does.
//   A stream that ends, is cancelled or is cut off before any usage came is
//   UNKNOWN; one cut off after its usage is settled from it.
// - The reservation id travels as the header x-ledger-reservation-id and in the
//   body's metadata (ledger_reservation_id), unless the caller set that key,
//   the metadata already holds OpenAI's maximum of 16 keys (OpenAI would
//   refuse a 17th with a 400), it is not an object, or the call is a chat
//   completion not stored (OpenAI refuses its metadata): then only the header.
//   Anthropic takes no metadata key but user_id: the id goes there, unless
//   the caller set it (as the Python client's transport tags it).
// - A denial is answered with a 402 that the SDK does not retry (x-should-retry:
//   false), whose error body carries the denial reason as its code and
//   `ledger_denial` with the retry-after instant: the SDK raises it as an
//   APIError. Nothing is sent to the provider.
// - The SDK retries 429s and 5xx itself: each attempt is a booking of its own.
// - Every create call is booked, whatever its body, as the Python client's
//   transport books it: bytes as they are, a stream or a Blob read whole first
//   (see bodyOf). A body that is not a JSON object (other bytes, text that is
//   not JSON) is booked as it is: its bytes, the model name "unknown" and the
//   default output bound, tagged by the header only. The ledger refuses that
//   Reserve (UnknownModel) unless the lane prices a model of that name, so
//   such a call is never sent unbooked.
// - If the ledger refuses the usage the provider reported (more output than
//   the max, ...), call() settles the booking UNKNOWN at once (at most its
//   cap) rather than leave it open to expire, with a warning.

const { usageOf } = require('./usage');
const { markNotSent } = require('./outcomes');
const { checkNames, kindOf, newReservationId } = require('./arguments');
const { LaneClient } = require('./client');
const { traceHeaders, freshTraceHeaders } = require('./tracing');

// When a request names no max tokens: what a create call is reserved for, and
// the bound written into its body.
const DEFAULT_MAX_OUTPUT_TOKENS = 4096;
const TAG_KEY = 'ledger_reservation_id';
// OpenAI takes at most 16 metadata pairs: a full metadata is left as it is.
const MAX_METADATA_KEYS = 16;
const RESERVATION_HEADER = 'x-ledger-reservation-id';
// At most this much of an SSE stream is kept while an event line is incomplete.
const MAX_EVENT_BYTES = 1 << 20;
// The model booked for a body that names none (the Python client's UNKNOWN_MODEL_NAME).
const UNKNOWN_MODEL = 'unknown';
// The body's fields that bound the output, in the order they are looked for;
// the first is the one written when none is set (as the Python client's).
const MAX_TOKEN_FIELDS = Object.freeze({
  chat: Object.freeze(['max_completion_tokens', 'max_tokens']),
  responses: Object.freeze(['max_output_tokens']),
  anthropic: Object.freeze(['max_tokens']),
});
// Anthropic's only metadata key, where its messages call carries the id.
const ANTHROPIC_TAG_KEY = 'user_id';
// Headers of the body as the caller made it: the body sent may differ.
const BODY_HEADERS = ['content-length', 'transfer-encoding'];

/**
 * Which create call a request is ({style, chat}: style 'chat', 'responses' or
 * 'anthropic'), or null: it passes through unbooked. The paths are the Python
 * client's call_style, a trailing slash ignored.
 */
function createCallOf(url, init) {
  const method = String(init?.method ?? 'GET').toUpperCase();
  if (method !== 'POST') return null;
  const style = styleOfPath(new URL(String(url)).pathname.replace(/\/+$/, ''));
  return style === null ? null : { style, chat: style === 'chat' };
}

function styleOfPath(path) {
  if (path.endsWith('/chat/completions')) return 'chat';
  if (path.endsWith('/responses')) return 'responses';
  if (path.endsWith('/v1/messages')) return 'anthropic';
  return null;
}

/**
 * A request body as fetch sends it: its bytes, what to send in its place, and
 * the content type fetch would give it. A string is its UTF-8 and bytes (a
 * Buffer, any typed array, an ArrayBuffer) are themselves; anything else
 * fetch takes (a stream, a Blob, FormData, URLSearchParams) is read whole
 * first, as the Python client's transport reads every request body, and its
 * bytes are sent instead. The caller's `signal` bounds that read as it bounds
 * fetch: once it aborts, the read is given up and its reason thrown.
 */
async function bodyOf(body, signal) {
  if (body === undefined || body === null) return { bytes: Buffer.alloc(0), sent: body, contentType: null };
  if (typeof body === 'string') return { bytes: Buffer.from(body, 'utf8'), sent: body, contentType: null };
  if (body instanceof ArrayBuffer) return { bytes: Buffer.from(body), sent: body, contentType: null };
  if (ArrayBuffer.isView(body)) {
    return { bytes: Buffer.from(body.buffer, body.byteOffset, body.byteLength), sent: body, contentType: null };
  }
  const read = new Response(body);
  const bytes = Buffer.from(await untilAborted(read.arrayBuffer(), signal));
  return { bytes, sent: bytes, contentType: read.headers.get('content-type') };
}

/** `promise`, or a rejection with the signal's reason once it aborts (at once when it has). */
async function untilAborted(promise, signal) {
  if (!signal) return promise;
  // Given up on, the read may still fail later: not an unhandled rejection.
  promise.catch(() => {});
  signal.throwIfAborted();
  let onAbort;
  const aborted = new Promise((resolve, reject) => {
    onAbort = () => reject(signal.reason);
    signal.addEventListener('abort', onAbort, { once: true });
  });
  try {
    return await Promise.race([promise, aborted]);
  } finally {
    signal.removeEventListener('abort', onAbort);
  }
}

/** Bytes read as a JSON object (strict UTF-8), or null: not JSON, or not an object. */
function jsonObjectOf(bytes) {
  let value;
  try {
    value = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes));
  } catch {
    return null;
  }
  return value !== null && typeof value === 'object' && !Array.isArray(value) ? value : null;
}

/**
 * The booking a request asks for, or null when it costs nothing: the create
 * call, its body read (`bytes`, `sent`, `contentType`) and, when that is a
 * JSON object, `json`.
 */
async function planOf(url, init) {
  const call = createCallOf(url, init);
  if (call === null) return null;
  const body = await bodyOf(init.body, init.signal);
  const json = jsonObjectOf(body.bytes);
  return { ...call, ...body, json, stream: json?.stream === true };
}

const isCount = (value) => Number.isSafeInteger(value) && value >= 0;

/**
 * The output bound a JSON body asks for, as the Python client's
 * _ensure_max_tokens: its first field that is a count; when none is set, the
 * default, written into the body so that the provider enforces the bound the
 * ledger holds. A bound that is not a count is left for the provider to refuse
 * (a 4xx, refunded), and the default is reserved.
 */
function ensureMaxTokens(json, plan, defaultMaxOutputTokens) {
  const fields = MAX_TOKEN_FIELDS[plan.style];
  const given = fields.map((field) => json[field]).find(isCount);
  if (given !== undefined) return { maxOutputTokens: given, changed: false };
  if (fields.every((field) => json[field] === undefined || json[field] === null)) {
    json[fields[0]] = defaultMaxOutputTokens;
    return { maxOutputTokens: defaultMaxOutputTokens, changed: true };
  }
  return { maxOutputTokens: defaultMaxOutputTokens, changed: false };
}

/**
 * How many choices a chat asks for (`n`), as the Python client's _choices:
 * each may use the whole output bound, so the call's bound is the bound times
 * n. A count of at least 1 is taken; anything else (left out, null, 0, not a
 * count) is 1, and an `n` the provider does not take it refuses (a 4xx,
 * refunded).
 */
function choicesOf(json, plan) {
  return plan.chat && isCount(json.n) && json.n >= 1 ? json.n : 1;
}

const isPlainObject = (value) => value !== null && typeof value === 'object' && !Array.isArray(value);

/**
 * What is sent and booked: a JSON body with the reservation id in its
 * metadata, usage asked for on a chat stream and its output bound made
 * explicit; any other body as it is, booked at the default bound under
 * UNKNOWN_MODEL.
 */
function preparedOf(plan, reservationId, defaultMaxOutputTokens) {
  if (plan.json === null) {
    const { sent, bytes } = plan;
    return { body: sent, requestBytes: bytes.length, model: UNKNOWN_MODEL, maxOutputTokens: defaultMaxOutputTokens };
  }
  const json = { ...plan.json };
  const { maxOutputTokens: bound, changed: bounded } = ensureMaxTokens(json, plan, defaultMaxOutputTokens);
  // In BigInt: a bound times n past 2^53 reaches the range check exact, as in Python.
  const maxOutputTokens = BigInt(bound) * BigInt(choicesOf(json, plan));
  const tagged = tagMetadata(json, reservationId, plan.style);
  let asked = false;
  if (plan.chat && plan.stream) {
    // Options that are not an object are replaced, as the Python transport does.
    const options = isPlainObject(json.stream_options) ? json.stream_options : {};
    asked = options !== json.stream_options || options.include_usage !== true;
    json.stream_options = { ...options, include_usage: true };
  }
  const model = typeof json.model === 'string' && json.model !== '' ? json.model : UNKNOWN_MODEL;
  // Nothing changed: the body goes as the caller wrote it (the Python
  // transport's `raw if edited == parsed`), so both book the same bytes.
  if (!bounded && !tagged && !asked) return { body: plan.sent, requestBytes: plan.bytes.length, model, maxOutputTokens };
  const body = JSON.stringify(json);
  return { body, requestBytes: Buffer.byteLength(body), model, maxOutputTokens };
}

/**
 * The reservation id into the body's metadata, as the Python client's
 * _tag_body: not when the caller set the key, nor into a metadata that holds
 * 16 keys already (OpenAI's limit) or is not an object (the provider refuses
 * it either way), nor into a chat completion's that is not stored (`store:
 * true`); a missing or null metadata becomes one. Anthropic's goes in
 * user_id, its only key, unless that is set. true when it tagged.
 */
function tagMetadata(json, reservationId, style) {
  const given = json.metadata;
  if (given !== undefined && given !== null && (typeof given !== 'object' || Array.isArray(given))) return false;
  const metadata = { ...(given ?? {}) };
  if (style === 'anthropic') {
    if (metadata[ANTHROPIC_TAG_KEY] !== undefined && metadata[ANTHROPIC_TAG_KEY] !== null) return false;
    json.metadata = { ...metadata, [ANTHROPIC_TAG_KEY]: reservationId };
    return true;
  }
  // OpenAI refuses a chat completion's metadata unless it is stored (400, "The
  // 'metadata' parameter is only allowed when 'store' is enabled."): the header only.
  if (style === 'chat' && json.store !== true) return false;
  if (Object.hasOwn(metadata, TAG_KEY) || Object.keys(metadata).length >= MAX_METADATA_KEYS) return false;
  metadata[TAG_KEY] = reservationId;
  json.metadata = metadata;
  return true;
}

// What undici's fetch fails with when no connection could be made (its
// `cause`): a system error of connect(2) or of the name lookup, its connect
// timeout, or a TLS handshake that failed on the certificate. These are what
// httpx raises as ConnectError or ConnectTimeout, which the Python client
// refunds as never sent. Anything else (a reset, a socket closed, a timeout of
// the SDK's own, which aborts whether or not the request went out) may have
// been sent.
const CONNECT_SYSCALLS = new Set(['connect', 'getaddrinfo']);
const CONNECT_CODES = new Set([
  'ECONNREFUSED',
  'ENOTFOUND',
  'EAI_AGAIN',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'UND_ERR_CONNECT_TIMEOUT',
  // The certificate checks of a TLS handshake: before any byte of the request.
  'ERR_TLS_CERT_ALTNAME_INVALID',
  'CERT_HAS_EXPIRED',
  'CERT_NOT_YET_VALID',
  'CERT_UNTRUSTED',
  'CERT_REVOKED',
  'DEPTH_ZERO_SELF_SIGNED_CERT',
  'SELF_SIGNED_CERT_IN_CHAIN',
  'UNABLE_TO_GET_ISSUER_CERT',
  'UNABLE_TO_GET_ISSUER_CERT_LOCALLY',
  'UNABLE_TO_VERIFY_LEAF_SIGNATURE',
]);
// undici nests the cause; Node's happy eyeballs (autoSelectFamily) fails with
// an AggregateError of one error per address tried.
const MAX_CAUSE_DEPTH = 4;

function connectFailed(error, depth = 0) {
  if (error === null || typeof error !== 'object' || depth > MAX_CAUSE_DEPTH) return false;
  if (Array.isArray(error.errors) && error.errors.length > 0) {
    return error.errors.every((inner) => connectFailed(inner, depth + 1));
  }
  if (CONNECT_CODES.has(error.code) || CONNECT_SYSCALLS.has(error.syscall)) return true;
  return connectFailed(error.cause, depth + 1);
}

/**
 * Whether a fetch rejected before its request left: no connection could be
 * made. An abort (the SDK's timeout, the caller's signal) never counts, since
 * the request may have gone out before it.
 * @returns {string|null} the refund's reason, or null when it may have been sent
 */
function neverSent(error) {
  if (error?.name === 'AbortError' || error?.name === 'TimeoutError') return null;
  if (!connectFailed(error?.cause ?? error)) return null;
  const code = codeOf(error?.cause ?? error);
  return `could not connect: ${code}`;
}

function codeOf(error, depth = 0) {
  if (error === null || typeof error !== 'object' || depth > MAX_CAUSE_DEPTH) return 'connection failed';
  if (typeof error.code === 'string' && /^[A-Z0-9_]{1,64}$/.test(error.code)) return error.code;
  if (Array.isArray(error.errors) && error.errors.length > 0) return codeOf(error.errors[0], depth + 1);
  return codeOf(error.cause, depth + 1);
}

function parsed(text) {
  try {
    return JSON.parse(text);
  } catch {
    return null;
  }
}

/**
 * The usage in a parsed body, or null: a count that is not a count (negative,
 * above the ledger's bound, ...) is no usage, so the call is charged at its
 * hold, as the Python client's transport reads it (body_usage, StreamUsage).
 */
function usageIn(body) {
  try {
    return usageOf(body);
  } catch (error) {
    if (error instanceof TypeError || error instanceof RangeError) return null;
    throw error;
  }
}

/** Reads server-sent events as they pass, keeping the last usage one carried. */
class UsageWatcher {
  constructor(style) {
    this._pending = '';
    this._decoder = new TextDecoder();
    this._anthropic = style === 'anthropic';
    this._started = null; // an Anthropic stream's usage so far
    this.usage = null;
  }

  push(chunk) {
    this._pending += this._decoder.decode(chunk, { stream: true });
    const lines = this._pending.split('\n');
    this._pending = lines.pop() ?? '';
    if (this._pending.length > MAX_EVENT_BYTES) this._pending = '';
    for (const line of lines) {
      if (!line.startsWith('data:')) continue;
      const event = parsed(line.slice(5).trim());
      if (this._anthropic) this._anthropicEvent(event);
      else this._openaiEvent(event);
    }
  }

  _openaiEvent(event) {
    const usage = usageIn(event?.response ?? event);
    if (usage !== null) this.usage = usage;
  }

  /**
   * Anthropic's message_start carries the input counts, each message_delta
   * the cumulative output (a null count leaves the start's), merged as the
   * Python transport merges them: the usage is known from the first delta on.
   */
  _anthropicEvent(event) {
    if (event?.type === 'message_start') {
      const usage = event.message?.usage;
      this._started = isPlainObject(usage) ? { ...usage } : {};
    } else if (event?.type === 'message_delta') {
      const delta = isPlainObject(event.usage) ? event.usage : {};
      const known = Object.entries(delta).filter(([, value]) => value !== null && value !== undefined);
      this._started = { ...(this._started ?? {}), ...Object.fromEntries(known) };
      this.usage = usageIn({ usage: this._started });
    }
  }
}

// A stream handed on and then dropped, neither read to its end nor cancelled,
// ends its booking when collected (UNKNOWN unless its usage had come, as a
// cancelled one): else its booking stayed open until the hold expired. Its
// connection is let go with it. The Python transport's BookedStream.__del__.
const droppedStreams = new FinalizationRegistry((abandoned) => abandoned());

/** Hands the SDK the provider's stream, watched; resolves with how it ended. */
function watchedStream(response, style, hand) {
  const reader = response.body.getReader();
  const watcher = new UsageWatcher(style);
  let finish;
  const ended = new Promise((resolve) => {
    finish = resolve;
  });
  const body = new ReadableStream({
    async pull(controller) {
      try {
        const { done, value } = await reader.read();
        if (done) {
          controller.close();
          finish({ usage: watcher.usage });
          return;
        }
        watcher.push(value);
        controller.enqueue(value);
      } catch (error) {
        controller.error(error);
        finish({ error, usage: watcher.usage });
      }
    },
    async cancel(reason) {
      // The SDK stops reading at [DONE]: a usage seen by then is the call's.
      finish({ usage: watcher.usage });
      await reader.cancel(reason);
    },
  });
  const handed = new Response(body, { status: response.status, statusText: response.statusText, headers: response.headers });
  // Neither `handed` nor its body may be reached from here, or it is never collected.
  droppedStreams.register(handed, () => {
    finish({ usage: watcher.usage });
    reader.cancel().catch(() => {});
  });
  hand(handed);
  return ended;
}

function deniedResponse(denied) {
  const error = {
    type: 'ledger_denied',
    code: denied.reason,
    message: `the lane ledger denied this call: ${denied.message ?? denied.reason}`,
    ledger_denial: { reason: denied.reason, retry_after: denied.retryAfter?.toISOString?.() ?? null },
  };
  return new Response(JSON.stringify({ error }), {
    status: 402,
    headers: { 'content-type': 'application/json', 'x-should-retry': 'false' },
  });
}

/** The headers sent: the caller's, the reservation id, and the body's type when fetch would have added it. */
function headersOf(init, plan, reservationId) {
  const headers = new Headers(init.headers);
  for (const name of BODY_HEADERS) headers.delete(name);
  headers.set(RESERVATION_HEADER, reservationId);
  if (plan.contentType && !headers.has('content-type')) headers.set('content-type', plan.contentType);
  return headers;
}

/**
 * fetch's arguments as a URL and its init: a Request carries its method,
 * headers, body and signal itself (the init's win, as in fetch), and a create
 * call given as one went out unbooked when only the init was read.
 */
function requestOf(input, init) {
  if (!(input instanceof Request)) return [input, init];
  const { method, headers, body, signal, redirect } = input;
  return [input.url, { method, headers, body, signal, redirect, ...init }];
}

/**
 * A fetch that books every create call of the `openai` package in `ledger`.
 * A usage the ledger refuses is settled UNKNOWN by call() itself, with a
 * warning to the lane client's logger.
 * @param {import('./client').LaneClient} ledger
 * @param {{ fetch?: typeof fetch, maxOutputTokens?: number }} [options]
 */
function ledgerFetch(ledger, options = {}) {
  // Checked here, not at the first create call: there it failed inside the
  // fetch, which the SDK retries as a connection error.
  if (!(ledger instanceof LaneClient)) throw new TypeError(`ledgerFetch() needs the lane's LaneClient, not ${kindOf(ledger)}`);
  checkNames(options, 'LedgerFetchOptions', 'ledgerFetch() options');
  const { fetch: inner = globalThis.fetch, maxOutputTokens = DEFAULT_MAX_OUTPUT_TOKENS } = options;
  if (typeof inner !== 'function') throw new TypeError(`ledgerFetch() options: fetch must be a function, not ${kindOf(inner)}`);
  if (!isCount(maxOutputTokens)) throw new RangeError('maxOutputTokens must be a non-negative integer');
  return async function fetchThroughLedger(input, given = {}) {
    // Taken before any await, and shared by the call's Reserve and every ending.
    const trace = traceHeaders() ?? freshTraceHeaders();
    const [url, init] = requestOf(input, given);
    const plan = await planOf(url, init);
    if (plan === null) return inner(input, given);
    // Aborted already, fetch sends nothing: neither is a Reserve to be made.
    if (init.signal?.aborted) throw init.signal.reason;
    const reservationId = newReservationId();
    const { body, ...booked } = preparedOf(plan, reservationId, maxOutputTokens);
    const headers = headersOf(init, plan, reservationId);
    let deliver;
    const delivered = new Promise((resolve, reject) => {
      deliver = { resolve, reject };
    });
    const booking = { reservationId, ...booked, ...trace };
    // A whole (not streamed) answer, handed to the SDK once its booking has
    // ended, as the Python transport does: a lane that closes its client
    // right after the call must not leave the booking open.
    let whole = null;
    const outcome = ledger.call(booking, async () => {
      let response;
      try {
        response = await inner(url, { ...init, body, headers });
      } catch (error) {
        const reason = neverSent(error);
        // Refunded: costs zero. The SDK still gets the error (and may retry: a booking of its own).
        if (reason !== null && Object.isExtensible(error)) throw markNotSent(error, reason);
        throw error;
      }
      const streaming = response.ok && response.body && /text\/event-stream/.test(response.headers.get('content-type') ?? '');
      if (!streaming) {
        const text = await response.text();
        whole = new Response(text, { status: response.status, statusText: response.statusText, headers: response.headers });
        return { httpStatus: response.status, usage: usageIn(parsed(text)) };
      }
      // Neither the handed stream nor the promise that holds it is kept
      // while its end is awaited, so that a stream the caller drops is collected.
      const ended = watchedStream(response, plan.style, deliver.resolve);
      deliver = null;
      const end = await ended;
      // Cut off: a usage that had arrived is what the call cost (known usage
      // wins over the failure, as in the Python transport); without one, the
      // answer's status is kept and the booking is UNKNOWN, at its hold.
      if (end.error && end.usage === null) return { httpStatus: response.status, connectionLost: true };
      return { httpStatus: response.status, usage: end.usage };
    });
    outcome.then(
      (result) => {
        if (!result.admitted) return deliver?.resolve(deniedResponse(result));
        if (whole !== null) deliver?.resolve(whole);
        return undefined;
      },
      (error) => deliver?.reject(error),
    );
    return delivered;
  };
}

module.exports = {
  ledgerFetch,
  planOf,
  UNKNOWN_MODEL,
  neverSent,
  DEFAULT_MAX_OUTPUT_TOKENS,
  MAX_METADATA_KEYS,
  RESERVATION_HEADER,
  TAG_KEY,
};
