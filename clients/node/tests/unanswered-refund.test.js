'use strict';
// A call sent again under the id of an unanswered Reserve, without a journal:
// the background refund of that id may have ended the booking the ledger would
// admit the retry to (its first answer), so the paid call could never be
// settled. The Python client's cases are in test_client_allowance.py.

const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { describe, test } = require('node:test');
const assert = require('node:assert/strict');
const grpc = require('@grpc/grpc-js');
const { startFakeLedger, ledgerStatus } = require('./fake-ledger');
const { LaneClient, Denied, Completed, ReservationIdReused, OutagePolicy } = require('..');
const { MAX_ENDED_IDS, UNANSWERED_REFUND_ATTEMPTS } = require('../lib/client');

const REQUEST = Object.freeze({ model: 'm', requestBytes: 100, maxOutputTokens: 10, reservationId: 'retried-call-1' });
const USAGE = Object.freeze({ httpStatus: 200, usage: { inputTokens: 90, outputTokens: 5 } });
const pause = (milliseconds) => new Promise((resolve) => setTimeout(resolve, milliseconds));

/**
 * A ledger with the contract's idempotency: a repeated Reserve gets the first
 * answer (admitted), whatever became of the booking. The first Reserve's
 * answer is lost after it was booked (or, `booked: false`, before), as its
 * deadline passes (so the call does not send it again in its own time). Each
 * Refund waits `refundMs`; the first `refundFailures` fail with `refundError`
 * (after ending the booking when `refundApplied`).
 */
async function ledgerLosingTheFirstAnswer({ booked = true, refundMs = 0, refundFailures = 0, refundError, refundApplied = true } = {}) {
  const states = new Map();
  let answers = 0;
  let failures = refundFailures;
  const fake = await startFakeLedger({
    Reserve: (request) => {
      answers += 1;
      if (answers === 1 && !booked) throw ledgerStatus(grpc.status.DEADLINE_EXCEEDED, '');
      if (!states.has(request.reservation_id)) states.set(request.reservation_id, 'open');
      if (answers === 1) throw ledgerStatus(grpc.status.DEADLINE_EXCEEDED, ''); // the answer is lost
      return { decision: 'ADMITTED', hold_nanos: '5000', cap_nanos: '5000' };
    },
    Refund: async (request) => {
      await pause(refundMs);
      const state = states.get(request.reservation_id);
      if (failures > 0) {
        failures -= 1;
        if (refundApplied && state === 'open') states.set(request.reservation_id, 'refunded');
        throw refundError;
      }
      if (state === undefined) throw ledgerStatus(grpc.status.NOT_FOUND, 'BOOKING_NOT_FOUND');
      if (state === 'open') states.set(request.reservation_id, 'refunded');
      else if (state !== 'refunded') throw ledgerStatus(grpc.status.FAILED_PRECONDITION, 'BOOKING_ALREADY_ENDED');
      return { balance: null };
    },
    Settle: (request) => {
      if (states.get(request.reservation_id) !== 'open') throw ledgerStatus(grpc.status.FAILED_PRECONDITION, 'BOOKING_ALREADY_ENDED');
      states.set(request.reservation_id, 'settled');
      return { charged_nanos: '1234', state: 'SETTLED', balance: null };
    },
  });
  fake.states = states;
  fake.methods = () => fake.calls.map((call) => call.method);
  return fake;
}

async function withClient(fake, options, body) {
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'recall', { deadlineMs: 2000, logger: null, ...options });
  try {
    await client.waitForReady();
    await body(client);
  } finally {
    await client.close();
    await fake.stop();
  }
}

/** The first call: its Reserve goes unanswered, so it is refused and its id refunded in the background. */
async function unanswered(client) {
  const first = await client.call(REQUEST, async () => assert.fail('the model must not be called'));
  assert.ok(first instanceof Denied);
  assert.equal(first.reason, 'LEDGER_UNAVAILABLE');
}

/** After the unanswered Reserve's refund ends, the same call sent again is made and settled. */
async function retryIsMadeAndSettled(client, fake) {
  await unanswered(client);
  await client._refunds.idle();
  const retried = await client.call(REQUEST, async () => USAGE);
  assert.ok(retried instanceof Completed);
  assert.equal(retried.ledgerError, null);
  assert.equal(fake.states.get(REQUEST.reservationId), 'settled');
}

