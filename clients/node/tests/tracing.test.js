'use strict';
// W3C trace context on the ledger's calls. Against a real ledger server: the
// trace id the server stores on each event (Event.trace_id, read back with
// ListEvents) is the lane's when its traceparent reached the server. Against
// the scripted ledger: exactly which headers went out.

const { after, before, describe, test } = require('node:test');
const assert = require('node:assert/strict');
const { execFileSync } = require('node:child_process');
const { randomBytes, randomUUID } = require('node:crypto');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const otel = require('@opentelemetry/api');
const { AsyncLocalStorageContextManager } = require('@opentelemetry/context-async-hooks');
const { W3CTraceContextPropagator } = require('@opentelemetry/core');
const { startLedger } = require('./ledger-server');
const { startFakeLedger } = require('./fake-ledger');
const { LaneClient, ledgerPackage } = require('..');
const { traceIdOf } = require('../lib/tracing');

const T0_SECONDS = 1_790_000_000;
const PRICES = { m: { input_nanos_per_million_tokens: '1000000000', output_nanos_per_million_tokens: '4000000000' } };
const REQUEST = Object.freeze({ model: 'm', requestBytes: 3500, maxOutputTokens: 100 });
const DEADLINE_MS = 3000;
const SUCCEEDED = async () => ({ httpStatus: 200, usage: { inputTokens: 10, outputTokens: 2 } });

const TRACE_ID = '4bf92f3577b34da6a3ce929d0e0e4736';
const SPAN_ID = '00f067aa0ba902b7';
const TRACEPARENT = `00-${TRACE_ID}-${SPAN_ID}-01`;
const HEX32 = /^[0-9a-f]{32}$/;

// Not W3C version-00 traceparents; the client must send none of them.
const INVALID = [
  ['a zero trace id', `00-${'0'.repeat(32)}-${SPAN_ID}-01`],
  ['a zero parent id', `00-${TRACE_ID}-${'0'.repeat(16)}-01`],
  ['upper-case hex', `00-${TRACE_ID.toUpperCase()}-${SPAN_ID}-01`],
  ['a short trace id', `00-${TRACE_ID.slice(1)}-${SPAN_ID}-01`],
  ['padding', ` ${TRACEPARENT} `],
  ['another version', `01-${TRACE_ID}-${SPAN_ID}-01`],
  ['extra fields', `${TRACEPARENT}-00`],
  ['version ff', `ff-${TRACE_ID}-${SPAN_ID}-01`],
  ['no flags', `00-${TRACE_ID}-${SPAN_ID}`],
  ['a number', 42],
  ['an empty string', ''],
];

function newTraceId() {
  return randomBytes(16).toString('hex');
}

function traceparentOf(traceId) {
  return `00-${traceId}-${SPAN_ID}-01`;
}

describe('traceparent validation', () => {
  test('a valid traceparent gives its trace id', () => {
    assert.equal(traceIdOf(TRACEPARENT), TRACE_ID);
    assert.equal(traceIdOf(`00-${TRACE_ID}-${SPAN_ID}-00`), TRACE_ID);
  });
  for (const [what, traceparent] of INVALID) {
    test(`${what} is not a traceparent`, () => assert.equal(traceIdOf(traceparent), null));
  }
});

