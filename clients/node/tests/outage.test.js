'use strict';
// call() while the ledger cannot be reached: deny and the bounded allowance
// (clients/python/tests/test_client_allowance.py), and calls cut off by a
// server shutting down. No real server here: a closed port, and a scripted
// one (fake-ledger.js) that is shut down under a call. The replay against a
// real server that comes back is in outage-server.test.js.

const { afterEach, before, beforeEach, describe, test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const { startFakeLedger, ledgerStatus } = require('./fake-ledger');
const {
  LaneClient,
  ClientClosed,
  LedgerError,
  OutagePolicy,
  Denied,
  Completed,
  CallNotSent,
  JournalLocked,
  Source,
  Settlement,
  MAX_ALLOWANCE_CALLS,
  isLedgerUnavailable,
  ledgerErrorOf,
  Unavailable,
  StoreUnavailable,
  DeadlineExceeded,
  Cancelled,
  ResourceExhausted,
  TooManyWatchers,
  TooManyCalls,
  InternalError,
  InvalidArgument,
  Unauthenticated,
  GrantError,
} = require('..');

// 1 nano per input token, 2 per output token (per million: 10^6 and 2 * 10^6).
const PRICES = Object.freeze({ 'model-a': { inputNanosPerMillionTokens: 1_000_000n, outputNanosPerMillionTokens: 2_000_000n } });
// A call of 3,500 request bytes (1,000 tokens) and 500 output tokens holds 2,000 nanos.
const REQUEST = Object.freeze({ model: 'model-a', requestBytes: 3_500, maxOutputTokens: 500 });
const HOLD_NANOS = 2_000n;
const DEADLINE_MS = 3000;
const OK = Object.freeze({ httpStatus: 200, usage: { inputTokens: 900, outputTokens: 100 } });

let closedAddress;
let directory;
let journalPath;
const clients = [];

before(async () => {
  // A port nobody listens on: every connection is refused at once.
  const probe = net.createServer();
  await new Promise((resolve) => probe.listen(0, '127.0.0.1', resolve));
  closedAddress = `127.0.0.1:${probe.address().port}`;
  await new Promise((resolve) => probe.close(resolve));
});

beforeEach(() => {
  directory = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-outage-'));
  journalPath = path.join(directory, 'journal.jsonl');
});

afterEach(async () => {
  for (const client of clients.splice(0)) await client.close();
  fs.rmSync(directory, { recursive: true, force: true });
});

function client(outage, options = {}, address = closedAddress) {
  const made = new LaneClient(address, 'recall', { deadlineMs: DEADLINE_MS, outage, replayIntervalMs: null, logger: null, ...options });
  clients.push(made);
  return made;
}

function allowance({ maxNanos = 10n ** 9n, maxCalls = 100 } = {}) {
  return OutagePolicy.allowance({ maxNanos, maxCalls, journalPath, prices: PRICES });
}

/** A call whose callback must not run. */
async function denied(lane, request = REQUEST) {
  let ran = false;
  const result = await lane.call(request, async () => {
    ran = true;
    return OK;
  });
  assert.equal(ran, false, 'the model must not be called');
  assert.ok(result instanceof Denied, `expected a Denied, got ${result?.constructor?.name}`);
  return result;
}

const succeed = (lane, request = REQUEST) => lane.call(request, async () => OK);

describe('a grant function that fails for a while', () => {
  test("its bad value leaves the allowance's calls in the journal, to replay once it gives a grant again", async () => {
    // A grant file caught mid-rotation reads empty: the replay must wait for
    // the next grant, not drop the call made on the allowance as refused for good.
    let grant = 'lg1.good';
    const lane = client(allowance(), { grant: () => grant });
    const made = await succeed(lane);
    assert.equal(made.source, 'allowance');
    for (const bad of ['', 'lg1.good\n', 'two words']) {
      grant = bad;
      let report = null;
      try {
        report = await lane.replayJournal();
      } catch (error) {
        assert.ok(error instanceof TypeError, error.name);
      }
      assert.equal(report?.rejected ?? 0, 0, `not refused for good (${JSON.stringify(bad)})`);
      assert.equal(lane.journal.pending().length, 1, 'still to replay');
    }
    grant = 'lg1.good';
    const report = await lane.replayJournal();
    assert.equal(report.stoppedEarly, true, 'sent, and found the ledger unreachable');
    assert.equal(lane.journal.pending().length, 1);
  });
});

describe('deny (the default)', () => {
  test('an unreachable ledger is a LEDGER_UNAVAILABLE denial, and the callback is not run', async () => {
    const lane = client(undefined);
    assert.equal(lane.outage.mode, 'deny');
    const result = await denied(lane);
    assert.equal(result.admitted, false);
    assert.equal(result.reason, 'LEDGER_UNAVAILABLE');
    assert.equal(result.retryAfter, null);
    assert.match(result.message, /fails closed/);
    assert.ok(result.ledgerError instanceof Unavailable);
    assert.equal(lane.journal, null);
    assert.equal(lane.allowanceUsed(), null);
    assert.deepEqual(await lane.replayJournal(), {
      landed: 0, denied: 0, absent: 0, rejected: 0, failed: 0, remaining: 0, stoppedEarly: false,
    });
  });

  test('a ledger that never answers is a denial too, once the deadline passes', async () => {
    // Accepts connections and says nothing: each RPC runs into its deadline.
    const sockets = new Set();
    const silent = net.createServer((socket) => sockets.add(socket));
    await new Promise((resolve) => silent.listen(0, '127.0.0.1', resolve));
    try {
      const lane = client(undefined, { deadlineMs: 300 }, `127.0.0.1:${silent.address().port}`);
      const result = await denied(lane);
      assert.equal(result.reason, 'LEDGER_UNAVAILABLE');
      assert.ok(result.ledgerError instanceof DeadlineExceeded, result.ledgerError.name);
    } finally {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => silent.close(resolve));
    }
  });

  test('with a journal, an unanswered Reserve is journaled to be refunded later', async () => {
    const lane = client(OutagePolicy.deny(journalPath));
    await denied(lane);
    const [entry] = lane.journal.pending();
    assert.equal(lane.journal.pending().length, 1);
    assert.equal(entry.source, Source.IN_DOUBT);
    assert.equal(entry.ending.settlement, Settlement.REFUND);
    const report = await lane.replayJournal();
    assert.equal(report.stoppedEarly, true, 'still unreachable');
    assert.equal(report.remaining, 1);
  });

  test('a journal holds one process: a second client on it is refused', () => {
    client(OutagePolicy.deny(journalPath));
    assert.throws(() => client(OutagePolicy.deny(journalPath)), JournalLocked);
  });
});

