'use strict';
// The official `openai` package over real HTTP to a local OpenAI-compatible
// server, every create call booked in a real ledger through ledgerFetch.

const { after, before, test } = require('node:test');
const assert = require('node:assert/strict');
const http = require('node:http');
const fs = require('node:fs');
const net = require('node:net');
const path = require('node:path');
const v8 = require('node:v8');
const vm = require('node:vm');
const { OpenAI } = require('openai');
const { startLedger } = require('./ledger-server');
const { LaneClient, ledgerFetch, isContextOverflow, UnknownModel, InvalidArgument, ReservationIdReused } = require('..');
const { neverSent, RESERVATION_HEADER } = require('../lib/providers');

// 1,000 nanos an input token, 100 a cached one, 4,000 an output token.
const PRICES = {
  m: {
    input_nanos_per_million_tokens: '1000000000',
    output_nanos_per_million_tokens: '4000000000',
    cached_input_nanos_per_million_tokens: '100000000',
  },
};
// 600 uncached and 400 cached input tokens, 50 output tokens.
const COST = 600n * 1000n + 400n * 100n + 50n * 4000n;
const USAGE = { prompt_tokens: 1000, completion_tokens: 50, prompt_tokens_details: { cached_tokens: 400 } };
const OVERFLOW = {
  error: {
    message: "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
    type: 'invalid_request_error',
    param: 'messages',
    code: 'context_length_exceeded',
  },
};
const STALL_MS = 1500;

let ledger;
let provider;
let client;
const seen = []; // what the provider received: [{ headers, body }]
const replies = new Map(); // reply by the user message's content

function chatReply(body, res) {
  const content = body.messages?.[0]?.content;
  const kind = replies.get(content) ?? 'ok';
  const json = (status, value) => {
    res.writeHead(status, { 'content-type': 'application/json' });
    res.end(JSON.stringify(value));
  };
  // As OpenAI does: metadata only on a stored completion, and at most 16 pairs.
  if (body.metadata !== undefined && body.metadata !== null && body.store !== true) {
    return json(400, { error: { message: "The 'metadata' parameter is only allowed when 'store' is enabled.", type: 'invalid_request_error', param: 'metadata', code: null } });
  }
  if (body.metadata && Object.keys(body.metadata).length > 16) {
    return json(400, { error: { message: 'Invalid metadata: too many keys.', type: 'invalid_request_error', param: 'metadata', code: 'object_above_max_length' } });
  }
  if (kind === 'ok') return json(200, { id: 'c1', object: 'chat.completion', model: body.model, choices: [{ index: 0, message: { role: 'assistant', content: 'hi' }, finish_reason: 'stop' }], usage: USAGE });
  if (kind === 'overflow') return json(400, OVERFLOW);
  if (kind === 'forbidden') return json(403, { error: { message: 'no', type: 'permission_error' } });
  if (kind === 'limited') return json(429, { error: { message: 'slow down', type: 'rate_limit_error' } });
  if (kind === 'broken') return json(500, { error: { message: 'oops', type: 'server_error' } });
  // More output than the request's max: the ledger refuses this usage.
  if (kind === 'verbose') return json(200, { id: 'c2', object: 'chat.completion', model: body.model, choices: [], usage: { ...USAGE, completion_tokens: 100 } });
  // Every one of `n` choices runs to the bound: n times max_tokens of output.
  if (kind === 'choices') {
    const choices = Array.from({ length: body.n }, (_, index) => ({ index, message: { role: 'assistant', content: 'hi' }, finish_reason: 'length' }));
    return json(200, { id: 'c3', object: 'chat.completion', model: body.model, choices, usage: { ...USAGE, completion_tokens: body.n * body.max_tokens } });
  }
  if (kind === 'stall') return setTimeout(() => json(200, {}), STALL_MS);
  if (kind === 'stream') {
    res.writeHead(200, { 'content-type': 'text/event-stream' });
    const chunk = (value) => res.write(`data: ${JSON.stringify(value)}\n\n`);
    chunk({ id: 's1', object: 'chat.completion.chunk', model: body.model, choices: [{ index: 0, delta: { content: 'h' } }] });
    chunk({ id: 's1', object: 'chat.completion.chunk', model: body.model, choices: [{ index: 0, delta: { content: 'i' }, finish_reason: 'stop' }] });
    if (body.stream_options?.include_usage) chunk({ id: 's1', object: 'chat.completion.chunk', model: body.model, choices: [], usage: USAGE });
    res.end('data: [DONE]\n\n');
    return undefined;
  }
  if (kind === 'held stream') {
    // One chunk, then nothing more until the client hangs up.
    res.writeHead(200, { 'content-type': 'text/event-stream' });
    res.write(`data: ${JSON.stringify({ id: 's4', object: 'chat.completion.chunk', model: body.model, choices: [{ index: 0, delta: { content: 'h' } }] })}\n\n`);
    return undefined;
  }
  if (kind === 'cut after usage') {
    // The usage chunk arrives, then the connection is cut before [DONE].
    res.writeHead(200, { 'content-type': 'text/event-stream' });
    const chunk = (value) => `data: ${JSON.stringify(value)}\n\n`;
    res.write(chunk({ id: 's3', object: 'chat.completion.chunk', model: body.model, choices: [{ index: 0, delta: { content: 'hi' }, finish_reason: 'stop' }] }));
    res.write(chunk({ id: 's3', object: 'chat.completion.chunk', model: body.model, choices: [], usage: USAGE }), () => res.socket.destroy());
    return undefined;
  }
  if (kind === 'huge stream') {
    // A usage above the ledger's bound of 10^12 tokens: no usage, the stream still passes.
    res.writeHead(200, { 'content-type': 'text/event-stream' });
    const chunk = (value) => res.write(`data: ${JSON.stringify(value)}\n\n`);
    chunk({ id: 's2', object: 'chat.completion.chunk', model: body.model, choices: [{ index: 0, delta: { content: 'hi' }, finish_reason: 'stop' }] });
    chunk({ id: 's2', object: 'chat.completion.chunk', model: body.model, choices: [], usage: { ...USAGE, prompt_tokens: 10 ** 13 } });
    res.end('data: [DONE]\n\n');
    return undefined;
  }
  return json(500, {});
}

