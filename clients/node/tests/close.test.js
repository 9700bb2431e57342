'use strict';
// A lane that closes its client while calls are under way (a SIGTERM handler,
// the end of a batch): each call under way is ended by the outcome table, not
// cut off to expire at its hold, and a call made after close() sends nothing.

const { test } = require('node:test');
const assert = require('node:assert/strict');
const grpc = require('@grpc/grpc-js');
const { startFakeLedger, ledgerStatus } = require('./fake-ledger');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { LaneClient, ClientClosed, Completed, OutagePolicy, DEFAULT_CLOSE_GRACE_MS } = require('..');

const REQUEST = Object.freeze({ model: 'm', requestBytes: 100, maxOutputTokens: 10 });

// The order of what the tests wait for is made by these, not by sleeps: a
// loaded machine may run any step late. `opened` resolves once open() is called.
function gate() {
  let open;
  const opened = new Promise((resolve) => {
    open = resolve;
  });
  return { opened, open };
}

// Counts arrivals; `all` resolves at the `count`th.
function arrivals(count) {
  const all = gate();
  let arrived = 0;
  return {
    arrive() {
      arrived += 1;
      if (arrived === count) all.open();
    },
    all: all.opened,
  };
}

async function admittingLedger({ lostReserves = 0, refunded = Promise.resolve() } = {}) {
  let lost = lostReserves;
  const fake = await startFakeLedger({
    Reserve: () => {
      if (lost > 0) {
        lost -= 1;
        throw ledgerStatus(grpc.status.UNAVAILABLE, ''); // booked, its answer lost
      }
      return { decision: 'ADMITTED', hold_nanos: '5000', cap_nanos: '5000' };
    },
    Settle: () => ({ charged_nanos: '1234', state: 'SETTLED', balance: null }),
    Refund: async () => {
      await refunded;
      return { balance: null };
    },
  });
  return fake;
}

test('close() while model calls run: each call is ended as its outcome says, then the channel closes', { timeout: 10_000 }, async () => {
  const fake = await admittingLedger();
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'lane', { logger: null, deadlineMs: 2000 });
  try {
    const started = arrivals(3);
    const modelsReturn = gate();
    const model = (report) => async () => {
      started.arrive();
      await modelsReturn.opened;
      return report;
    };
    const calls = [
      client.call(REQUEST, model({ httpStatus: 403 })),
      client.call(REQUEST, model({ httpStatus: 200, usage: { inputTokens: 20, outputTokens: 5 } })),
      client.call(REQUEST, model({ httpStatus: 503 })),
    ];
    await started.all; // every model call runs, and returns only once close() has begun
    const closing = client.close();
    modelsReturn.open();
    await closing;
    const [refused, succeeded, unknown] = await Promise.all(calls);
    for (const completed of [refused, succeeded, unknown]) {
      assert.ok(completed instanceof Completed);
      assert.equal(completed.ledgerError, null);
    }
    assert.equal(refused.chargedNanos, 0n);
    assert.equal(succeeded.chargedNanos, 1234n);
    assert.deepEqual(fake.calls.map((call) => call.method).sort(), ['Refund', 'Reserve', 'Reserve', 'Reserve', 'Settle', 'Settle']);

    // After close(): nothing is sent, the callback never runs, and the error
    // says the client is closed (not that the ledger is unreachable).
    const sent = fake.calls.length;
    await assert.rejects(
      client.call(REQUEST, () => assert.fail('a closed client ran a call')),
      (error) => error instanceof ClientClosed && /client is closed/.test(error.message),
    );
    await assert.rejects(client.listEvents(), ClientClosed);
    assert.throws(() => client.allEvents(), ClientClosed);
    assert.throws(() => client.watchEvents(), ClientClosed);
    assert.equal(fake.calls.length, sent);
  } finally {
    await client.close();
    await fake.stop();
  }
});

test('close() lets the background refund of an unanswered Reserve finish, as the Python client does', { timeout: 10_000 }, async () => {
  // Every attempt's answer is lost: the call's Reserve is sent again, then refunded.
  const refundAnswers = gate();
  const fake = await admittingLedger({ lostReserves: Infinity, refunded: refundAnswers.opened });
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'lane', { logger: null, deadlineMs: 1000 });
  try {
    const denied = await client.call(REQUEST, () => assert.fail('run without an answer'));
    assert.equal(denied.reason, 'LEDGER_UNAVAILABLE');
    // The refund is answered only once close() has begun: close() waits for it.
    const closing = client.close();
    refundAnswers.open();
    await closing;
    const refund = fake.calls.find((call) => call.method === 'Refund');
    assert.ok(refund, 'the refund was sent');
    // Its answer came back before the channel closed: the refund is not cut off.
    assert.equal(client._refunds.running, 0);
    assert.equal(client._refunds._ended.get(denied.reservationId), true);
  } finally {
    await client.close();
    await fake.stop();
  }
});

test('close() refuses new calls at once and lets a Reserve under way get its answer', { timeout: 10_000 }, async () => {
  const reserved = gate();
  const reserveAnswers = gate();
  const fake = await startFakeLedger({
    Reserve: async () => {
      reserved.open();
      await reserveAnswers.opened;
      return { decision: 'ADMITTED', hold_nanos: '5000', cap_nanos: '5000' };
    },
  });
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'lane', { logger: null, deadlineMs: 2000 });
  try {
    assert.equal(DEFAULT_CLOSE_GRACE_MS, 5000);
    const underWay = client.reserve({ ...REQUEST, reservationId: 'r1' });
    await reserved.opened; // at the ledger, answered only once close() has begun
    const closing = client.close();
    await assert.rejects(client.balance(), ClientClosed);
    reserveAnswers.open();
    const answer = await underWay;
    assert.equal(answer.admitted, true, 'not cut off: its hold is known to the lane');
    await closing;
  } finally {
    await client.close();
    await fake.stop();
  }
});

