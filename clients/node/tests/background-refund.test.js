'use strict';
// The background refund of an unanswered Reserve (no journal) under a flood:
// sent once, it failed as the Reserve had (its deadline passed, the ledger
// overloaded), and past 100 at a time the rest were never sent; 5 to 25 holds
// a run of 200 calls at once were left to expire.

const { test } = require('node:test');
const assert = require('node:assert/strict');
const grpc = require('@grpc/grpc-js');
const { startFakeLedger, ledgerStatus } = require('./fake-ledger');
const { LaneClient } = require('..');
const { UNANSWERED_REFUND_ATTEMPTS, UNANSWERED_REFUND_PAUSE_MS, MAX_BACKGROUND_REFUNDS } = require('../lib/client');

const REQUEST = Object.freeze({ model: 'm', requestBytes: 100, maxOutputTokens: 10 });
const pause = (milliseconds) => new Promise((resolve) => setTimeout(resolve, milliseconds));

test('a background refund whose answer was lost is sent again under its id, a bounded number of times', { timeout: 20_000 }, async () => {
  assert.equal(UNANSWERED_REFUND_ATTEMPTS, 4);
  assert.equal(UNANSWERED_REFUND_PAUSE_MS, 250);
  for (const [lost, refunds, ended] of [
    [2, 3, true], // the third attempt gets its answer
    [10, UNANSWERED_REFUND_ATTEMPTS, false], // never answered: it gives up, the hold expires
  ]) {
    let left = lost;
    const fake = await startFakeLedger({
      Reserve: () => {
        throw ledgerStatus(grpc.status.UNAVAILABLE, ''); // booked, its answer lost
      },
      Refund: () => {
        if (left > 0) {
          left -= 1;
          throw ledgerStatus(grpc.status.DEADLINE_EXCEEDED, '');
        }
        return { balance: null };
      },
    });
    const client = new LaneClient(`127.0.0.1:${fake.port}`, 'lane', { logger: null, deadlineMs: 1000 });
    try {
      const denied = await client.call(REQUEST, () => assert.fail('run without an answer'));
      assert.equal(denied.reason, 'LEDGER_UNAVAILABLE');
      await client._refunds.idle();
      const sent = fake.calls.filter((call) => call.method === 'Refund');
      assert.equal(sent.length, refunds);
      assert.ok(sent.every((call) => call.request.reservation_id === denied.reservationId), 'the same id each time');
      assert.equal(client._refunds._ended.get(denied.reservationId), ended);
    } finally {
      await client.close();
      await fake.stop();
    }
  }
});

test('refunds past the 100 sent at a time wait their turn instead of being dropped', { timeout: 20_000 }, async () => {
  const calls = MAX_BACKGROUND_REFUNDS + 30;
  let refunding = 0;
  let most = 0;
  const fake = await startFakeLedger({
    Reserve: () => {
      throw ledgerStatus(grpc.status.UNAVAILABLE, '');
    },
    Refund: async () => {
      refunding += 1;
      most = Math.max(most, refunding);
      await pause(50);
      refunding -= 1;
      return { balance: null };
    },
  });
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'lane', { logger: null, deadlineMs: 10_000, maxCallsInFlight: 10_000 });
  try {
    const denied = await Promise.all(Array.from({ length: calls }, () => client.call(REQUEST, () => assert.fail('run'))));
    await client._refunds.idle();
    const refunded = new Set(fake.calls.filter((call) => call.method === 'Refund').map((call) => call.request.reservation_id));
    assert.deepEqual(denied.map((answer) => answer.reservationId).filter((id) => !refunded.has(id)), []);
    assert.ok(most <= MAX_BACKGROUND_REFUNDS, `${most} refunds at once`);
  } finally {
    await client.close();
    await fake.stop();
  }
});