describe('a retry under the id of an unanswered Reserve, without a journal', () => {
  test('after the background refund ended the booking, is refused and never called', async () => {
    const fake = await ledgerLosingTheFirstAnswer();
    await withClient(fake, {}, async (client) => {
      await unanswered(client);
      await client._refunds.idle();
      let called = false;
      await assert.rejects(
        client.call(REQUEST, async () => {
          called = true;
          return USAGE;
        }),
        (error) => {
          assert.ok(error instanceof ReservationIdReused, error.message);
          assert.equal(error.reason, 'RESERVATION_ID_REUSED');
          assert.equal(error.code, grpc.status.ALREADY_EXISTS);
          assert.equal(error.retryable, false);
          assert.match(error.message, /retried-call-1/);
          assert.match(error.message, /new reservation/);
          return true;
        },
      );
      assert.equal(called, false, 'the model call was made under a refunded booking');
      await assert.rejects(client.reserve(REQUEST), ReservationIdReused);
      assert.deepEqual(fake.methods(), ['Reserve', 'Refund']);
      assert.equal(fake.states.get(REQUEST.reservationId), 'refunded');
    });
  });

  test('waits for the refund under way, then is refused', async () => {
    const fake = await ledgerLosingTheFirstAnswer({ refundMs: 200 });
    await withClient(fake, {}, async (client) => {
      await unanswered(client);
      assert.equal(client._refunds.running, 1);
      const retried = client.call(REQUEST, async () => assert.fail('the model must not be called'));
      await assert.rejects(retried, ReservationIdReused);
      assert.deepEqual(fake.methods(), ['Reserve', 'Refund']);
    });
  });

  test('a refund under way past the deadline is an outage denial, and nothing is sent', async () => {
    const fake = await ledgerLosingTheFirstAnswer();
    await withClient(fake, { deadlineMs: 100 }, async (client) => {
      // A refund that outlasts the next call's deadline (its own RPC would end at
      // its deadline, so this one is a stand-in that takes longer).
      const reservationId = 'slow-refund';
      assert.equal(client._refunds.send(() => pause(500), reservationId), true);
      const started = Date.now();
      const retried = await client.call({ ...REQUEST, reservationId }, async () => assert.fail('the model must not be called'));
      assert.ok(Date.now() - started < 450, 'waited no longer than the deadline');
      assert.ok(retried instanceof Denied);
      assert.equal(retried.reason, 'LEDGER_UNAVAILABLE');
      assert.match(retried.message, /slow-refund/);
      await assert.rejects(client.reserve({ ...REQUEST, reservationId }), (error) => error.retryable === true);
      assert.deepEqual(fake.methods(), []);
      await client._refunds.idle();
    });
  });

  test('remembers the latest ended ids only', async () => {
    const fake = await ledgerLosingTheFirstAnswer();
    await withClient(fake, {}, async (client) => {
      assert.equal(MAX_ENDED_IDS, 1000);
      for (let n = 0; n <= MAX_ENDED_IDS; n += 1) {
        assert.equal(client._refunds.send(async () => undefined, `id-${n}`), true);
        await client._refunds.idle(); // at most MAX_BACKGROUND_REFUNDS at a time
      }
      await assert.rejects(client.reserve({ ...REQUEST, reservationId: `id-${MAX_ENDED_IDS}` }), ReservationIdReused);
      await assert.rejects(client.reserve({ ...REQUEST, reservationId: 'id-1' }), ReservationIdReused);
      // The oldest is forgotten: its Reserve is sent (and its lost answer refunded again).
      await client.reserve({ ...REQUEST, reservationId: 'id-0' }).catch(() => undefined);
      assert.deepEqual(fake.methods().slice(0, 1), ['Reserve']);
    });
  });

  test('a refund whose answer was lost is asked again first', async () => {
    const refundError = ledgerStatus(grpc.status.DEADLINE_EXCEEDED, '');
    // Every attempt of the background refund, then the first asking again, lose their answers.
    const fake = await ledgerLosingTheFirstAnswer({ refundFailures: UNANSWERED_REFUND_ATTEMPTS + 1, refundError });
    await withClient(fake, {}, async (client) => {
      await unanswered(client);
      await client._refunds.idle();
      const still = await client.call(REQUEST, async () => assert.fail('the model must not be called'));
      assert.ok(still instanceof Denied);
      assert.equal(still.reason, 'LEDGER_UNAVAILABLE');
      await assert.rejects(client.call(REQUEST, async () => assert.fail('the model must not be called')), ReservationIdReused);
      const refunds = Array(UNANSWERED_REFUND_ATTEMPTS + 2).fill('Refund');
      assert.deepEqual(fake.methods(), ['Reserve', ...refunds]);
    });
  });

  test('after a refund that found nothing, the retry is made and settled', async () => {
    const fake = await ledgerLosingTheFirstAnswer({ booked: false });
    await withClient(fake, {}, async (client) => {
      await retryIsMadeAndSettled(client, fake);
    });
  });

  test('after a refund the ledger definitely refused, the retry owns the open booking', async () => {
    const refundError = ledgerStatus(grpc.status.RESOURCE_EXHAUSTED, '');
    // Refused at every attempt of the background refund.
    const fake = await ledgerLosingTheFirstAnswer({ refundFailures: UNANSWERED_REFUND_ATTEMPTS, refundError, refundApplied: false });
    await withClient(fake, { outage: OutagePolicy.deny() }, async (client) => {
      await retryIsMadeAndSettled(client, fake);
    });
  });
});

describe('a retry under the id of an unanswered Reserve, with a journal', () => {
  test('after the journal\'s in-doubt refund landed, is refused and never called', async () => {
    const directory = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-in-doubt-'));
    const fake = await ledgerLosingTheFirstAnswer();
    await withClient(fake, { outage: OutagePolicy.deny(path.join(directory, 'journal.jsonl')) }, async (client) => {
      await unanswered(client);
      assert.equal((await client.replayJournal()).landed, 1, 'the in-doubt refund lands first');
      let called = false;
      await assert.rejects(
        client.call(REQUEST, async () => {
          called = true;
          return USAGE;
        }),
        (error) => error instanceof ReservationIdReused && error.reason === 'RESERVATION_ID_REUSED',
      );
      assert.equal(called, false, 'the model call was made under a refunded booking');
      assert.deepEqual(fake.methods(), ['Reserve', 'Refund']);
      assert.equal(fake.states.get(REQUEST.reservationId), 'refunded');
    });
    fs.rmSync(directory, { recursive: true, force: true });
  });
});

test('the package exports the refund constants the README names, with its values', () => {
  // The README named them as if exported while only lib/client.js had them.
  const ledger = require('..');
  const readme = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
  assert.match(readme, /up to 4 attempts in all, 250 ms and then 500 and 750 ms apart\s+\(`UNANSWERED_REFUND_ATTEMPTS`, `UNANSWERED_REFUND_PAUSE_MS`, both exported\)/);
  assert.equal(ledger.UNANSWERED_REFUND_ATTEMPTS, 4);
  assert.equal(ledger.UNANSWERED_REFUND_PAUSE_MS, 250);
});