/** The Responses API, streamed: usage comes with response.completed. */
function responsesReply(body, res) {
  res.writeHead(200, { 'content-type': 'text/event-stream' });
  const event = (type, value) => res.write(`event: ${type}\ndata: ${JSON.stringify({ type, ...value })}\n\n`);
  const response = { id: 'r1', object: 'response', model: body.model, status: 'in_progress', output: [] };
  event('response.created', { response });
  event('response.output_text.delta', { item_id: 'm1', output_index: 0, content_index: 0, delta: 'hi' });
  const usage = { input_tokens: 1000, output_tokens: 50, input_tokens_details: { cached_tokens: 400 } };
  event('response.completed', { response: { ...response, status: 'completed', usage } });
  res.end();
}

/** A body as JSON, or {} when it is not a JSON object (ledgerFetch books bodies of any kind). */
function jsonObject(raw) {
  try {
    const value = JSON.parse(raw);
    return value !== null && typeof value === 'object' && !Array.isArray(value) ? value : {};
  } catch {
    return {};
  }
}

before(async () => {
  ledger = await startLedger();
  await ledger.admin.putLane({ lane: { lane: 'sdk', limit_nanos: '1000000000', prices: PRICES } });
  provider = http.createServer((req, res) => {
    const parts = [];
    req.on('data', (part) => parts.push(part));
    req.on('end', () => {
      const bytes = Buffer.concat(parts);
      const raw = bytes.toString('utf8');
      const body = jsonObject(raw);
      seen.push({ headers: req.headers, raw, bytes, body });
      if (req.url.endsWith('/responses')) responsesReply(body, res);
      else chatReply(body, res);
    });
  });
  await new Promise((resolve) => provider.listen(0, '127.0.0.1', resolve));
  client = new LaneClient(ledger.address, 'sdk', { grant: ledger.adminGrant ?? undefined, deadlineMs: 3000 });
  await client.waitForReady();
});

after(async () => {
  client?.close();
  await new Promise((resolve) => provider?.close(resolve));
  await ledger?.stop();
});

function sdk(options = {}) {
  return new OpenAI({
    apiKey: 'test',
    baseURL: `http://127.0.0.1:${provider.address().port}/v1`,
    fetch: ledgerFetch(client),
    maxRetries: 0,
    ...options,
  });
}

/** Sends one chat create with the reply `kind`; the booking it made. */
async function booked(kind, options = {}, request = {}, { tagged = true } = {}) {
  replies.set(kind, kind);
  const before = seen.length;
  let error = null;
  let answer = null;
  try {
    answer = await sdk(options).chat.completions.create({ model: 'm', max_tokens: 100, messages: [{ role: 'user', content: kind }], ...request });
    if (request.stream) for await (const _chunk of answer) { /* read to its end */ }
  } catch (thrown) {
    error = thrown;
  }
  const sent = seen[before];
  const reservationId = sent.headers['x-ledger-reservation-id'];
  assert.ok(reservationId, 'the reservation id travels as a header');
  // In the body's metadata only where OpenAI takes it: a stored chat completion.
  if (tagged) assert.equal(sent.body.metadata?.ledger_reservation_id, request.store === true ? reservationId : undefined);
  const booking = await endedBooking(reservationId);
  assert.equal(booking.requestBytes, BigInt(Buffer.byteLength(sent.raw)), 'the bytes booked are the bytes sent');
  return { booking, error, answer, sent };
}

