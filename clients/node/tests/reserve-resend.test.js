'use strict';
// A call()'s Reserve whose answer was lost (a replica restarted, a connection
// reset) is sent again, the same request, while the call's deadline has time
// left: the ledger answers a repeat with its first answer, and that answer is
// the call's, with nothing refunded. The Python client's cases are in
// clients/python/tests/test_client_allowance.py.

const { describe, test } = require('node:test');
const assert = require('node:assert/strict');
const grpc = require('@grpc/grpc-js');
const { startFakeLedger, ledgerStatus } = require('./fake-ledger');
const { LaneClient, Denied, Completed, ReservationIdReused, OutagePolicy, Unavailable, isLedgerUnavailable } = require('..');
const { DEFAULT_END_ATTEMPTS } = require('../lib/client');

const REQUEST = Object.freeze({ model: 'm', requestBytes: 100, maxOutputTokens: 10, reservationId: 'resent-call-1' });
const USAGE = Object.freeze({ httpStatus: 200, usage: { inputTokens: 90, outputTokens: 5 } });
const RESET = 'Received RST_STREAM with code 2 triggered by internal client error: Session closed with error code 2';
const lost = (code, reason = '', details = 'scripted failure') => () => ledgerStatus(code, reason, details);

/**
 * A ledger with the contract's idempotency: every Reserve is booked once, a
 * repeat gets the first answer (already_reserved); the answers of the first ones are lost with
 * `errors`, one each. `limitNanos` below the hold: the first answer is a denial.
 */
async function ledgerLosing(errors, { limitNanos = 10n ** 9n } = {}) {
  const answers = new Map();
  const left = [...errors];
  const fake = await startFakeLedger({
    Reserve: (request) => {
      const repeat = answers.has(request.reservation_id);
      if (!repeat) {
        const admitted = 5000n <= limitNanos;
        answers.set(
          request.reservation_id,
          admitted
            ? { decision: 'ADMITTED', hold_nanos: '5000', cap_nanos: '5000' }
            : { decision: 'DENIED', denial_reason: 'BUDGET_EXHAUSTED', reason: 'does not fit' },
        );
      }
      if (left.length > 0) throw left.shift()();
      return { ...answers.get(request.reservation_id), already_reserved: repeat };
    },
    Settle: () => ({ charged_nanos: '1234', state: 'SETTLED', balance: null }),
    Refund: () => ({ balance: null }),
  });
  fake.methods = () => fake.calls.map((call) => call.method);
  return fake;
}

async function withClient(fake, options, body) {
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'lane', { deadlineMs: 2000, logger: null, outage: OutagePolicy.deny(), ...options });
  try {
    await client.waitForReady();
    await body(client);
  } finally {
    await client.close();
    await fake.stop();
  }
}

const notCalled = async () => assert.fail('the model must not be called');

