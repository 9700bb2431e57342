'use strict';
// Anthropic's messages API (POST .../v1/messages) through ledgerFetch, over
// real HTTP to a local Anthropic-like server, booked in a real ledger: the
// same calls the `@anthropic-ai/sdk` package makes with `fetch: ledgerFetch(lane)`,
// as the Python client's transport books them.

const { after, before, test } = require('node:test');
const assert = require('node:assert/strict');
const http = require('node:http');
const { startLedger } = require('./ledger-server');
const { LaneClient, ledgerFetch } = require('..');

// 1,000 nanos an input token, 100 a cache read, 1,250 a cache write, 4,000 an output token.
const PRICES = {
  claude: {
    input_nanos_per_million_tokens: '1000000000',
    output_nanos_per_million_tokens: '4000000000',
    cached_input_nanos_per_million_tokens: '100000000',
    cache_write_nanos_per_million_tokens: '1250000000',
  },
};
// Anthropic's input_tokens leaves the cache out: 300 uncached, 400 read, 200 written; 50 out.
const USAGE = { input_tokens: 300, cache_read_input_tokens: 400, cache_creation_input_tokens: 200, output_tokens: 50 };
const COST = 300n * 1000n + 400n * 100n + 200n * 1250n + 50n * 4000n;

let ledger;
let provider;
let client;
const seen = [];

function reply(body, res) {
  const kind = body.messages?.[0]?.content;
  const json = (status, value) => {
    res.writeHead(status, { 'content-type': 'application/json' });
    res.end(JSON.stringify(value));
  };
  if (kind === 'ok') return json(200, { id: 'msg_1', type: 'message', role: 'assistant', model: body.model, content: [{ type: 'text', text: 'hi' }], stop_reason: 'end_turn', usage: USAGE });
  if (kind === 'limited') return json(429, { type: 'error', error: { type: 'rate_limit_error', message: 'slow down' } });
  if (kind === 'overloaded') return json(529, { type: 'error', error: { type: 'overloaded_error', message: 'Overloaded' } });
  // A stream: the start carries the input counts, the last delta the cumulative output.
  res.writeHead(200, { 'content-type': 'text/event-stream' });
  const event = (type, value) => res.write(`event: ${type}\ndata: ${JSON.stringify({ type, ...value })}\n\n`);
  const start = { ...USAGE, output_tokens: 1 };
  event('message_start', { message: { id: 'msg_2', type: 'message', role: 'assistant', model: body.model, content: [], usage: start } });
  event('content_block_delta', { index: 0, delta: { type: 'text_delta', text: 'hi' } });
  event('message_delta', { delta: { stop_reason: 'end_turn' }, usage: { output_tokens: USAGE.output_tokens } });
  event('message_stop', {});
  res.end();
  return undefined;
}

before(async () => {
  ledger = await startLedger();
  await ledger.admin.putLane({ lane: { lane: 'claude-lane', limit_nanos: '1000000000', prices: PRICES } });
  provider = http.createServer((req, res) => {
    const parts = [];
    req.on('data', (part) => parts.push(part));
    req.on('end', () => {
      const raw = Buffer.concat(parts).toString('utf8');
      const body = JSON.parse(raw);
      seen.push({ url: req.url, headers: req.headers, raw, body });
      reply(body, res);
    });
  });
  await new Promise((resolve) => provider.listen(0, '127.0.0.1', resolve));
  client = new LaneClient(ledger.address, 'claude-lane', { grant: ledger.adminGrant ?? undefined, deadlineMs: 3000 });
  await client.waitForReady();
});

after(async () => {
  await client?.close();
  await new Promise((resolve) => provider?.close(resolve));
  await ledger?.stop();
});