/** The booking once it has ended: it may end a moment after the SDK has its answer (a stream's end). */
async function endedBooking(reservationId, lane = client) {
  let booking;
  for (let attempt = 0; attempt < 50; attempt += 1) {
    booking = await lane.booking(reservationId);
    if (booking.state !== 'OPEN') break;
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  return booking;
}

/** A port on which nothing listens: a connection to it is refused. */
async function closedPort() {
  const server = net.createServer();
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address();
  await new Promise((resolve) => server.close(resolve));
  return port;
}

/** ledgerFetch over `inner`, noting the reservation id of every attempt. */
function notingFetch(inner = globalThis.fetch) {
  const ids = [];
  const fetch = ledgerFetch(client, {
    fetch: (url, init) => {
      ids.push(new Headers(init.headers).get(RESERVATION_HEADER));
      return inner(url, init);
    },
  });
  return { ids, fetch };
}

/** ledgerFetch as loaded with newReservationId always giving `id` (a lane that chose its id). */
function pinnedLedgerFetch(id) {
  const argumentsModule = require('../lib/arguments');
  const fresh = argumentsModule.newReservationId;
  const providersPath = require.resolve('../lib/providers');
  const loaded = require.cache[providersPath];
  argumentsModule.newReservationId = () => id;
  delete require.cache[providersPath];
  try {
    return require('../lib/providers').ledgerFetch;
  } finally {
    argumentsModule.newReservationId = fresh;
    require.cache[providersPath] = loaded;
  }
}

test('two processes whose transports reserve under one id make one provider call: the second is refused', async () => {
  // The second Reserve gets the first process's answer, admitted: its provider
  // call would run again under an ended booking, its cost never booked.
  const pinned = pinnedLedgerFetch('pinned-1');
  const url = `http://127.0.0.1:${provider.address().port}/v1/chat/completions`;
  const body = JSON.stringify({ model: 'm', max_tokens: 100, messages: [{ role: 'user', content: 'ok' }] });
  const init = () => ({ method: 'POST', headers: { 'content-type': 'application/json' }, body });
  const lanes = [0, 1].map(() => new LaneClient(ledger.address, 'sdk', { grant: ledger.adminGrant ?? undefined, deadlineMs: 3000 }));
  const before = seen.length;
  try {
    assert.equal((await pinned(lanes[0])(url, init())).status, 200);
    await assert.rejects(
      pinned(lanes[1])(url, init()),
      (error) => error instanceof ReservationIdReused && error.message.includes('pinned-1'),
    );
  } finally {
    for (const lane of lanes) lane.close();
  }
  assert.equal(seen.length - before, 1, 'one provider call under one id');
});

test('a completion is settled from its usage, cached tokens included', async () => {
  const { booking, error } = await booked('ok');
  assert.equal(error, null);
  assert.equal(booking.state, 'SETTLED');
  assert.equal(booking.amountNanos, COST);
});

test('4xx replies are refunded: a context overflow, a 403, a 429', async () => {
  for (const kind of ['overflow', 'forbidden', 'limited']) {
    const { booking, error } = await booked(kind);
    assert.ok(error instanceof OpenAI.APIError, kind);
    assert.equal(booking.state, 'REFUNDED', kind);
    assert.equal(booking.amountNanos, 0n, kind);
    if (kind === 'overflow') assert.ok(isContextOverflow(error.status, { error: error.error }));
  }
});

test('a 500 without usage and a stall past the deadline are charged at the hold', async () => {
  for (const [kind, options] of [['broken', {}], ['stall', { timeout: 300 }]]) {
    const { booking, error } = await booked(kind, options);
    assert.ok(error instanceof Error, kind);
    assert.equal(booking.state, 'SETTLED_UNKNOWN', kind);
    assert.equal(booking.amountNanos, booking.holdNanos, kind);
  }
});

test('a stream asks for its usage and is settled from the last chunk', async () => {
  const { booking, sent } = await booked('stream', {}, { stream: true });
  assert.equal(sent.body.stream_options.include_usage, true);
  assert.equal(booking.state, 'SETTLED');
  assert.equal(booking.amountNanos, COST);
});

test('a denial sends nothing and is an APIError the SDK does not retry', async () => {
  await ledger.admin.putLane({ lane: { lane: 'sdk-tiny', limit_nanos: '1', prices: PRICES } });
  const tiny = new LaneClient(ledger.address, 'sdk-tiny', { grant: ledger.adminGrant ?? undefined, deadlineMs: 3000 });
  const before = seen.length;
  const openai = new OpenAI({ apiKey: 'test', baseURL: `http://127.0.0.1:${provider.address().port}/v1`, fetch: ledgerFetch(tiny), maxRetries: 2 });
  await assert.rejects(
    openai.chat.completions.create({ model: 'm', max_tokens: 100, messages: [{ role: 'user', content: 'ok' }] }),
    (error) => error instanceof OpenAI.APIError && error.status === 402 && error.code === 'HOLD_EXCEEDS_LIMIT',
  );
  assert.equal(seen.length, before, 'nothing reached the provider');
  tiny.close();
});

test('a request without a max gets the default written in and reserved', async () => {
  const { booking, sent } = await booked('ok', {}, { max_tokens: undefined });
  assert.equal(sent.body.max_completion_tokens, 4096);
  assert.equal(booking.maxOutputTokens, 4096n);
  assert.equal(booking.state, 'SETTLED');
});

test('a chat asking for n choices reserves the bound n times and is settled from its usage', async () => {
  // Each choice may run to max_tokens, so the call can bill n times it.
  // Reserved for one choice, the real usage was refused (more output than the
  // max) and the call settled UNKNOWN at a hold a third of what it could cost.
  const { booking, sent } = await booked('choices', {}, { n: 3 });
  assert.equal(sent.body.n, 3);
  assert.equal(sent.body.max_tokens, 100);
  assert.equal(booking.maxOutputTokens, 300n);
  assert.equal(booking.state, 'SETTLED');
  assert.equal(booking.amountNanos, 600n * 1000n + 400n * 100n + 300n * 4000n);
});

test('a bound times n past 2^53 is refused as max_output_tokens, as the Python client is, and sends nothing', async () => {
  // 1,000,000,007 x 100,000,003 is about 1e17: a Number would round it before the range check.
  const before = seen.length;
  const errors = [];
  const openai = new OpenAI({ apiKey: 'test', baseURL: `http://127.0.0.1:${provider.address().port}/v1`, fetch: async (...args) => {
    try {
      return await ledgerFetch(client)(...args);
    } catch (error) {
      errors.push(error);
      throw error;
    }
  }, maxRetries: 0 });
  await assert.rejects(openai.chat.completions.create({ model: 'm', max_tokens: 1_000_000_007, n: 100_000_003, messages: [{ role: 'user', content: 'ok' }] }));
  assert.equal(errors.length, 1);
  assert.ok(errors[0] instanceof InvalidArgument, `${errors[0]}`);
  // The product is a whole number: refused for its size, not called no integer.
  assert.match(errors[0].message, /max_output_tokens: must be between/);
  assert.equal(seen.length, before, 'nothing reached the provider');
});

test('a Responses stream is settled from response.completed', async () => {
  const before = seen.length;
  const stream = await sdk().responses.create({ model: 'm', input: 'hi', max_output_tokens: 100, stream: true });
  for await (const _event of stream) { /* read to its end */ }
  const sent = seen[before];
  const reservationId = sent.headers['x-ledger-reservation-id'];
  let booking;
  for (let attempt = 0; attempt < 50; attempt += 1) {
    booking = await client.booking(reservationId);
    if (booking.state !== 'OPEN') break;
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  assert.equal(booking.state, 'SETTLED');
  assert.equal(booking.amountNanos, COST);
  assert.equal(sent.body.stream_options, undefined, 'include_usage is for chat streams only');
});

test('other requests pass through unbooked', async () => {
  const before = seen.length;
  await sdk().models.list().catch(() => null);
  assert.equal(seen.length, before + 1);
  assert.equal(seen[before].headers['x-ledger-reservation-id'], undefined);
});

test('a refused connection is refunded as never sent, each attempt a booking of its own', async () => {
  const { ids, fetch } = notingFetch();
  const openai = new OpenAI({ apiKey: 'test', baseURL: `http://127.0.0.1:${await closedPort()}/v1`, fetch, maxRetries: 1 });
  await assert.rejects(
    openai.chat.completions.create({ model: 'm', max_tokens: 100, messages: [{ role: 'user', content: 'ok' }] }),
    (error) => error instanceof OpenAI.APIConnectionError,
  );
  assert.equal(ids.length, 2, 'the SDK retried once');
  for (const reservationId of ids) {
    const booking = await endedBooking(reservationId);
    assert.equal(booking.state, 'REFUNDED', 'a call never sent costs zero');
    assert.equal(booking.amountNanos, 0n);
  }
});

test('a DNS failure is never sent too; a reset or an abort once connected is UNKNOWN', async () => {
  // What undici's fetch rejects with (TypeError "fetch failed", the system error as its cause).
  const failed = (fields) => new TypeError('fetch failed', { cause: Object.assign(new Error(fields.code), fields) });
  const dns = () => failed({ code: 'ENOTFOUND', syscall: 'getaddrinfo', hostname: 'api.example.invalid' });
  const reset = () => failed({ code: 'ECONNRESET', syscall: 'read' });
  const abort = () => new DOMException('This operation was aborted', 'AbortError');
  for (const [make, state] of [[dns, 'REFUNDED'], [reset, 'SETTLED_UNKNOWN'], [abort, 'SETTLED_UNKNOWN']]) {
    const error = make();
    const { ids, fetch } = notingFetch(async () => {
      throw error;
    });
    await assert.rejects(sdk({ fetch }).chat.completions.create({ model: 'm', max_tokens: 100, messages: [{ role: 'user', content: 'ok' }] }));
    assert.equal(ids.length, 1);
    assert.equal((await endedBooking(ids[0])).state, state, `${error.name}: ${error.cause?.code ?? error.message}`);
  }
});

test('never sent: exactly the errors of a connection that was never made', () => {
  const cause = (fields) => new TypeError('fetch failed', { cause: Object.assign(new Error('x'), fields) });
  // httpx's ConnectError and ConnectTimeout, as undici reports them.
  assert.equal(neverSent(cause({ code: 'ECONNREFUSED', syscall: 'connect', address: '127.0.0.1', port: 9 })), 'could not connect: ECONNREFUSED');
  assert.equal(neverSent(cause({ code: 'ENOTFOUND', syscall: 'getaddrinfo' })), 'could not connect: ENOTFOUND');
  assert.equal(neverSent(cause({ code: 'EAI_AGAIN', syscall: 'getaddrinfo' })), 'could not connect: EAI_AGAIN');
  assert.equal(neverSent(cause({ code: 'EHOSTUNREACH', syscall: 'connect' })), 'could not connect: EHOSTUNREACH');
  assert.equal(neverSent(cause({ code: 'ETIMEDOUT', syscall: 'connect' })), 'could not connect: ETIMEDOUT');
  assert.equal(neverSent(cause({ code: 'UND_ERR_CONNECT_TIMEOUT', name: 'ConnectTimeoutError' })), 'could not connect: UND_ERR_CONNECT_TIMEOUT');
  assert.equal(neverSent(cause({ code: 'ERR_TLS_CERT_ALTNAME_INVALID' })), 'could not connect: ERR_TLS_CERT_ALTNAME_INVALID');
  assert.equal(neverSent(cause({ code: 'SELF_SIGNED_CERT_IN_CHAIN' })), 'could not connect: SELF_SIGNED_CERT_IN_CHAIN');
  // Happy eyeballs: every address refused.
  const refused = (address) => Object.assign(new Error('refused'), { code: 'ECONNREFUSED', syscall: 'connect', address });
  const all = new TypeError('fetch failed', { cause: Object.assign(new AggregateError([refused('::1'), refused('127.0.0.1')]), { code: 'ECONNREFUSED' }) });
  assert.equal(neverSent(all), 'could not connect: ECONNREFUSED');
  // Once connected, or not knowing: it may have been sent.
  for (const error of [
    cause({ code: 'ECONNRESET', syscall: 'read' }),
    cause({ code: 'EPIPE', syscall: 'write' }),
    cause({ code: 'UND_ERR_SOCKET', name: 'SocketError' }),
    cause({ code: 'UND_ERR_HEADERS_TIMEOUT' }),
    cause({ code: 'UND_ERR_BODY_TIMEOUT' }),
    new TypeError('fetch failed', { cause: new AggregateError([refused('::1'), Object.assign(new Error('reset'), { code: 'ECONNRESET', syscall: 'read' })]) }),
    new DOMException('This operation was aborted', 'AbortError'),
    new DOMException('The operation timed out', 'TimeoutError'),
    new TypeError('fetch failed'),
    new Error('socket hang up'),
    null,
    'a string',
  ]) {
    assert.equal(neverSent(error), null, String(error?.cause?.code ?? error?.name ?? error));
  }
});

test('a chat completion not stored is tagged in the header only: OpenAI refuses its metadata', async () => {
  const { booking, error, sent } = await booked('ok', {}, { metadata: { team: 'recall' } }, { tagged: false });
  assert.ok(error, "the caller's own metadata without store: true is OpenAI's 400, as it would be unbooked");
  assert.equal(booking.state, 'REFUNDED');
  const plain = await booked('ok');
  assert.equal(plain.error, null);
  assert.equal(plain.sent.body.metadata, undefined, 'nothing added to the body');
  assert.equal(plain.booking.state, 'SETTLED');
  const stored = await booked('ok', {}, { store: true, metadata: { team: 'recall' } });
  assert.equal(stored.sent.body.metadata.team, 'recall');
  assert.equal(stored.booking.state, 'SETTLED');
  assert.ok(sent.headers['x-ledger-reservation-id']);
});

test('a full metadata is left as it is; the header still carries the reservation id', async () => {
  const full = Object.fromEntries(Array.from({ length: 16 }, (_, index) => [`k${index}`, `v${index}`]));
  const { booking, error, sent } = await booked('ok', {}, { metadata: full, store: true }, { tagged: false });
  assert.equal(error, null, 'OpenAI refuses a 17th key with a 400');
  assert.deepEqual(sent.body.metadata, full);
  assert.ok(sent.headers['x-ledger-reservation-id']);
  assert.equal(booking.state, 'SETTLED');

  const fifteen = Object.fromEntries(Object.entries(full).slice(0, 15));
  const tagged = await booked('ok', {}, { metadata: fifteen, store: true });
  assert.equal(Object.keys(tagged.sent.body.metadata).length, 16, 'room for one more: tagged');
  assert.equal(tagged.booking.state, 'SETTLED');

  // Not an object: left for the provider to refuse, as the Python client does.
  const odd = await booked('ok', {}, { metadata: 'not an object', store: true }, { tagged: false });
  assert.equal(odd.sent.body.metadata, 'not an object');
});

// --- bodies that are not a JSON string ----------------------------------------------

const CHAT = Object.freeze({ model: 'm', max_tokens: 100, messages: [{ role: 'user', content: 'ok' }] });

/** A lane that prices the model "unknown" too, so that a body without a model is booked and sent. */
async function laneForAnyBody() {
  await ledger.admin.putLane({ lane: { lane: 'sdk-any', limit_nanos: '1000000000', prices: { ...PRICES, unknown: PRICES.m } } });
  const lane = new LaneClient(ledger.address, 'sdk-any', { grant: ledger.adminGrant ?? undefined, deadlineMs: 3000 });
  await lane.waitForReady();
  return lane;
}

/** POSTs `body` to the chat endpoint through ledgerFetch(lane): what the provider got, and its booking. */
async function postedThrough(lane, body, init = {}) {
  const before = seen.length;
  const url = `http://127.0.0.1:${provider.address().port}/v1/chat/completions`;
  const response = await ledgerFetch(lane)(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body, ...init });
  assert.equal(response.status, 200);
  await response.arrayBuffer();
  assert.equal(seen.length, before + 1, 'one request reached the provider');
  const sent = seen[before];
  const reservationId = sent.headers[RESERVATION_HEADER];
  assert.ok(reservationId, 'booked: the reservation id travels as a header');
  const booking = await endedBooking(reservationId, lane);
  assert.equal(booking.requestBytes, BigInt(sent.bytes.length), 'the bytes booked are the bytes sent');
  return { sent, booking };
}

test('a create call given as a Request is booked as one given as a URL and its init', async () => {
  // fetch(new Request(url, {method: 'POST', body})) went out unbooked: the
  // method and body were looked for in the init alone, and there was none.
  const lane = await laneForAnyBody();
  try {
    const before = seen.length;
    const url = `http://127.0.0.1:${provider.address().port}/v1/chat/completions`;
    const request = new Request(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(CHAT) });
    const response = await ledgerFetch(lane)(request);
    assert.equal(response.status, 200);
    await response.arrayBuffer();
    assert.equal(seen.length, before + 1, 'one request reached the provider');
    const sent = seen[before];
    assert.equal(sent.headers['content-type'], 'application/json', "the Request's headers are sent");
    const booking = await endedBooking(sent.headers[RESERVATION_HEADER], lane);
    assert.equal(booking.state, 'SETTLED');
    assert.equal(booking.requestBytes, BigInt(sent.bytes.length), 'the bytes booked are the bytes sent');
  } finally {
    await lane.close();
  }
});

