'use strict';
// A client keeps at most `maxCallsInFlight` calls at the ledger: the server's
// calls at once are shared by every lane first come first served, and a lane
// looping on its calls crowded the others out. The Python client's cases are
// in clients/python/tests/test_client_in_flight.py.

const { test } = require('node:test');
const assert = require('node:assert/strict');
const grpc = require('@grpc/grpc-js');
const { startFakeLedger } = require('./fake-ledger');
const { LaneClient, ResourceExhausted } = require('..');
const { DEFAULT_MAX_CALLS_IN_FLIGHT } = require('../lib/client');

const REQUEST = Object.freeze({ model: 'm', requestBytes: 10, maxOutputTokens: 10 });
const ADMITTED = Object.freeze({ decision: 'ADMITTED', hold_nanos: '1', cap_nanos: '1' });
const pause = (milliseconds) => new Promise((resolve) => setTimeout(resolve, milliseconds));

test('a call past the limit waits its deadline, then is overloaded without being sent', async () => {
  let release;
  const released = new Promise((resolve) => {
    release = resolve;
  });
  const fake = await startFakeLedger({
    Reserve: async () => {
      await released;
      return ADMITTED;
    },
  });
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'recall', { deadlineMs: 5000, maxCallsInFlight: 2, logger: null });
  try {
    await client.waitForReady();
    const first = [client.reserve({ ...REQUEST, reservationId: 'first-1' }), client.reserve({ ...REQUEST, reservationId: 'first-2' })];
    for (let waited = 0; fake.calls.length < 2 && waited < 5000; waited += 10) await pause(10);
    assert.equal(fake.calls.length, 2);
    const started = Date.now();
    // A deadline of its own (the private path the replay uses): 200 ms.
    await assert.rejects(client._reserve({ ...REQUEST, reservationId: 'past-the-limit' }, null, 200), (error) => {
      assert.ok(error instanceof ResourceExhausted && error.constructor === ResourceExhausted, error.name);
      assert.equal(error.code, grpc.status.RESOURCE_EXHAUSTED);
      assert.equal(error.retryable, true);
      assert.match(error.message, /maxCallsInFlight/);
      return true;
    });
    assert.ok(Date.now() - started >= 150, 'it waited for a slot');
    assert.equal(fake.calls.length, 2, 'the call past the limit never reached the ledger');
    // A waiter gets the first slot given back, in order.
    const waiting = client.reserve({ ...REQUEST, reservationId: 'waiting' });
    release();
    for (const answer of await Promise.all([...first, waiting])) assert.equal(answer.admitted, true);
    assert.equal(fake.calls.length, 3);
  } finally {
    await client.close();
    await fake.stop();
  }
});

test('the limit is checked', () => {
  assert.equal(DEFAULT_MAX_CALLS_IN_FLIGHT, 64);
  for (const maxCallsInFlight of [0, 1.5, 10_001, '8']) {
    assert.throws(() => new LaneClient('127.0.0.1:1', 'recall', { maxCallsInFlight }), /maxCallsInFlight must be/, String(maxCallsInFlight));
  }
});