describe('against the real ledger', () => {
  let ledger;
  let events;
  const clients = [];

  before(async () => {
    ledger = await startLedger();
    await ledger.clock.setTime({ seconds: String(T0_SECONDS), nanos: 0 });
    const metadata = new grpc.Metadata();
    if (ledger.adminGrant) metadata.set('authorization', `Bearer ${ledger.adminGrant}`);
    const stub = new (ledgerPackage().Ledger)(ledger.address, grpc.credentials.createInsecure());
    clients.push(stub);
    /** The booking's events as {kind: trace_id}, read back through a raw stub. */
    events = (lane, reservationId) =>
      new Promise((resolve, reject) => {
        const request = { lane, reservation_id: reservationId };
        stub.ListEvents(request, metadata, { deadline: Date.now() + 5000 }, (error, response) => {
          if (error) reject(error);
          else resolve(Object.fromEntries(response.events.map((event) => [event.kind, event.trace_id])));
        });
      });
  });

  after(async () => {
    for (const client of clients) client.close();
    await ledger?.stop();
  });

  async function laneClient(name) {
    await ledger.admin.putLane({ lane: { lane: name, limit_nanos: '1000000000', prices: PRICES } });
    const client = new LaneClient(ledger.address, name, {
      grant: ledger.adminGrant ?? undefined,
      deadlineMs: DEADLINE_MS,
    });
    clients.push(client);
    await client.waitForReady();
    return client;
  }

  test('call(): an explicit traceparent is the trace of both events of the booking', async () => {
    const client = await laneClient('trace-explicit');
    const settled = await client.call({ ...REQUEST, traceparent: TRACEPARENT }, SUCCEEDED);
    assert.equal(settled.ending, 'SUCCEEDED');
    assert.deepEqual(await events('trace-explicit', settled.reservationId), {
      reserved: TRACE_ID,
      settled: TRACE_ID,
    });

    const other = newTraceId();
    const refunded = await client.call({ ...REQUEST, traceparent: traceparentOf(other) }, async () => ({
      httpStatus: 429,
    }));
    assert.equal(refunded.ending, 'REFUND');
    assert.deepEqual(await events('trace-explicit', refunded.reservationId), { reserved: other, refunded: other });

    const thrown = newTraceId();
    let reservationId;
    await assert.rejects(
      client.call({ ...REQUEST, traceparent: traceparentOf(thrown) }, async (booking) => {
        reservationId = booking.reservationId;
        throw new Error('socket hang up');
      }),
      /socket hang up/,
    );
    assert.deepEqual(await events('trace-explicit', reservationId), { reserved: thrown, settled: thrown });
  });

  test('reserve(), settle(), refund(): each sends its own traceparent', async () => {
    const client = await laneClient('trace-low-level');
    const [first, second, third] = [newTraceId(), newTraceId(), newTraceId()];
    await client.reserve({ ...REQUEST, reservationId: 'r-1', traceparent: traceparentOf(first) });
    await client.settle({
      reservationId: 'r-1',
      outcome: 'SUCCEEDED',
      inputTokens: 1,
      outputTokens: 1,
      traceparent: traceparentOf(second),
    });
    assert.deepEqual(await events('trace-low-level', 'r-1'), { reserved: first, settled: second });

    await client.reserve({ ...REQUEST, reservationId: 'r-2', traceparent: traceparentOf(third) });
    await client.refund({ reservationId: 'r-2', httpStatus: 403, traceparent: traceparentOf(third) });
    assert.deepEqual(await events('trace-low-level', 'r-2'), { reserved: third, refunded: third });
  });

  test('an invalid traceparent is not sent: the ledger starts traces of its own', async () => {
    const client = await laneClient('trace-invalid');
    for (const [what, traceparent] of INVALID) {
      const result = await client.call({ ...REQUEST, traceparent }, SUCCEEDED);
      const traces = await events('trace-invalid', result.reservationId);
      assert.deepEqual(Object.keys(traces).sort(), ['reserved', 'settled'], what);
      for (const traceId of Object.values(traces)) {
        assert.match(traceId, HEX32, what);
        assert.notEqual(traceId, '0'.repeat(32), what);
        // 'another version' and 'padding' hold TRACE_ID in a form the server
        // itself would take: only the client's check kept it out.
        assert.notEqual(traceId, TRACE_ID, what);
      }
    }
  });

  test('without a traceparent or a context, call() starts one trace for its Reserve and its Settle', async () => {
    const client = await laneClient('trace-none');
    const first = await client.call(REQUEST, SUCCEEDED);
    const second = await client.call(REQUEST, SUCCEEDED);
    const traces = await events('trace-none', first.reservationId);
    const next = await events('trace-none', second.reservationId);
    assert.match(traces.reserved, HEX32);
    assert.equal(traces.settled, traces.reserved);
    assert.equal(next.settled, next.reserved);
    assert.notEqual(next.reserved, traces.reserved);
  });

  test('without a traceparent or a context, reserve() and settle() each get a server trace', async () => {
    const client = await laneClient('trace-none-moves');
    const reservationId = randomUUID();
    await client.reserve({ ...REQUEST, reservationId });
    await client.settle({ reservationId, outcome: 'SUCCEEDED', inputTokens: 10, outputTokens: 2, httpStatus: 200 });
    const traces = await events('trace-none-moves', reservationId);
    assert.match(traces.reserved, HEX32);
    assert.match(traces.settled, HEX32);
    assert.notEqual(traces.reserved, traces.settled);
  });

  describe('with an OpenTelemetry context', () => {
    let contextManager;

    before(() => {
      // What an application's SDK set-up does: a context manager that carries
      // the active context through awaits, and the W3C propagator.
      contextManager = new AsyncLocalStorageContextManager().enable();
      otel.context.setGlobalContextManager(contextManager);
      otel.propagation.setGlobalPropagator(new W3CTraceContextPropagator());
    });

    after(() => {
      otel.propagation.disable();
      otel.context.disable();
    });

    /** Runs fn with a span of traceId active, as an instrumented lane would. */
    function inSpan(traceId, fn) {
      const span = otel.trace.wrapSpanContext({ traceId, spanId: SPAN_ID, traceFlags: otel.TraceFlags.SAMPLED });
      return otel.context.with(otel.trace.setSpan(otel.context.active(), span), fn);
    }

    test('a call made inside the active span carries its trace id to the events', async () => {
      const client = await laneClient('trace-otel');
      const traceId = newTraceId();
      const result = await inSpan(traceId, async () => {
        await new Promise((resolve) => setTimeout(resolve, 5)); // the context survives an await
        return client.call(REQUEST, async () => {
          await new Promise((resolve) => setTimeout(resolve, 5));
          return SUCCEEDED();
        });
      });
      assert.equal(result.ending, 'SUCCEEDED');
      assert.deepEqual(await events('trace-otel', result.reservationId), { reserved: traceId, settled: traceId });

      const lowLevel = newTraceId();
      await inSpan(lowLevel, async () => {
        await client.reserve({ ...REQUEST, reservationId: 'otel-1' });
        await client.refund({ reservationId: 'otel-1', httpStatus: 400 });
      });
      assert.deepEqual(await events('trace-otel', 'otel-1'), { reserved: lowLevel, refunded: lowLevel });
    });

    test('an explicit traceparent wins over the active span; an invalid one does not', async () => {
      const client = await laneClient('trace-otel-explicit');
      const active = newTraceId();
      const explicit = await inSpan(active, () => client.call({ ...REQUEST, traceparent: TRACEPARENT }, SUCCEEDED));
      assert.deepEqual(await events('trace-otel-explicit', explicit.reservationId), {
        reserved: TRACE_ID,
        settled: TRACE_ID,
      });
      const invalid = await inSpan(active, () => client.call({ ...REQUEST, traceparent: INVALID[0][1] }, SUCCEEDED));
      assert.deepEqual(await events('trace-otel-explicit', invalid.reservationId), {
        reserved: active,
        settled: active,
      });
    });

    test('outside any span call() starts a trace of its own', async () => {
      const client = await laneClient('trace-otel-none');
      const result = await client.call(REQUEST, SUCCEEDED);
      const traces = await events('trace-otel-none', result.reservationId);
      assert.match(traces.reserved, HEX32);
      assert.equal(traces.settled, traces.reserved);
    });
  });
});