test('a JSON body given as bytes or a stream is booked like a string: tagged, its model and max', async () => {
  const lane = await laneForAnyBody();
  try {
    // Stored: OpenAI takes a chat completion's metadata, the tag, only then.
    const json = Buffer.from(JSON.stringify({ ...CHAT, store: true }));
    const padded = Buffer.concat([Buffer.from('xx'), json, Buffer.from('yy')]);
    const streamOf = (bytes) => new ReadableStream({
      start(controller) {
        controller.enqueue(new Uint8Array(bytes.subarray(0, 10)));
        controller.enqueue(new Uint8Array(bytes.subarray(10)));
        controller.close();
      },
    });
    const bodies = [
      ['a Buffer', () => json, {}],
      ['a Uint8Array inside a larger buffer', () => new Uint8Array(padded.buffer, padded.byteOffset + 2, json.length), {}],
      ['an ArrayBuffer', () => json.buffer.slice(json.byteOffset, json.byteOffset + json.length), {}],
      ['a stream', () => streamOf(json), { duplex: 'half' }],
    ];
    for (const [kind, body, init] of bodies) {
      const { sent, booking } = await postedThrough(lane, body(), init);
      assert.equal(booking.model, 'm', kind);
      assert.equal(booking.maxOutputTokens, 100n, kind);
      assert.equal(sent.body.metadata.ledger_reservation_id, sent.headers[RESERVATION_HEADER], kind);
      assert.equal(booking.state, 'SETTLED', kind);
      assert.equal(booking.amountNanos, COST, kind);
    }
  } finally {
    lane.close();
  }
});