test('close() cancels what is left once its grace is over: ClientClosed, may have applied', { timeout: 10_000 }, async () => {
  // The Reserve is answered only after the test, and its deadline is the
  // longest there is: only close() can end it, once its grace is over.
  const reserved = gate();
  const reserveAnswers = gate();
  const fake = await startFakeLedger({
    Reserve: async () => {
      reserved.open();
      await reserveAnswers.opened;
      return { decision: 'ADMITTED', hold_nanos: '5000', cap_nanos: '5000' };
    },
  });
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'lane', { logger: null, deadlineMs: 60_000 });
  try {
    const underWay = client.reserve({ ...REQUEST, reservationId: 'r1' });
    await reserved.opened;
    await client.close({ graceMs: 100 });
    await assert.rejects(underWay, (error) => error instanceof ClientClosed && error.mayHaveApplied === true);
    const other = new LaneClient('127.0.0.1:1', 'lane', { logger: null });
    assert.throws(() => other.close({ graceMs: -1 }), RangeError);
    await other.close();
  } finally {
    reserveAnswers.open();
    await client.close();
    await fake.stop();
  }
});

test('close() awaited inside a call() callback does not wait for that call, which ends its booking as usual', { timeout: 10_000 }, async () => {
  // It waited its whole grace for the very call it was awaited in, then cut
  // that call's Settle off: the booking was left to expire at its hold.
  const fake = await admittingLedger();
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'lane', { logger: null, deadlineMs: 2000 });
  try {
    const completed = await client.call(REQUEST, async () => {
      await client.close({ graceMs: 1000 });
      await assert.rejects(client.balance(), ClientClosed); // new calls are refused at once
      return { httpStatus: 200, usage: { inputTokens: 20, outputTokens: 5 } };
    });
    assert.ok(completed instanceof Completed);
    assert.equal(completed.ledgerError, null);
    assert.equal(completed.chargedNanos, 1234n);
    assert.deepEqual(fake.calls.map((call) => call.method), ['Reserve', 'Settle']);
    await assert.rejects(
      client.call(REQUEST, () => assert.fail('a closed client ran a call')),
      (error) => error instanceof ClientClosed,
    );
  } finally {
    await client.close();
    await fake.stop();
  }
});

test('every call() cut off by close() has its ending journaled, and a new client on the journal ends them all', { timeout: 20_000 }, async () => {
  // close() closed the journal right after the channel: calls cut off at the
  // end of its grace could not journal their endings, and a cut-off Reserve
  // was not journaled in doubt at all; their holds stayed open until they expired.
  const unstalled = gate();
  const stalled = arrivals(16);
  const stall = async (reservationId, prefix) => {
    if (!reservationId.startsWith(prefix)) return;
    stalled.arrive();
    await unstalled.opened;
  };
  const fake = await startFakeLedger({
    Reserve: async (request) => {
      await stall(request.reservation_id, 'stall-reserve');
      return { decision: 'ADMITTED', hold_nanos: '5000', cap_nanos: '5000' };
    },
    Settle: async (request) => {
      await stall(request.reservation_id, 'stall-settle');
      return { charged_nanos: '1234', state: 'SETTLED', balance: null };
    },
    Refund: () => ({ balance: null }),
  });
  const directory = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-close-'));
  const options = { logger: null, deadlineMs: 10_000, replayIntervalMs: null, outage: OutagePolicy.deny(path.join(directory, 'journal.jsonl')) };
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'lane', options);
  const ids = [];
  for (const group of ['stall-reserve', 'stall-settle', 'body']) for (let n = 0; n < 8; n += 1) ids.push(`${group}-${n}`);
  const inBody = arrivals(8);
  const bodyLeaves = gate();
  const calls = ids.map((reservationId) =>
    client.call({ ...REQUEST, reservationId }, async () => {
      if (reservationId.startsWith('body')) {
        inBody.arrive();
        await bodyLeaves.opened;
      }
      return { httpStatus: 200, usage: { inputTokens: 20, outputTokens: 5 } };
    }),
  );
  const outcomes = Promise.allSettled(calls); // a cut-off Reserve rejects while close() runs
  try {
    await stalled.all; // the stalled Reserves and Settles arrived
    await inBody.all;
    // The callbacks return just after the grace, once the channel is closed.
    const closeChannel = client._stub.close.bind(client._stub);
    client._stub.close = () => {
      closeChannel();
      bodyLeaves.open();
    };
    await client.close({ graceMs: 100 });
    const cutOff = (await outcomes).filter((outcome) => outcome.status === 'rejected');
    assert.ok(cutOff.every((outcome) => outcome.reason instanceof ClientClosed));
    unstalled.open();
    fake.calls.length = 0;
    const replaying = new LaneClient(`127.0.0.1:${fake.port}`, 'lane', options);
    await replaying.replayJournal();
    await replaying.close();
    const ended = new Set(fake.calls.filter((call) => call.method !== 'Reserve').map((call) => call.request.reservation_id));
    assert.deepEqual(ids.filter((id) => !ended.has(id)), [], 'holds left to expire');
  } finally {
    unstalled.open();
    await client.close();
    await fake.stop();
    fs.rmSync(directory, { recursive: true, force: true });
  }
});