describe('the headers on the wire', () => {
  let fake;
  const clients = [];
  const balance = { lane: 'l', limit_nanos: '1', spent_nanos: '0', held_nanos: '0', charged_nanos: '0' };

  before(async () => {
    fake = await startFakeLedger({
      GetBalance: () => balance,
      GetBooking: (request) => ({ lane: 'l', reservation_id: request.reservation_id, state: 'OPEN' }),
      Reserve: (request) => ({ reservation_id: request.reservation_id, decision: 'ADMITTED', hold_nanos: '1' }),
      Settle: () => ({ charged_nanos: '1', state: 'SETTLED', balance }),
      Refund: () => ({ balance }),
    });
  });

  after(async () => {
    for (const client of clients) client.close();
    await fake?.stop();
  });

  function fakeClient() {
    const client = new LaneClient(`127.0.0.1:${fake.port}`, 'l', { grant: 'g', deadlineMs: DEADLINE_MS });
    clients.push(client);
    return client;
  }

  function traceHeadersSent(from) {
    return fake.calls.slice(from).map(({ method, metadata }) => ({
      method,
      traceparent: metadata.traceparent,
      tracestate: metadata.tracestate,
    }));
  }

  test('traceparent and tracestate go on every call; balance() and booking() take them too', async () => {
    const client = fakeClient();
    const from = fake.calls.length;
    const trace = { traceparent: TRACEPARENT, tracestate: 'lane=recall,vendor=x' };
    await client.call({ ...REQUEST, ...trace }, SUCCEEDED);
    await client.balance(trace);
    await client.booking('b-1', trace);
    assert.deepEqual(
      traceHeadersSent(from).map(({ method }) => method),
      ['Reserve', 'Settle', 'GetBalance', 'GetBooking'],
    );
    for (const sent of traceHeadersSent(from)) {
      assert.deepEqual(sent, { method: sent.method, ...trace });
    }
    assert.equal(fake.calls.at(-1).metadata.authorization, 'Bearer g');
  });

  test('an invalid traceparent, and a tracestate without a valid one, are never sent', async () => {
    const client = fakeClient();
    const from = fake.calls.length;
    for (const [, traceparent] of INVALID) {
      await client.call({ ...REQUEST, traceparent, tracestate: 'lane=recall' }, SUCCEEDED);
    }
    await client.call({ ...REQUEST, tracestate: 'lane=recall' }, SUCCEEDED);
    await client.balance({ traceparent: INVALID[0][1] });
    const sent = traceHeadersSent(from);
    assert.equal(sent.length, INVALID.length * 2 + 3);
    const invalid = new Set(INVALID.map(([, traceparent]) => traceparent));
    // Each call() sends a new trace of its own instead, the same on its Reserve and its Settle.
    for (let index = 0; index + 1 < sent.length; index += 2) {
      const [reserve, settle] = [sent[index], sent[index + 1]];
      assert.deepEqual([reserve.method, settle.method], ['Reserve', 'Settle']);
      assert.notEqual(traceIdOf(reserve.traceparent), null);
      assert.ok(!invalid.has(reserve.traceparent));
      assert.equal(settle.traceparent, reserve.traceparent);
    }
    assert.equal(new Set(sent.slice(0, -1).map(({ traceparent }) => traceparent)).size, INVALID.length + 1);
    assert.deepEqual(sent.at(-1), { method: 'GetBalance', traceparent: undefined, tracestate: undefined });
    for (const { tracestate } of sent) assert.equal(tracestate, undefined);
  });

  test('a tracestate that cannot be a header value is dropped, the traceparent kept', async () => {
    const client = fakeClient();
    const from = fake.calls.length;
    await client.balance({ traceparent: TRACEPARENT, tracestate: 'a=b\nc=d' });
    await client.balance({ traceparent: TRACEPARENT, tracestate: 'x'.repeat(513) });
    for (const sent of traceHeadersSent(from)) {
      assert.deepEqual(sent, { method: 'GetBalance', traceparent: TRACEPARENT, tracestate: undefined });
    }
  });

  test('@opentelemetry/api installed but no propagator registered: the span is not sent', async () => {
    const client = fakeClient();
    const from = fake.calls.length;
    const traceId = newTraceId();
    const span = otel.trace.wrapSpanContext({ traceId, spanId: SPAN_ID, traceFlags: 1 });
    await otel.context.with(otel.trace.setSpan(otel.context.active(), span), () => client.call(REQUEST, SUCCEEDED));
    await otel.context.with(otel.trace.setSpan(otel.context.active(), span), () => client.balance());
    const [reserve, settle, balance] = traceHeadersSent(from);
    // call() starts a trace of its own; balance() sends none.
    assert.match(traceIdOf(reserve.traceparent) ?? '', HEX32);
    assert.notEqual(traceIdOf(reserve.traceparent), traceId);
    assert.equal(settle.traceparent, reserve.traceparent);
    assert.equal(balance.traceparent, undefined);
  });
});

test('without @opentelemetry/api the client loads and sends explicit traceparents only', () => {
  // A child process where the module cannot be found, as for a lane that did
  // not install the optional peer.
  const script = `
    const Module = require('node:module');
    const resolve = Module._resolveFilename;
    Module._resolveFilename = function (request, ...rest) {
      if (request === '@opentelemetry/api') {
        throw Object.assign(new Error('not installed'), { code: 'MODULE_NOT_FOUND' });
      }
      return resolve.call(this, request, ...rest);
    };
    const tracing = require('./lib/tracing');
    require('.');
    const out = {
      api: tracing.openTelemetry(),
      none: tracing.traceHeaders({}),
      explicit: tracing.traceHeaders({ traceparent: ${JSON.stringify(TRACEPARENT)} }),
    };
    process.stdout.write(JSON.stringify(out));
  `;
  const out = JSON.parse(execFileSync(process.execPath, ['-e', script], { cwd: path.resolve(__dirname, '..') }));
  assert.deepEqual(out, { api: null, none: null, explicit: { traceparent: TRACEPARENT } });
});