test('a JSON body that needs no change is sent and booked byte for byte, as the Python transport does', async () => {
  // The Python transport sends the raw body when its edits change nothing
  // (prepare_request: `raw if edited == parsed`), so both clients book the
  // same request_bytes for it, and the caller's text (its spacing, its
  // integers past 2^53) reaches the provider as written.
  const lane = await laneForAnyBody();
  try {
    const raw = '{ "model": "m", "max_tokens": 100, "n": 12345678901234567890, "store": true,\n  "metadata": {"ledger_reservation_id": "mine"},\n  "messages": [{"role": "user", "content": "ok"}] }';
    for (const body of [raw, Buffer.from(raw)]) {
      const { sent, booking } = await postedThrough(lane, body);
      assert.equal(sent.raw, raw, 'sent as written');
      assert.equal(booking.requestBytes, BigInt(Buffer.byteLength(raw)));
      assert.equal(booking.model, 'm');
      assert.equal(booking.maxOutputTokens, 100n);
    }
    // An integral bound written as a float is the count, in both clients.
    const float = raw.replace('"max_tokens": 100', '"max_tokens": 100.0');
    const floated = await postedThrough(lane, float);
    assert.equal(floated.sent.raw, float);
    assert.equal(floated.booking.maxOutputTokens, 100n);
    // A metadata that is not an object is left for the provider to refuse: nothing else to change.
    const odd = '{"model": "m", "max_tokens": 100, "store": true, "metadata": "x", "messages": []}';
    assert.equal((await postedThrough(lane, odd)).sent.raw, odd);
    // A chat stream whose stream_options is not an object gets {include_usage: true}
    // in its place, as in Python, not the string's characters or the array's items.
    for (const options of ['"ab"', '[1, 2]']) {
      const stream = `{"model": "m", "max_tokens": 100, "stream": true, "stream_options": ${options}, "messages": []}`;
      const { sent } = await postedThrough(lane, stream);
      assert.deepEqual(sent.body.stream_options, { include_usage: true }, options);
    }
  } finally {
    lane.close();
  }
});