describe('a caller\'s mistake', () => {
  test('a model name past 200 characters is refused before any call, not taken for an outage', async () => {
    const lane = client(OutagePolicy.deny(journalPath));
    const model = 'm'.repeat(201);
    const refused = (field) => (error) => error instanceof InvalidArgument && error.field === field;
    await assert.rejects(lane.reserve({ ...REQUEST, reservationId: 'r-long', model }), refused('model'));
    await assert.rejects(lane.call({ ...REQUEST, model }, async () => assert.fail('not called')), refused('model'));
    await assert.rejects(lane.reserve({ ...REQUEST, reservationId: 'x'.repeat(201) }), refused('reservation_id'));
    assert.equal(fs.existsSync(journalPath) ? fs.readFileSync(journalPath, 'utf8').includes('in_doubt') : false, false, 'nothing journaled in doubt');
  });
});

describe('a bounded allowance', () => {
  test('limits the number of calls', async () => {
    const lane = client(allowance({ maxCalls: 3 }));
    for (let index = 0; index < 3; index += 1) {
      const result = await succeed(lane);
      assert.ok(result instanceof Completed);
      assert.equal(result.source, 'allowance');
      assert.equal(result.journaled, true);
      assert.equal(result.chargedNanos, null, 'the ledger has not booked it yet');
      assert.ok(result.ledgerError instanceof Unavailable);
    }
    const result = await denied(lane);
    assert.equal(result.reason, 'ALLOWANCE_EXHAUSTED');
    assert.match(result.message, /all 3 allowance calls are used/);
    assert.equal(lane.allowanceUsed().calls, 3);
  });

  test('limits the nanos, each call held at the local byte cap', async () => {
    const lane = client(allowance({ maxNanos: 5_000n }));
    let small = null;
    const first = await lane.call(REQUEST, async (firstBooking) => {
      assert.equal(firstBooking.source, 'allowance');
      assert.equal(firstBooking.holdNanos, HOLD_NANOS, 'priced like the ledger: the byte cap');
      assert.equal(firstBooking.capNanos, HOLD_NANOS);
      await lane.call(REQUEST, async (secondBooking) => {
        assert.equal(secondBooking.holdNanos, HOLD_NANOS);
        const third = await denied(lane); // a third hold of 2,000 does not fit the 1,000 left
        assert.equal(third.reason, 'ALLOWANCE_EXHAUSTED');
        assert.match(third.message, /a call capped at 2000 nanos does not fit the 1000 nanos left/);
        small = await lane.call({ ...REQUEST, requestBytes: 0 }, async (booking) => {
          assert.equal(booking.holdNanos, 1_000n); // 1,000 nanos still fits
          return { httpStatus: 200 }; // no usage: charged at the hold
        });
        return { httpStatus: 429 }; // refused: costs nothing
      });
      return { timedOut: true }; // unknown: charged at the hold
    });
    assert.equal(first.ending, 'UNKNOWN');
    assert.equal(small.ending, 'UNKNOWN');
    assert.deepEqual(lane.allowanceUsed(), { calls: 3, nanos: HOLD_NANOS + 0n + 1_000n });
  });

  test('an estimate does not stretch the allowance: calls are admitted at their byte cap', async () => {
    // The estimate lowers what the ledger will hold, not what the call may cost.
    const lane = client(allowance({ maxNanos: 5_000n }));
    const COSTS_ITS_CAP = { httpStatus: 200, usage: { inputTokens: 1_000, outputTokens: 500 } };
    let spent = 0n;
    for (let index = 0; index < 10; index += 1) {
      const result = await lane.call({ ...REQUEST, estimateNanos: 10n }, async (booking) => {
        assert.equal(booking.holdNanos, 10n, "the ledger's hold is still the estimate");
        return COSTS_ITS_CAP;
      });
      if (!result.admitted) {
        assert.equal(result.reason, 'ALLOWANCE_EXHAUSTED');
        assert.doesNotMatch(result.message, /-/);
        break;
      }
      spent += HOLD_NANOS;
    }
    assert.equal(spent, 2n * HOLD_NANOS);
    assert.equal(lane.allowanceUsed().nanos, spent);
  });

  test('an open call counts at its cap, not its estimate', async () => {
    const lane = client(allowance({ maxNanos: 3_000n }));
    await lane.call({ ...REQUEST, estimateNanos: 10n }, async () => {
      assert.equal(lane.allowanceUsed().nanos, HOLD_NANOS);
      const result = await denied(lane); // 2,000 more do not fit the 1,000 left
      assert.equal(result.reason, 'ALLOWANCE_EXHAUSTED');
      return OK;
    });
  });

  test('a known usage is charged at the local real cost; an estimate lowers the hold', async () => {
    const lane = client(allowance());
    await succeed(lane); // 900 input + 100 output tokens: 900 + 200 nanos
    const estimated = await lane.call({ ...REQUEST, estimateNanos: 700n }, async (booking) => {
      assert.equal(booking.holdNanos, 700n);
      return { connectionLost: true };
    });
    assert.equal(estimated.holdNanos, 700n);
    // The ledger will charge the lost call its hold, 700; it may have cost its cap.
    assert.deepEqual(lane.allowanceUsed(), { calls: 2, nanos: 1_100n + HOLD_NANOS });
  });

  test('an unknown ending does not stretch the allowance: it counts at its cap, not its estimate', async () => {
    // Counted at the estimate, ten calls capped at 2,000 nanos went through an allowance of 5,000.
    const lane = client(allowance({ maxNanos: 5_000n }));
    let admitted = 0;
    for (let index = 0; index < 10; index += 1) {
      const result = await lane.call({ ...REQUEST, estimateNanos: 10n }, async () => ({ timedOut: true }));
      if (!result.admitted) {
        assert.equal(result.reason, 'ALLOWANCE_EXHAUSTED');
        break;
      }
      admitted += 1;
    }
    assert.equal(admitted, 2);
    assert.equal(lane.allowanceUsed().nanos, 2n * HOLD_NANOS);
    // The journal still says what the ledger will charge: the hold.
    const charges = lane.journal.pending().filter((entry) => entry.source === 'allowance').map((entry) => entry.localChargeNanos);
    assert.deepEqual(charges, [10n, 10n]);
  });

  test('a thrown error is journaled as its ending and rethrown', async () => {
    const lane = client(allowance());
    const never = new CallNotSent('circuit open');
    await assert.rejects(lane.call(REQUEST, async () => {
      throw never;
    }), (error) => error === never && error.ledgerError instanceof Unavailable);
    const [entry] = lane.journal.pending();
    assert.equal(entry.ending.settlement, Settlement.REFUND);
    assert.equal(entry.ending.reason, 'circuit open');
    assert.deepEqual(lane.allowanceUsed(), { calls: 1, nanos: 0n });
  });

  test('a model without a local price fails closed', async () => {
    const lane = client(allowance());
    const result = await denied(lane, { ...REQUEST, model: 'model-unpriced' });
    assert.equal(result.reason, 'LEDGER_UNAVAILABLE');
    assert.match(result.message, /no price for this model/);
  });

  test('survives a restart of the lane', async () => {
    const first = client(allowance({ maxCalls: 2 }));
    await succeed(first);
    await succeed(first);
    await first.close();
    const second = client(allowance({ maxCalls: 2 }));
    assert.deepEqual(second.allowanceUsed(), { calls: 2, nanos: 2n * 1_100n });
    const result = await denied(second);
    assert.equal(result.reason, 'ALLOWANCE_EXHAUSTED');
  });

  test('a lost journal line is logged at every start, never skipped silently', async () => {
    const first = client(allowance());
    await succeed(first);
    await succeed(first);
    await first.close();
    // A damaged line in the middle (a disk error, a hand edit): the first call's
    // Reserve, so that call is neither replayed nor counted against the allowance.
    const lines = fs.readFileSync(journalPath).toString('ascii').split('\n');
    lines[0] = `${lines[0].slice(0, 40)}#${lines[0].slice(41)}`;
    fs.writeFileSync(journalPath, `${lines.join('\n')}{"v": 1, "kind"`); // and a torn tail
    const warnings = [];
    const logger = { warn: (message) => warnings.push(message), error: (message) => warnings.push(message) };
    const second = client(allowance(), { logger });
    assert.equal(second.allowanceUsed().calls, 1);
    assert.equal(second.journal.skippedLines, 3);
    assert.equal(warnings.length, 1, warnings.join('\n'));
    assert.ok(warnings[0].includes(journalPath));
    assert.match(warnings[0], /2 unreadable lines/);
    assert.match(warnings[0], /torn last line/);
  });

  test('journals the call before the model call, and its ending after', async () => {
    const lane = client(allowance());
    let reservationId;
    await lane.call(REQUEST, async (booking) => {
      reservationId = booking.reservationId;
      const text = fs.readFileSync(journalPath, 'utf8');
      assert.ok(text.includes(`"reservation_id":"${reservationId}"`) && text.includes('"kind":"reserve"'));
      assert.ok(!text.includes('"kind":"end"'));
      return { httpStatus: 200, usage: { inputTokens: 5, outputTokens: 5 } };
    });
    const lines = fs.readFileSync(journalPath, 'utf8').trimEnd().split('\n').map((line) => JSON.parse(line));
    assert.deepEqual(lines.map((record) => record.kind), ['reserve', 'end']);
    assert.equal(lines[1].local_charge_nanos, 15);
  });

  test('a full journal takes no more allowance calls', async () => {
    const lane = client(allowance(), { maxJournalBytes: 400, rotateJournalBytes: 400 });
    assert.equal((await succeed(lane)).source, 'allowance');
    const result = await denied(lane);
    assert.equal(result.reason, 'ALLOWANCE_EXHAUSTED');
    assert.match(result.message, /the journal cannot take another call/);
  });

  test('is never unbounded', () => {
    const base = { journalPath: 'j', prices: PRICES };
    for (const limits of [
      { maxNanos: 0n, maxCalls: 1 },
      { maxNanos: 1n, maxCalls: 0 },
      { maxNanos: 1n, maxCalls: MAX_ALLOWANCE_CALLS + 1 },
      { maxNanos: 2n ** 62n + 1n, maxCalls: 1 },
    ]) {
      assert.throws(() => OutagePolicy.allowance({ ...base, ...limits }), RangeError, JSON.stringify(Object.keys(limits)));
    }
    assert.throws(() => OutagePolicy.allowance({ maxNanos: 1n, maxCalls: 1, journalPath: 'j', prices: {} }), RangeError);
    assert.throws(() => OutagePolicy.allowance({ maxNanos: 1n, maxCalls: 1, prices: PRICES }), TypeError, 'a journal is required');
    assert.throws(() => OutagePolicy.allowance({ ...base, maxNanos: 1.5, maxCalls: 1 }), TypeError, 'never a float');
    const negative = { 'model-a': { inputNanosPerMillionTokens: -1n, outputNanosPerMillionTokens: 1n } };
    assert.throws(() => OutagePolicy.allowance({ maxNanos: 1n, maxCalls: 1, journalPath: 'j', prices: negative }), RangeError);
    for (const bytesPerTokenMilli of [99n, 64_001n]) {
      assert.throws(() => OutagePolicy.allowance({ ...base, maxNanos: 1n, maxCalls: 1, bytesPerTokenMilli }), RangeError);
    }
    assert.throws(() => OutagePolicy.allowance({ ...base, maxNanos: 1n, maxCalls: 1, overheadTokens: 10_000_001n }), RangeError);
    assert.throws(() => new LaneClient(closedAddress, 'recall', { outage: { mode: 'allowance' } }), TypeError);
    // The deadline and the ending's attempts bound what the ledger may cost the
    // call in time (the Python client's (0, 60] s and [1, 10]): a string, an
    // unbounded or a non-integer value is refused, never a call without a deadline.
    for (const deadlineMs of ['100', Infinity, NaN, 0, 60_001]) {
      assert.throws(() => new LaneClient(closedAddress, 'recall', { deadlineMs }), /deadlineMs must be/, String(deadlineMs));
    }
    for (const endAttempts of [0, 1.5, 11, 1e9, '3']) {
      assert.throws(() => new LaneClient(closedAddress, 'recall', { endAttempts }), /endAttempts must be/, String(endAttempts));
    }
    const policy = OutagePolicy.allowance({ ...base, maxNanos: 1n, maxCalls: 1 });
    assert.ok(Object.isFrozen(policy));
    assert.equal(policy.prices.get('model-a').inputNanosPerMillionTokens, 1_000_000n);
  });

  test("refuses a Map's key that is no text, as a Reserve refuses such a model", () => {
    // Null is a shared case (clients/cases/arguments.json); JSON has no undefined
    // or number key. Taken as text, undefined would price a model named "undefined".
    const price = PRICES['model-a'];
    for (const model of [undefined, 7, Symbol('m')]) {
      const prices = new Map([[model, price]]);
      assert.throws(
        () => OutagePolicy.allowance({ maxNanos: 1n, maxCalls: 1, journalPath: 'j', prices }),
        (error) => error instanceof InvalidArgument && error.field === 'model' && error.message === 'model: must be a string',
        String(model),
      );
    }
  });
});

