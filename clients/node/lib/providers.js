'use strict';
// The official `openai` package's calls, booked by the ledger: a fetch to give
// its client (`new OpenAI({ fetch: ledgerFetch(laneClient) })`). Every create
// call (POST .../chat/completions, .../responses) is reserved from the bytes of
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
//   A stream that ends, or is cancelled, before any usage came, or is cut
//   off, is UNKNOWN.
// - The reservation id travels as the header x-ledger-reservation-id and in the
//   body's metadata (ledger_reservation_id), unless the caller set that key,
//   the metadata already holds OpenAI's maximum of 16 keys (OpenAI would
//   refuse a 17th with a 400), or it is not an object: then only the header.
// - A denial is answered with a 402 that the SDK does not retry (x-should-retry:
//   false), whose error body carries the denial reason as its code and
//   `ledger_denial` with the retry-after instant: the SDK raises it as an
//   APIError. Nothing is sent to the provider.
// - The SDK retries 429s and 5xx itself: each attempt is a booking of its own.

const { usageOf } = require('./usage');
const { markNotSent } = require('./outcomes');

const CREATE_PATHS = [/\/chat\/completions$/, /\/responses$/];
// When a request names no max tokens: what a create call is reserved for, and
// the bound written into its body.
const DEFAULT_MAX_OUTPUT_TOKENS = 4096;
const TAG_KEY = 'ledger_reservation_id';
// OpenAI takes at most 16 metadata pairs: a full metadata is left as it is.
const MAX_METADATA_KEYS = 16;
const RESERVATION_HEADER = 'x-ledger-reservation-id';
// At most this much of an SSE stream is kept while an event line is incomplete.
const MAX_EVENT_BYTES = 1 << 20;

/** The booking a request asks for, or null when it costs nothing. */
function planOf(url, init) {
  const method = String(init?.method ?? 'GET').toUpperCase();
  const path = new URL(String(url)).pathname;
  if (method !== 'POST' || !CREATE_PATHS.some((pattern) => pattern.test(path))) return null;
  if (typeof init.body !== 'string') return null;
  let json;
  try {
    json = JSON.parse(init.body);
  } catch {
    return null;
  }
  if (json === null || typeof json !== 'object' || typeof json.model !== 'string') return null;
  return { json, chat: path.endsWith('/chat/completions'), stream: json.stream === true };
}

/** The field that bounds a request's output, by its endpoint. */
function maxTokensKey(plan) {
  return plan.chat ? 'max_completion_tokens' : 'max_output_tokens';
}

/**
 * The body as sent: the reservation id in its metadata, usage asked for on a
 * chat stream, and a missing output bound written in, so that the bound the
 * ledger holds is the one the provider enforces.
 */
function taggedBody(plan, reservationId, maxOutputTokens) {
  const json = { ...plan.json };
  if (json.max_completion_tokens == null && json.max_tokens == null && json.max_output_tokens == null) {
    json[maxTokensKey(plan)] = maxOutputTokens;
  }
  tagMetadata(json, reservationId);
  if (plan.chat && plan.stream) json.stream_options = { ...(json.stream_options ?? {}), include_usage: true };
  return JSON.stringify(json);
}

/**
 * The reservation id into the body's metadata, as the Python client's
 * _tag_body: not when the caller set the key, nor into a metadata that holds
 * 16 keys already (OpenAI's limit) or is not an object (the provider refuses
 * it either way); a missing or null metadata becomes one.
 */
function tagMetadata(json, reservationId) {
  const given = json.metadata;
  if (given !== undefined && given !== null && (typeof given !== 'object' || Array.isArray(given))) return;
  const metadata = { ...(given ?? {}) };
  if (Object.hasOwn(metadata, TAG_KEY) || Object.keys(metadata).length >= MAX_METADATA_KEYS) return;
  metadata[TAG_KEY] = reservationId;
  json.metadata = metadata;
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

/** Reads server-sent events as they pass, keeping the last usage one carried. */
class UsageWatcher {
  constructor() {
    this._pending = '';
    this._decoder = new TextDecoder();
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
      const usage = usageOf(event?.response ?? event);
      if (usage !== null) this.usage = usage;
    }
  }
}

/** The response handed to the SDK: the provider's stream, watched; `ended` settles how it ended. */
function watchedStream(response) {
  const reader = response.body.getReader();
  const watcher = new UsageWatcher();
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
        finish({ error });
      }
    },
    async cancel(reason) {
      // The SDK stops reading at [DONE]: a usage seen by then is the call's.
      finish({ usage: watcher.usage });
      await reader.cancel(reason);
    },
  });
  const handed = new Response(body, { status: response.status, statusText: response.statusText, headers: response.headers });
  return { handed, ended };
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

/**
 * A fetch that books every create call of the `openai` package in `ledger`.
 * @param {import('./client').LaneClient} ledger
 * @param {{ fetch?: typeof fetch, maxOutputTokens?: number }} [options]
 */
function ledgerFetch(ledger, { fetch: inner = globalThis.fetch, maxOutputTokens = DEFAULT_MAX_OUTPUT_TOKENS } = {}) {
  return async function fetchThroughLedger(url, init = {}) {
    const plan = planOf(url, init);
    if (plan === null) return inner(url, init);
    const reservationId = crypto.randomUUID();
    const body = taggedBody(plan, reservationId, maxOutputTokens);
    const sent = JSON.parse(body);
    const headers = new Headers(init.headers);
    headers.set(RESERVATION_HEADER, reservationId);
    let deliver;
    const delivered = new Promise((resolve, reject) => {
      deliver = { resolve, reject };
    });
    const booking = {
      reservationId,
      model: plan.json.model,
      requestBytes: Buffer.byteLength(body),
      maxOutputTokens: sent.max_completion_tokens ?? sent.max_tokens ?? sent.max_output_tokens,
    };
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
        deliver.resolve(new Response(text, { status: response.status, statusText: response.statusText, headers: response.headers }));
        return { httpStatus: response.status, usage: usageOf(parsed(text)) };
      }
      const { handed, ended } = watchedStream(response);
      deliver.resolve(handed);
      const end = await ended;
      if (end.error) throw end.error;
      return { httpStatus: response.status, usage: end.usage };
    });
    outcome.then(
      (result) => {
        if (!result.admitted) deliver.resolve(deniedResponse(result));
      },
      (error) => deliver.reject(error),
    );
    return delivered;
  };
}

module.exports = {
  ledgerFetch,
  planOf,
  neverSent,
  DEFAULT_MAX_OUTPUT_TOKENS,
  MAX_METADATA_KEYS,
  RESERVATION_HEADER,
  TAG_KEY,
};