test('a body that is not a JSON object, or names no model, is booked as the model "unknown"', async () => {
  const lane = await laneForAnyBody();
  try {
    const cases = [
      ['bytes that are not JSON', Buffer.from('plain bytes, not JSON'), false],
      ['unparsable JSON', '{"model": "m", "messages": [', false],
      ['a JSON array', '[1, 2, 3]', false],
      ['a JSON object without a model', JSON.stringify({ messages: CHAT.messages, store: true }), true],
    ];
    for (const [kind, body, isObject] of cases) {
      const { sent, booking } = await postedThrough(lane, body);
      assert.equal(booking.model, 'unknown', kind);
      assert.equal(booking.maxOutputTokens, 4096n, kind);
      if (isObject) {
        assert.equal(sent.body.max_completion_tokens, 4096, `${kind}: the bound written in`);
        assert.equal(sent.body.metadata.ledger_reservation_id, sent.headers[RESERVATION_HEADER], kind);
      } else {
        assert.deepEqual(sent.bytes, Buffer.from(body), `${kind}: sent as it is`);
      }
      assert.equal(booking.state, 'SETTLED', kind);
    }
  } finally {
    lane.close();
  }
});

test('a body booked as "unknown" on a lane without that price is refused, and nothing is sent', async () => {
  const before = seen.length;
  const url = `http://127.0.0.1:${provider.address().port}/v1/chat/completions`;
  await assert.rejects(ledgerFetch(client)(url, { method: 'POST', body: Buffer.from('not JSON') }), UnknownModel);
  assert.equal(seen.length, before, 'nothing reached the provider');
});

