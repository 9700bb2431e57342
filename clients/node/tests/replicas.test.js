'use strict';
// A lane pointed at several replicas spreads its calls over them, and a call a
// draining replica refused with SHUTTING_DOWN (no work done) is sent once more,
// within its deadline, where another replica answers it. The Python client's
// cases are in clients/python/tests/test_client_replicas.py.

const { test } = require('node:test');
const assert = require('node:assert/strict');
const grpc = require('@grpc/grpc-js');
const { startFakeLedger, ledgerStatus } = require('./fake-ledger');
const { LaneClient, Unavailable } = require('..');

const REQUEST = Object.freeze({ model: 'm', requestBytes: 10, maxOutputTokens: 10 });
let ids = 0;
const request = () => ({ ...REQUEST, reservationId: `r-${(ids += 1)}` });
const ADMITTED = Object.freeze({ decision: 'ADMITTED', hold_nanos: '1', cap_nanos: '1' });

async function twoReplicas() {
  const draining = [false, false];
  const replicas = [];
  for (const index of [0, 1]) {
    replicas.push(
      await startFakeLedger({
        Reserve: async () => {
          if (draining[index]) throw ledgerStatus(grpc.status.UNAVAILABLE, 'SHUTTING_DOWN', 'the server is shutting down');
          return ADMITTED;
        },
      }),
    );
  }
  const address = `ipv4:${replicas.map((replica) => `127.0.0.1:${replica.port}`).join(',')}`;
  const reserves = (index) => replicas[index].calls.filter((call) => call.method === 'Reserve').length;
  return { replicas, draining, address, reserves };
}

test('calls to an address list reach every replica', async () => {
  const { replicas, address, reserves } = await twoReplicas();
  const client = new LaneClient(address, 'recall', { deadlineMs: 5000, logger: null });
  try {
    for (let index = 0; index < 21; index += 1) assert.equal((await client.reserve(request())).admitted, true);
    assert.ok(reserves(0) >= 5 && reserves(1) >= 5, `${reserves(0)}, ${reserves(1)}`);
  } finally {
    await client.close();
    for (const replica of replicas) await replica.stop();
  }
});

test('a reserve refused by a draining replica is answered by another', async () => {
  const { replicas, draining, address, reserves } = await twoReplicas();
  const client = new LaneClient(address, 'recall', { deadlineMs: 5000, logger: null });
  try {
    for (let index = 0; index < 4; index += 1) await client.reserve(request()); // both connected
    draining[0] = true;
    // Round robin picks among the replicas ready so far: the first calls need
    // not have split evenly, so each replica's calls are counted from here.
    const [before0, before1] = [reserves(0), reserves(1)];
    for (let index = 0; index < 20; index += 1) assert.equal((await client.reserve(request())).admitted, true);
    assert.ok(reserves(0) > before0, 'the draining replica was asked, and refused');
    assert.ok(reserves(1) - before1 >= 20, 'every admitted reserve was answered by the other replica');
  } finally {
    await client.close();
    for (const replica of replicas) await replica.stop();
  }
});

test('a second SHUTTING_DOWN is the lane\'s outage', async () => {
  const { replicas, draining, address, reserves } = await twoReplicas();
  draining[0] = draining[1] = true;
  const client = new LaneClient(address, 'recall', { deadlineMs: 5000, logger: null });
  try {
    await assert.rejects(client.reserve(request()), (error) => error instanceof Unavailable && error.reason === 'SHUTTING_DOWN');
    assert.equal(reserves(0) + reserves(1), 2, 'sent twice, not more');
  } finally {
    await client.close();
    for (const replica of replicas) await replica.stop();
  }
});