describe('a server that shuts down under a call', () => {
  const ADMITTED = { decision: 'ADMITTED', hold_nanos: '5000', cap_nanos: '5000' };

  /** A scripted server whose `method` hangs until the server is shut down under it. */
  async function hangingOn(method) {
    let arrived;
    const arrival = new Promise((resolve) => {
      arrived = resolve;
    });
    const script = {
      Reserve: () => ADMITTED,
      [method]: () => {
        arrived();
        return new Promise(() => {});
      },
    };
    const fake = await startFakeLedger(script);
    return { fake, arrival };
  }

  test('a Reserve cut off is an outage (a denial), not an error', async () => {
    const { fake, arrival } = await hangingOn('Reserve');
    const lane = client(undefined, {}, `127.0.0.1:${fake.port}`);
    const pending = denied(lane);
    await arrival;
    await fake.stop(); // grpc-js resets the stream: CANCELLED, sent again to a server gone: UNAVAILABLE
    const result = await pending;
    assert.equal(result.reason, 'LEDGER_UNAVAILABLE');
    assert.ok(isLedgerUnavailable(result.ledgerError), result.ledgerError.name);
  });

  test("a Settle the lane's grant function could not send is journaled, not left to expire at its hold", async () => {
    const fake = await startFakeLedger({ Reserve: () => ADMITTED, Settle: () => ({ charged_nanos: '900' }) });
    try {
      let grantOf = () => 'lg1.good';
      const lane = client(OutagePolicy.deny(journalPath), { grant: () => grantOf() }, `127.0.0.1:${fake.port}`);
      for (const failure of [() => '', () => { throw new Error('vault down'); }]) {
        const result = await lane.call(REQUEST, async () => {
          grantOf = failure;
          return OK;
        });
        grantOf = () => 'lg1.good';
        assert.ok(result instanceof Completed);
        assert.equal(result.journaled, true, `journaled (${result.ledgerError?.message})`);
        const entry = lane.journal.pending().find((pending) => pending.reservationId === result.reservationId);
        assert.equal(entry.ending.settlement, Settlement.SETTLE_SUCCEEDED);
      }
      assert.equal(fake.calls.filter((call) => call.method === 'Settle').length, 0, 'never sent');
      const report = await lane.replayJournal();
      assert.equal(report.landed, 2, 'replayed once the grant is back');
    } finally {
      await fake.stop();
    }
  });

  test("a replay whose grant function throws, a TypeError too, keeps the journal's entries for its next attempt", async () => {
    // Its raw TypeError read as "the client can never send this entry", and the
    // replay dropped a Settle the ledger never saw.
    const fake = await startFakeLedger({ Reserve: () => ADMITTED, Settle: () => ({ charged_nanos: '900' }) });
    try {
      let grantOf = () => 'lg1.good';
      const lane = client(OutagePolicy.deny(journalPath), { grant: () => grantOf() }, `127.0.0.1:${fake.port}`);
      const result = await lane.call(REQUEST, async () => {
        grantOf = () => '';
        return OK;
      });
      assert.equal(result.journaled, true);
      grantOf = () => {
        throw new TypeError('the secret store answered nothing');
      };
      await assert.rejects(lane.replayJournal(), (error) => error instanceof GrantError && error.cause instanceof TypeError);
      assert.equal(lane.journal.pending().length, 1, 'kept for the next attempt');
      grantOf = () => 'lg1.good';
      assert.equal((await lane.replayJournal()).landed, 1);
    } finally {
      await fake.stop();
    }
  });

  test('a Settle cut off is journaled for the replay', async () => {
    const { fake, arrival } = await hangingOn('Settle');
    const lane = client(OutagePolicy.deny(journalPath), {}, `127.0.0.1:${fake.port}`);
    const pending = lane.call(REQUEST, async (booking) => {
      assert.equal(booking.source, 'ledger');
      return OK;
    });
    await arrival;
    await fake.stop();
    const result = await pending;
    assert.ok(result instanceof Completed);
    assert.equal(result.chargedNanos, null);
    assert.ok(isLedgerUnavailable(result.ledgerError), result.ledgerError.name);
    assert.equal(result.journaled, true);
    const [entry] = lane.journal.pending();
    assert.equal(entry.reservationId, result.reservationId);
    assert.equal(entry.source, Source.LEDGER);
    assert.equal(entry.ending.settlement, Settlement.SETTLE_SUCCEEDED);
    assert.equal(entry.localHoldNanos, 5000n);
  });

  // What grpc-js reports when the connection closes under a call, e.g. the
  // server's process exited while this event loop was blocked.
  const RESET = 'Received RST_STREAM with code 2 triggered by internal client error: Session closed with error code 2';

  // A call whose every Settle fails with `failure()`, on a client of 2 end attempts.
  async function callWithSettleFailing(failure) {
    const fake = await startFakeLedger({
      Reserve: () => ADMITTED,
      Settle: () => {
        throw failure();
      },
    });
    try {
      const lane = client(OutagePolicy.deny(journalPath), { endAttempts: 2 }, `127.0.0.1:${fake.port}`);
      const result = await lane.call(REQUEST, async () => OK);
      const settles = fake.calls.filter((call) => call.method === 'Settle').length;
      return { result, settles, pending: lane.journal.pending() };
    } finally {
      await fake.stop();
    }
  }

  const RETRIED_ENDINGS = [
    ['a Settle reset under it (a bare INTERNAL)', () => ledgerStatus(grpc.status.INTERNAL, null, RESET), Unavailable],
    [
      'a Settle the server stayed too busy for (TOO_MANY_CALLS)',
      () => ledgerStatus(grpc.status.RESOURCE_EXHAUSTED, 'TOO_MANY_CALLS', 'busy'),
      TooManyCalls,
    ],
  ];
  for (const [why, failure, errorClass] of RETRIED_ENDINGS) {
    test(`${why} is sent again, then journaled`, async () => {
      const { result, settles, pending } = await callWithSettleFailing(failure);
      assert.ok(result.ledgerError instanceof errorClass, result.ledgerError.name);
      assert.equal(result.ledgerError.retryable, true);
      assert.equal(settles, 2, 'sent again');
      assert.equal(result.journaled, true, 'journaled for the replay, not left to expire');
      const [entry] = pending;
      assert.equal(entry.reservationId, result.reservationId);
      assert.equal(entry.ending.settlement, Settlement.SETTLE_SUCCEEDED);
    });
  }

  test("the ledger's own INTERNAL is not an outage: not sent again, not journaled", async () => {
    const { result, settles } = await callWithSettleFailing(() =>
      ledgerStatus(grpc.status.INTERNAL, 'INTERNAL', 'internal error (id 0123abcd)'),
    );
    assert.ok(result.ledgerError instanceof InternalError, result.ledgerError.name);
    assert.equal(settles, 1);
    assert.equal(result.journaled, false);
  });

  test('the error table: which errors are an outage', () => {
    const error = (code, reason = '') => {
      const metadata = new grpc.Metadata();
      if (reason) metadata.set('ledger-reason', reason);
      return ledgerErrorOf({ code, details: 'x', metadata });
    };
    const outage = [
      [error(grpc.status.UNAVAILABLE), Unavailable],
      [error(grpc.status.UNAVAILABLE, 'STORE_UNAVAILABLE'), StoreUnavailable],
      [error(grpc.status.UNAVAILABLE, 'RECOVERY_REQUIRED'), Unavailable],
      [error(grpc.status.DEADLINE_EXCEEDED), DeadlineExceeded],
      [error(grpc.status.CANCELLED), Cancelled],
      [error(grpc.status.RESOURCE_EXHAUSTED), ResourceExhausted],
      // A bare INTERNAL is the transport's (a stream reset): the ledger's own carries its reason.
      [error(grpc.status.INTERNAL), Unavailable],
    ];
    for (const [made, errorClass] of outage) {
      assert.ok(made instanceof errorClass, made.name);
      assert.equal(isLedgerUnavailable(made), true, made.name);
      assert.equal(made.retryable, true, made.name);
    }
    for (const made of [
      error(grpc.status.RESOURCE_EXHAUSTED, 'TOO_MANY_WATCHERS'),
      error(grpc.status.INTERNAL, 'INTERNAL'),
      error(grpc.status.INVALID_ARGUMENT),
      error(grpc.status.UNAUTHENTICATED),
    ]) {
      assert.equal(isLedgerUnavailable(made), false, made.name);
    }
    assert.ok(error(grpc.status.RESOURCE_EXHAUSTED, 'TOO_MANY_WATCHERS') instanceof TooManyWatchers);
    assert.ok(error(grpc.status.INTERNAL, 'INTERNAL') instanceof InternalError);
    assert.ok(error(grpc.status.INVALID_ARGUMENT) instanceof InvalidArgument);
    assert.ok(error(grpc.status.UNAUTHENTICATED) instanceof Unauthenticated);
    assert.equal(isLedgerUnavailable(new Error('not a ledger error')), false);
  });

  test('a refusal is not an outage: it rejects as before', async () => {
    const fake = await startFakeLedger({
      Reserve: () => {
        throw ledgerStatus(grpc.status.NOT_FOUND, 'LANE_NOT_FOUND');
      },
    });
    try {
      const lane = client(allowance(), {}, `127.0.0.1:${fake.port}`);
      let ran = false;
      await assert.rejects(lane.call(REQUEST, async () => {
        ran = true;
      }), (thrown) => thrown.reason === 'LANE_NOT_FOUND');
      assert.equal(ran, false);
      assert.deepEqual(lane.journal.pending(), [], 'a refusal books nothing: nothing to refund');
    } finally {
      await fake.stop();
    }
  });

  test('a closed client is the lane\'s mistake, not an outage: ClientClosed, the allowance untouched', async () => {
    // It was a LEDGER_UNAVAILABLE Denied ("the ledger is unreachable"), and
    // with an allowance the call ran on it.
    const lane = client(allowance());
    await lane.close();
    await assert.rejects(
      lane.call(REQUEST, () => assert.fail('a closed client ran a call')),
      (error) => error instanceof ClientClosed && /closed/.test(error.message) && !(error instanceof LedgerError),
    );
    for (const use of [() => lane.reserve({ ...REQUEST, reservationId: 'r1' }), () => lane.balance(), () => lane.settle({ reservationId: 'r1', outcome: 'UNKNOWN' })]) {
      await assert.rejects(use(), ClientClosed);
    }
    assert.deepEqual(lane.allowanceUsed(), { nanos: 0n, calls: 0 });
  });
});