test('a stream whose usage is out of bounds reaches the SDK whole, and is charged at the hold', async () => {
  const { booking, error } = await booked('huge stream', {}, { stream: true });
  assert.equal(error, null, 'the stream is not broken by a usage it cannot book');
  assert.equal(booking.state, 'SETTLED_UNKNOWN');
  assert.equal(booking.amountNanos, booking.holdNanos);
});

test('a stream cut off after its usage arrived is settled from that usage, as the Python transport does', async () => {
  // It was settled UNKNOWN, at the hold, although the provider had reported
  // what the call cost: the usage seen was dropped with the error.
  const { booking, error } = await booked('cut after usage', {}, { stream: true });
  assert.ok(error instanceof Error, 'the reader still sees the cut');
  assert.equal(booking.state, 'SETTLED');
  assert.equal(booking.amountNanos, COST);
});

test('ledgerFetch of something that is no LaneClient, or with a fetch that is no function, is refused when made', () => {
  // Each was taken, and every create call then failed inside the fetch: the
  // SDK retried it as a connection error, and a fetch that was no function
  // failed after the Reserve, so each attempt was charged at its hold.
  for (const [args, message] of [
    [[{}], /^ledgerFetch\(\) needs the lane's LaneClient, not object/],
    [['127.0.0.1:50051'], /^ledgerFetch\(\) needs the lane's LaneClient, not string/],
    [[undefined], /^ledgerFetch\(\) needs the lane's LaneClient, not undefined/],
    [[client, { fetch: 'x' }], /^ledgerFetch\(\) options: fetch must be a function, not string/],
  ]) {
    assert.throws(() => ledgerFetch(...args), { name: 'TypeError', message });
  }
  assert.equal(typeof ledgerFetch(client, { fetch: globalThis.fetch }), 'function');
});

test('a stream dropped unread is ended when collected, at its hold', async () => {
  // The provider ran the call (a 200 event stream came back), but nothing
  // read or cancelled the stream: its booking waited on the stream's end and
  // stayed open until its hold expired (at zero on a lane whose
  // expire_charge is ZERO), collected or not. As the Python transport's.
  v8.setFlagsFromString('--expose-gc');
  const collect = vm.runInNewContext('gc');
  replies.set('dropped stream', 'held stream');
  const before = seen.length;
  await sdk().chat.completions.create({ model: 'm', max_tokens: 100, messages: [{ role: 'user', content: 'dropped stream' }], stream: true });
  const reservationId = seen[before].headers['x-ledger-reservation-id'];
  let booking;
  for (let attempt = 0; attempt < 50; attempt += 1) {
    await new Promise((resolve) => setTimeout(resolve, 20));
    collect();
    booking = await client.booking(reservationId);
    if (booking.state !== 'OPEN') break;
  }
  assert.equal(booking.state, 'SETTLED_UNKNOWN');
  assert.equal(booking.amountNanos, booking.holdNanos);
});

// --- a usage the ledger refuses --------------------------------------------------------

test('a usage the ledger refuses (more output than the max) is settled UNKNOWN, with a warning', async () => {
  const warnings = [];
  const logger = { warn: (message) => warnings.push(message), error: (message) => warnings.push(`error: ${message}`) };
  const lane = new LaneClient(ledger.address, 'sdk', { grant: ledger.adminGrant ?? undefined, deadlineMs: 3000, logger });
  try {
    replies.set('verbose', 'verbose');
    const before = seen.length;
    const openai = sdk({ fetch: ledgerFetch(lane) });
    await openai.chat.completions.create({ model: 'm', max_tokens: 77, messages: [{ role: 'user', content: 'verbose' }] });
    const reservationId = seen[before].headers[RESERVATION_HEADER];
    const booking = await endedBooking(reservationId);
    assert.equal(booking.state, 'SETTLED_UNKNOWN', 'not left open to expire');
    assert.equal(booking.amountNanos, booking.holdNanos);
    // call() settles it and says so once, as for a call() of the lane's own.
    assert.equal(warnings.length, 1);
    assert.match(warnings[0], new RegExp(`^ledger: .*${reservationId}.*OUTPUT_EXCEEDS_MAX_TOKENS.*settled UNKNOWN`));
  } finally {
    lane.close();
  }
});

// --- the README's example ----------------------------------------------------------------

test("the README's openai example runs as written: a completion booked, a denial answered with null", async () => {
  const readme = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
  const code = [...readme.matchAll(/```js\n([\s\S]*?)```/g)].map((match) => match[1]).find((block) => block.includes('ledgerFetch(lane)'));
  assert.ok(code, 'the README has the openai example');
  const recallLane = (limitNanos) => ({ lane: { lane: 'recall', limit_nanos: limitNanos, prices: { 'jev-small': PRICES.m } } });
  await ledger.admin.putLane(recallLane('1000000000'));
  const environment = {
    LEDGER_ADDRESS: ledger.address,
    LEDGER_GRANT: ledger.adminGrant ?? '',
    OPENAI_API_KEY: 'test',
    OPENAI_BASE_URL: `http://127.0.0.1:${provider.address().port}/v1`,
  };
  const saved = Object.fromEntries(Object.keys(environment).map((name) => [name, process.env[name]]));
  Object.assign(process.env, environment);
  let example;
  try {
    const load = new Function('require', `${code}\nreturn { recall, lane };`);
    example = load((name) => require(name === '@lane-ledger/client' ? '..' : name));
    const before = seen.length;
    assert.equal(await example.recall([{ role: 'user', content: 'ok' }]), 'hi');
    assert.equal(seen[before].body.model, 'jev-small');
    const booking = await endedBooking(seen[before].headers[RESERVATION_HEADER], example.lane);
    assert.equal(booking.state, 'SETTLED');
    assert.equal(booking.amountNanos, COST);
    await ledger.admin.putLane(recallLane('1'));
    assert.equal(await example.recall([{ role: 'user', content: 'ok' }]), null, 'denied');
    assert.equal(seen.length, before + 1, 'nothing sent for the denied call');
  } finally {
    example?.lane.close();
    for (const [name, value] of Object.entries(saved)) {
      if (value === undefined) delete process.env[name];
      else process.env[name] = value;
    }
  }
});

test('a lane that closes its client right after a call leaves no booking open', async () => {
  // The SDK had its answer before the Settle was sent, and close() cut the
  // Settle off ("the ledger call did not start"): the booking stayed open to
  // expire. Python's transport ends the booking before it returns.
  for (const [kind, request, state] of [
    ['ok', {}, 'SETTLED'],
    ['verbose', { max_tokens: 10 }, 'SETTLED_UNKNOWN'],
    ['stream', { stream: true, stream_options: { include_usage: true } }, 'SETTLED'],
  ]) {
    replies.set(kind, kind);
    const lane = new LaneClient(ledger.address, 'sdk', { grant: ledger.adminGrant ?? undefined, deadlineMs: 3000, logger: null });
    const before = seen.length;
    const answer = await sdk({ fetch: ledgerFetch(lane) }).chat.completions.create({ model: 'm', max_tokens: 100, messages: [{ role: 'user', content: kind }], ...request });
    if (request.stream) for await (const _chunk of answer) { /* read to its end */ }
    await lane.close();
    const reservationId = seen[before].headers['x-ledger-reservation-id'];
    assert.equal((await client.booking(reservationId)).state, state, kind);
  }
});