/** One messages create through ledgerFetch, as the SDK sends it; the booking it made once ended. */
async function create(content, request = {}) {
  const fetch = ledgerFetch(client);
  const before = seen.length;
  const body = JSON.stringify({ model: 'claude', max_tokens: 100, messages: [{ role: 'user', content }], ...request });
  const url = `http://127.0.0.1:${provider.address().port}/v1/messages`;
  const response = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body });
  const text = await response.text();
  const sent = seen[before];
  const reservationId = sent.headers['x-ledger-reservation-id'];
  assert.ok(reservationId, 'a messages call is booked: its reservation id travels as a header');
  let booking;
  for (let attempt = 0; attempt < 50; attempt += 1) {
    booking = await client.booking(reservationId);
    if (booking.state !== 'OPEN') break;
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  return { response, text, sent, reservationId, booking };
}

test('a message is settled from its usage, the cache counts priced at their own rates', async () => {
  const { response, sent, reservationId, booking } = await create('ok');
  assert.equal(response.status, 200);
  assert.equal(booking.state, 'SETTLED');
  assert.equal(booking.amountNanos, COST);
  assert.equal(booking.requestBytes, BigInt(Buffer.byteLength(sent.raw)), 'the bytes booked are the bytes sent');
  assert.equal(booking.maxOutputTokens, 100n);
  // Anthropic takes only metadata.user_id: the id goes there, as the Python transport puts it.
  assert.deepEqual(sent.body.metadata, { user_id: reservationId });
});

test("a caller's metadata.user_id is left as it is", async () => {
  const { sent } = await create('ok', { metadata: { user_id: 'lane-user-7' } });
  assert.deepEqual(sent.body.metadata, { user_id: 'lane-user-7' });
});

test('a stream is settled from message_start and the last message_delta', async () => {
  const { response, text, sent, booking } = await create('stream', { stream: true });
  assert.equal(response.status, 200);
  assert.match(text, /message_stop/, 'the stream is handed on whole');
  assert.equal(sent.body.stream_options, undefined, "OpenAI's stream_options is not sent to Anthropic");
  assert.equal(booking.state, 'SETTLED');
  assert.equal(booking.amountNanos, COST);
});

test('a 429 is refunded and an overloaded 529 is UNKNOWN, at the hold', async () => {
  const limited = await create('limited');
  assert.equal(limited.response.status, 429);
  assert.equal(limited.booking.state, 'REFUNDED');
  assert.equal(limited.booking.amountNanos, 0n);
  const overloaded = await create('overloaded');
  assert.equal(overloaded.response.status, 529);
  assert.equal(overloaded.booking.state, 'SETTLED_UNKNOWN');
  assert.equal(overloaded.booking.amountNanos, overloaded.booking.holdNanos);
});

test('a request without max_tokens is bounded by the default, written into the body', async () => {
  const fetch = ledgerFetch(client, { maxOutputTokens: 64 });
  const before = seen.length;
  const url = `http://127.0.0.1:${provider.address().port}/v1/messages`;
  const body = JSON.stringify({ model: 'claude', messages: [{ role: 'user', content: 'ok' }] });
  await (await fetch(url, { method: 'POST', body })).text();
  assert.equal(seen[before].body.max_tokens, 64);
});

test('create paths are matched as the Python transport matches them, a trailing slash ignored', async () => {
  const { planOf } = require('../lib/providers');
  const post = { method: 'POST', body: '{"model":"m"}' };
  assert.equal((await planOf('http://h/v1/messages', post)).style, 'anthropic');
  assert.equal((await planOf('http://h/v1/messages/', post)).style, 'anthropic');
  assert.equal((await planOf('http://h/v1/chat/completions/', post)).style, 'chat');
  assert.equal((await planOf('http://h/v1/responses', post)).style, 'responses');
  // Not create calls: passed through, unbooked, in both clients.
  assert.equal(await planOf('http://h/v1/messages/count_tokens', post), null);
  assert.equal(await planOf('http://h/v1/messages/batches', post), null);
  assert.equal(await planOf('http://h/v1/messages', { method: 'GET' }), null);
});