describe('a call whose Reserve lost its answer', () => {
  for (const [name, error] of [
    ['UNAVAILABLE', lost(grpc.status.UNAVAILABLE)],
    ['CANCELLED (a server shutting down)', lost(grpc.status.CANCELLED)],
    ['a connection reset (a bare INTERNAL)', lost(grpc.status.INTERNAL, null, RESET)],
  ]) {
    test(`after ${name}: sends it again and is admitted, with one booking and no refund`, async () => {
      const fake = await ledgerLosing([error]);
      await withClient(fake, {}, async (client) => {
        const result = await client.call(REQUEST, async (booking) => {
          assert.equal(booking.source, 'ledger');
          return USAGE;
        });
        assert.ok(result instanceof Completed);
        assert.equal(result.ledgerError, null);
        await client._refunds.idle();
        assert.deepEqual(fake.methods(), ['Reserve', 'Reserve', 'Settle']);
        const [first, second] = fake.calls.filter((call) => call.method === 'Reserve');
        assert.deepEqual(second.request, first.request, 'the same request');
        assert.deepEqual(second.metadata.traceparent.split('-')[1], first.metadata.traceparent.split('-')[1], 'the same trace');
      });
    });
  }

  test('the answer of the resend is the call\'s, a denial too, and nothing is refunded', async () => {
    const fake = await ledgerLosing([lost(grpc.status.UNAVAILABLE)], { limitNanos: 1n });
    await withClient(fake, {}, async (client) => {
      const result = await client.call(REQUEST, notCalled);
      assert.ok(result instanceof Denied);
      assert.equal(result.reason, 'BUDGET_EXHAUSTED');
      await client._refunds.idle();
      assert.deepEqual(fake.methods(), ['Reserve', 'Reserve']);
    });
  });

  test('no answer at any attempt: today\'s path, the outage mode and a refund', async () => {
    const fake = await ledgerLosing(Array(10).fill(lost(grpc.status.UNAVAILABLE)));
    await withClient(fake, {}, async (client) => {
      const result = await client.call(REQUEST, notCalled);
      assert.ok(result instanceof Denied);
      assert.equal(result.reason, 'LEDGER_UNAVAILABLE');
      assert.ok(isLedgerUnavailable(result.ledgerError));
      await client._refunds.idle();
      assert.equal(DEFAULT_END_ATTEMPTS, 3);
      assert.deepEqual(fake.methods(), ['Reserve', 'Reserve', 'Reserve', 'Refund']);
    });
  });

  for (const [name, error, expected] of [
    ['DEADLINE_EXCEEDED: the call\'s deadline is spent', lost(grpc.status.DEADLINE_EXCEEDED), Denied],
    ['the ledger\'s own INTERNAL: final', lost(grpc.status.INTERNAL, 'INTERNAL'), Error],
  ]) {
    test(`after ${name}, it is not sent again and is refunded as before`, async () => {
      const fake = await ledgerLosing([error]);
      await withClient(fake, {}, async (client) => {
        const result = await client.call(REQUEST, notCalled).catch((thrown) => thrown);
        assert.ok(result instanceof expected, result.constructor.name);
        await client._refunds.idle();
        assert.deepEqual(fake.methods(), ['Reserve', 'Refund']);
      });
    });
  }

  test('booked by the first attempt, refused outright by the resends: still refunded', async () => {
    const fake = await ledgerLosing([lost(grpc.status.UNAVAILABLE), lost(grpc.status.RESOURCE_EXHAUSTED), lost(grpc.status.RESOURCE_EXHAUSTED)]);
    await withClient(fake, {}, async (client) => {
      const result = await client.call(REQUEST, notCalled);
      assert.equal(result.reason, 'LEDGER_UNAVAILABLE');
      await client._refunds.idle();
      assert.deepEqual(fake.methods(), ['Reserve', 'Reserve', 'Reserve', 'Refund']);
    });
  });

  test('the resends share the call\'s deadline: each gets only the time left', async () => {
    const fake = await ledgerLosing([]);
    await withClient(fake, { deadlineMs: 250 }, async (client) => {
      const given = [];
      // Each attempt takes 100 ms and loses its answer.
      client._reserve = async (request, trace, deadlineMs) => {
        given.push(deadlineMs);
        await new Promise((resolve) => setTimeout(resolve, 100));
        throw new Unavailable('lost', { code: grpc.status.UNAVAILABLE });
      };
      const result = await client.call(REQUEST, notCalled);
      assert.equal(result.reason, 'LEDGER_UNAVAILABLE');
      await client._refunds.idle();
      // 100 ms, a 20 ms pause, then at most 130 ms left; after that, too little for a 40 ms pause.
      assert.equal(given[0], 250);
      assert.ok(given.length <= 2, `${given.length} attempts`);
      if (given.length === 2) assert.ok(given[1] <= 131, `${given[1]} ms for the resend`);
    });
  });

  test('a resend under an id whose refund has since ended its booking is refused, never admitted', async () => {
    let client = null;
    let reserves = 0;
    const fake = await startFakeLedger({
      Reserve: async (request) => {
        reserves += 1;
        if (reserves === 1) {
          // Meanwhile another call under the same id, its own Reserve unanswered, had it refunded.
          client._refunds.send(() => client._refundUnanswered(request.reservation_id, null), request.reservation_id);
          await client._refunds.idle();
          throw ledgerStatus(grpc.status.UNAVAILABLE, '');
        }
        return { decision: 'ADMITTED', hold_nanos: '5000', cap_nanos: '5000' }; // the first answer
      },
      Refund: () => ({ balance: null }),
    });
    await withClient(fake, {}, async (lane) => {
      client = lane;
      let called = false;
      await assert.rejects(
        lane.call(REQUEST, async () => {
          called = true;
          return USAGE;
        }),
        ReservationIdReused,
      );
      assert.equal(called, false, 'the model call was made under a refunded booking');
      assert.deepEqual(fake.calls.map((call) => call.method), ['Reserve', 'Refund']);
    });
  });
});