describe('README', () => {
  test('the outage example runs as written', async () => {
    const readme = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
    const block = [...readme.matchAll(/```js\n([\s\S]*?)```/g)].map((match) => match[1]).find((code) => code.includes('OutagePolicy.allowance'));
    assert.ok(block, 'the README has the outage example');
    const code = block.replaceAll('/var/lib/recall/ledger-journal.jsonl', journalPath);
    const load = new Function('require', 'process', `${code}\nreturn { closed, bounded, ledger };`);
    const environment = { env: { LEDGER_ADDRESS: closedAddress, LEDGER_GRANT: 'grant' } };
    const example = load((name) => require(name === '@lane-ledger/client' ? '..' : name), environment);
    try {
      assert.equal(example.closed.mode, 'deny');
      assert.equal(example.bounded.maxNanos, 50_000_000n);
      assert.equal(example.bounded.prices.get('model-a').cacheWriteNanosPerMillionTokens, 187_500_000n);
      // The byte cap is priced by the lane's bytes per token and overhead too: the example copies them.
      assert.match(code, /bytesPerTokenMilli: /);
      assert.match(code, /overheadTokens: /);
      const result = await example.ledger.call({ model: 'model-a', requestBytes: 3500, maxOutputTokens: 100 }, async () => OK);
      assert.equal(result.source, 'allowance');
      // 1,000 request tokens at the dearest input rate (cache writes), 100 output tokens.
      assert.equal(result.holdNanos, 187_500n + 60_000n);
    } finally {
      await example.ledger.close();
    }
  });
});
