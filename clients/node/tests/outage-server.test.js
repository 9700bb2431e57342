'use strict';
// The outage mode against a real ledger server (../../.venv/bin/ledger, or
// LEDGER_BIN) that is stopped in the middle of a lane's run and started again
// on the same port and data directory: calls admitted from the allowance, then
// denied; the journal replayed under the same ids; a second replay booking
// nothing. Every figure below is what the server booked.

const { after, before, describe, test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { randomBytes } = require('node:crypto');
const { startLedger } = require('./ledger-server');
const { LaneClient, OutagePolicy, Completed, Denied, Unavailable } = require('..');

// 1000 nanos per input token, 4000 per output token.
const PRICES = { m: { input_nanos_per_million_tokens: '1000000000', output_nanos_per_million_tokens: '4000000000' } };
// The same prices, copied for the allowance.
const LOCAL_PRICES = { m: { inputNanosPerMillionTokens: 1_000_000_000n, outputNanosPerMillionTokens: 4_000_000_000n } };
// 3500 bytes at 3.5 bytes per token: 1000 input tokens (1_000_000) + 100 output tokens (400_000).
const REQUEST = Object.freeze({ model: 'm', requestBytes: 3500, maxOutputTokens: 100 });
const CAP = 1_400_000n;
const cost = (input, output) => BigInt(input) * 1000n + BigInt(output) * 4000n;
const DEADLINE_MS = 3000;

let ledger;
let directory;

// Until `condition()` holds, or fails after a generous wait: a loaded machine
// may run far slower than a fast one, where a fixed pause could end too soon.
async function until(condition, what, waitMs = 30_000) {
  const deadline = Date.now() + waitMs;
  while (!condition()) {
    assert.ok(Date.now() < deadline, `no sign of ${what} within ${waitMs} ms`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

before(async () => {
  ledger = await startLedger();
  directory = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-outage-'));
});

after(async () => {
  await ledger?.stop();
  if (directory) fs.rmSync(directory, { recursive: true, force: true });
});

function traced() {
  const traceId = randomBytes(16).toString('hex');
  return { traceId, traceparent: `00-${traceId}-${randomBytes(8).toString('hex')}-01` };
}

function laneClient(lane, outage) {
  return new LaneClient(ledger.address, lane, {
    grant: ledger.adminGrant ?? undefined,
    deadlineMs: DEADLINE_MS,
    outage,
    replayIntervalMs: null, // the test replays on demand
    logger: null,
  });
}

function allowanceClient(lane, journalPath, maxCalls) {
  return laneClient(lane, OutagePolicy.allowance({ maxNanos: 10n * CAP, maxCalls, journalPath, prices: LOCAL_PRICES }));
}

/** Each reservation id's event kinds, in order, and the amounts of its endings. */
async function bookings(lane) {
  const kinds = {};
  const amounts = {};
  const traces = {};
  for (const event of await ledger.events(lane)) {
    if (!event.reservation_id) continue;
    (kinds[event.reservation_id] ??= []).push(event.kind);
    if (event.kind === 'settled' || event.kind === 'refunded') amounts[event.reservation_id] = BigInt(event.amount_nanos);
    (traces[event.reservation_id] ??= new Set()).add(event.trace_id);
  }
  return { kinds, amounts, traces };
}

describe('a ledger that stops mid-run and comes back', () => {
  test('allowance, exhaustion, replay under the same ids, and a second replay that books nothing', async () => {
    const lane = 'outage-run';
    await ledger.admin.putLane({ lane: { lane, limit_nanos: '1000000000', prices: PRICES } });
    const journalPath = path.join(directory, 'run', 'journal.jsonl');
    const client = allowanceClient(lane, journalPath, 3);
    let reopened = null;
    try {
      await client.waitForReady();
      const first = await client.call(REQUEST, async () => ({ httpStatus: 200, usage: { inputTokens: 900, outputTokens: 20 } }));
      assert.equal(first.source, 'ledger');
      assert.equal(first.chargedNanos, cost(900, 20));

      // The ledger stops while the model answers: the Settle cannot be sent.
      const cut = traced();
      const interrupted = await client.call({ ...REQUEST, traceparent: cut.traceparent }, async (booking) => {
        assert.equal(booking.source, 'ledger');
        assert.equal(await ledger.halt(), 0, 'a graceful stop');
        return { httpStatus: 200, usage: { inputTokens: 800, outputTokens: 50 } };
      });
      assert.ok(interrupted instanceof Completed);
      assert.equal(interrupted.chargedNanos, null);
      assert.ok(interrupted.ledgerError instanceof Unavailable, interrupted.ledgerError?.name);
      assert.equal(interrupted.journaled, true, 'its ending waits in the journal');

      // While it is down: three calls on the allowance, journaled before the model call.
      const during = [];
      for (const [httpStatus, usage] of [[200, { inputTokens: 700, outputTokens: 70 }], [429, undefined], [503, undefined]]) {
        const trace = traced();
        const result = await client.call({ ...REQUEST, traceparent: trace.traceparent }, async (booking) => {
          assert.equal(booking.source, 'allowance');
          assert.equal(booking.holdNanos, CAP, 'priced at the byte cap from the local prices');
          const journal = fs.readFileSync(journalPath, 'utf8');
          assert.ok(journal.includes(`"reservation_id":"${booking.reservationId}"`), 'journaled before the call');
          return { httpStatus, usage };
        });
        assert.equal(result.source, 'allowance');
        assert.equal(result.journaled, true);
        assert.equal(result.chargedNanos, null);
        during.push({ result, trace });
      }
      let ran = false;
      const exhausted = await client.call(REQUEST, async () => {
        ran = true;
      });
      assert.equal(ran, false, 'past the allowance the model is not called');
      assert.ok(exhausted instanceof Denied);
      assert.equal(exhausted.reason, 'ALLOWANCE_EXHAUSTED');
      assert.deepEqual(client.allowanceUsed(), { calls: 3, nanos: cost(700, 70) + 0n + CAP });

      // A replay while it is still down lands nothing and frees nothing.
      const down = await client.replayJournal();
      assert.equal(down.landed, 0);
      assert.equal(down.stoppedEarly, true);
      // The four calls, and the denied call's Reserve, in doubt: refunded if it arrived.
      assert.equal(down.remaining, 5);
      assert.equal(client.allowanceUsed().calls, 3);
      const beforeReplay = fs.readFileSync(journalPath);

      // Back on the same port and data directory.
      await ledger.restart();
      await client.waitForReady(); // the channel reconnects within its 2 s backoff
      const report = await client.replayJournal();
      const counts = (r) => ({ landed: r.landed, denied: r.denied, absent: r.absent, rejected: r.rejected, remaining: r.remaining });
      assert.deepEqual(counts(report), { landed: 4, denied: 0, absent: 1, rejected: 0, remaining: 0 });
      assert.deepEqual(client.allowanceUsed(), { calls: 0, nanos: 0n }, 'freed as the ledger acknowledges');

      const expectedKinds = {
        [first.reservationId]: ['reserved', 'settled'],
        [interrupted.reservationId]: ['reserved', 'settled'],
        [during[0].result.reservationId]: ['reserved', 'settled'],
        [during[1].result.reservationId]: ['reserved', 'refunded'],
        [during[2].result.reservationId]: ['reserved', 'settled'],
      };
      const expectedAmounts = {
        [first.reservationId]: cost(900, 20),
        [interrupted.reservationId]: cost(800, 50),
        [during[0].result.reservationId]: cost(700, 70),
        [during[1].result.reservationId]: 0n,
        [during[2].result.reservationId]: CAP,
      };
      const replayed = await bookings(lane);
      assert.deepEqual(replayed.kinds, expectedKinds, 'the denied call left no trace');
      assert.deepEqual(replayed.amounts, expectedAmounts);
      for (const { result, trace } of during) {
        assert.deepEqual([...replayed.traces[result.reservationId]], [trace.traceId], 'a replay keeps its trace');
      }
      const balance = await client.balance();

      // A second replay finds nothing left to send.
      const again = await client.replayJournal();
      assert.deepEqual(counts(again), { landed: 0, denied: 0, absent: 0, rejected: 0, remaining: 0 });

      // As if the lane died before journaling `replayed`: the same entries go
      // again, under the same ids, and the ledger books nothing twice.
      await client.close();
      fs.writeFileSync(journalPath, beforeReplay);
      reopened = allowanceClient(lane, journalPath, 3);
      assert.equal(reopened.allowanceUsed().calls, 3, 'the allowance is read back from the journal');
      const repeated = await reopened.replayJournal();
      assert.deepEqual(counts(repeated), { landed: 4, denied: 0, absent: 1, rejected: 0, remaining: 0 });
      const twice = await bookings(lane);
      assert.deepEqual(twice.kinds, expectedKinds);
      assert.deepEqual(twice.amounts, expectedAmounts);
      assert.deepEqual(await reopened.balance(), { ...balance, asOf: (await reopened.balance()).asOf });

      // And the lane is back on the ledger.
      const later = await reopened.call(REQUEST, async () => ({ httpStatus: 200, usage: { inputTokens: 1, outputTokens: 1 } }));
      assert.equal(later.source, 'ledger');
      assert.equal(later.chargedNanos, cost(1, 1));
    } finally {
      await client.close();
      await reopened?.close();
    }
  });
});

describe('a graceful stop under load', () => {
  test('calls cut off (CANCELLED, refused) are outage answers, and after the replay nothing is left open', async (t) => {
    const lane = 'outage-stop';
    await ledger.admin.putLane({ lane: { lane, limit_nanos: '1000000000000', prices: PRICES } });
    const journalPath = path.join(directory, 'stop', 'journal.jsonl');
    const client = laneClient(lane, OutagePolicy.deny(journalPath));
    try {
      await client.waitForReady();
      const outcomes = { completed: 0, journaled: 0, denied: 0 };
      const causes = {};
      const cause = (error) => {
        causes[error.name] = (causes[error.name] ?? 0) + 1;
      };
      const rejections = [];
      let running = true;
      const worker = async () => {
        while (running) {
          try {
            const result = await client.call(REQUEST, async () => ({ httpStatus: 200, usage: { inputTokens: 10, outputTokens: 1 } }));
            if (result instanceof Denied) {
              assert.equal(result.reason, 'LEDGER_UNAVAILABLE');
              outcomes.denied += 1;
              cause(result.ledgerError);
            } else if (result.journaled) {
              outcomes.journaled += 1;
              cause(result.ledgerError);
            } else {
              assert.equal(result.ledgerError, null);
              outcomes.completed += 1;
            }
          } catch (error) {
            rejections.push(error);
          }
          if (!running) return;
        }
      };
      const workers = Array.from({ length: 20 }, worker);
      await until(() => outcomes.completed > 0, 'a call completed before the stop');
      await ledger.halt(); // SIGTERM: calls in flight are cut off
      await until(() => outcomes.denied > 0, 'a call denied once the ledger stopped');
      running = false;
      await Promise.all(workers);
      assert.deepEqual(rejections.map((error) => `${error.name}: ${error.message}`), [], 'no call rejects');
      t.diagnostic(`outcomes ${JSON.stringify(outcomes)}, the ledger errors behind them ${JSON.stringify(causes)}`);
      assert.ok(outcomes.completed > 0 && outcomes.denied > 0, JSON.stringify(outcomes));

      await ledger.restart();
      await client.waitForReady();
      for (let attempt = 0; attempt < 20 && client.journal.pending().length > 0; attempt += 1) {
        const report = await client.replayJournal();
        assert.equal(report.rejected, 0);
      }
      assert.deepEqual(client.journal.pending(), []);
      const balance = await client.balance();
      assert.equal(balance.openBookings, 0n, 'every booking the stop cut off was ended by the replay');
      assert.equal(balance.heldNanos, 0n);
      const { kinds } = await bookings(lane);
      for (const [id, events] of Object.entries(kinds)) {
        assert.ok(['reserved,settled', 'reserved,refunded'].includes(events.join()), `${id}: ${events}`);
      }
    } finally {
      await client.close();
    }
  });
});

// A lane with a client journaling to a folder of its own; `fn(lane, client)`
// runs once the client is ready, and the client is closed after.
async function withJournaledClient(lane, fn) {
  await ledger.admin.putLane({ lane: { lane, limit_nanos: '1000000000', prices: PRICES } });
  const client = laneClient(lane, OutagePolicy.deny(path.join(directory, lane, 'journal.jsonl')));
  try {
    await client.waitForReady();
    await fn(lane, client);
  } finally {
    await client.close();
  }
}

// The booking was reserved and settled once, at `charged`.
async function assertSettledOnce(lane, reservationId, charged) {
  const { kinds, amounts } = await bookings(lane);
  assert.deepEqual(kinds[reservationId], ['reserved', 'settled']);
  assert.equal(amounts[reservationId], charged);
}

describe('a retry under the id of an unanswered Reserve', () => {
  test('is not refunded behind the call by the journal\'s in-doubt refund', async () => {
    await withJournaledClient('outage-retry', async (lane, client) => {
      const request = { ...REQUEST, reservationId: `retry-${randomBytes(4).toString('hex')}` };
      assert.equal(await ledger.halt(), 0, 'a graceful stop');
      const refused = await client.call(request, async () => assert.fail('the model must not be called'));
      assert.ok(refused instanceof Denied);
      await ledger.restart();
      await client.waitForReady();
      // The README: send a LedgerUnavailable call again with the same reservation id.
      const retried = await client.call(request, async () => {
        await client.replayJournal(); // the replayer wakes while the call runs
        return { httpStatus: 200, usage: { inputTokens: 900, outputTokens: 20 } };
      });
      assert.ok(retried instanceof Completed, retried.reason);
      assert.equal(retried.chargedNanos, cost(900, 20), retried.ledgerError?.message);
      await client.replayJournal();
      await assertSettledOnce(lane, request.reservationId, cost(900, 20));
    });
  });

  test('a replay that listed the in-doubt refund before the retry never refunds the retry', async () => {
    await withJournaledClient('outage-retry-stale', async (lane, client) => {
      const request = { ...REQUEST, reservationId: `stale-${randomBytes(4).toString('hex')}` };
      assert.equal(await ledger.halt(), 0, 'a graceful stop');
      assert.ok((await client.call(request, async () => assert.fail('not called'))) instanceof Denied);
      const stale = client.journal.pending(); // the in-doubt refund, as a slow attempt listed it
      await ledger.restart();
      await client.waitForReady();
      const retried = await client.call(request, async () => {
        assert.equal(await ledger.halt(), 0, 'the ledger goes away again during the call');
        return { httpStatus: 200, usage: { inputTokens: 900, outputTokens: 20 } };
      });
      assert.equal(retried.journaled, true, 'its settle is journaled');
      await ledger.restart();
      await client.waitForReady();
      const pending = client.journal.pending.bind(client.journal);
      let listed = false;
      client.journal.pending = () => (listed ? pending() : ((listed = true), stale));
      await client.replayJournal();
      await assertSettledOnce(lane, request.reservationId, cost(900, 20));
    });
  });
});
