'use strict';
// A lane pointed at two replicas while one is frozen (SIGSTOP: its kernel still
// accepts TCP, so its connection looks healthy and round robin keeps picking
// it). The client's keepalive pings find it within the documented bound (a
// ping every 5 s, unanswered for 5 s: at most 10 s), and from then on every
// call goes to the other replica. Measured before: with no client pings, 79 of
// 194 calls over 28 s failed by their deadline, for as long as it stayed
// frozen. The Python client's case: clients/python/tests/test_client_frozen_replica.py.

const { test } = require('node:test');
const assert = require('node:assert/strict');
const { startLedger } = require('./ledger-server');
const { LaneClient, LedgerError } = require('..');

// Well past the detection bound (10 s), so a busy machine does not fail the
// test; the loop ends as soon as the frozen replica is out of the rotation.
const DETECTION_WAIT_MS = 30_000;
const CALLS_AFTER_DETECTION = 20;
const PRICES = { m: { input_nanos_per_million_tokens: '1000', output_nanos_per_million_tokens: '1000' } };
let ids = 0;
const request = () => ({ model: 'm', requestBytes: 100, maxOutputTokens: 10, reservationId: `frozen-${(ids += 1)}` });

async function reserveOk(client) {
  try {
    return (await client.reserve(request())).admitted;
  } catch (error) {
    if (error instanceof LedgerError) return false;
    throw error;
  }
}

test('calls leave a frozen replica once the keepalive finds it', { timeout: 120_000 }, async () => {
  const first = await startLedger();
  const replicas = [first];
  let client;
  try {
    await first.admin.putLane({ lane: { lane: 'frozen', limit_nanos: '1000000000000000', prices: PRICES } });
    await first.halt();
    replicas.push(await startLedger({ copyFrom: first.dataDir }));
    await first.restart();
    const address = `ipv4:${replicas.map((replica) => replica.address).join(',')}`;
    client = new LaneClient(address, 'frozen', { grant: first.adminGrant, deadlineMs: 2000, logger: null });
    for (let index = 0; index < 10; index += 1) assert.equal(await reserveOk(client), true);
    // The replica about to freeze was in the rotation (its own database).
    assert.ok((await replicas[1].events('frozen')).length > 0);
    replicas[1].freeze();
    // Calls until five in a row succeed: round robin over a frozen replica
    // never gives two in a row.
    let inARow = 0;
    const waitedUntil = Date.now() + DETECTION_WAIT_MS;
    while (inARow < 5 && Date.now() < waitedUntil) inARow = (await reserveOk(client)) ? inARow + 1 : 0;
    const outcomes = [];
    for (let index = 0; index < CALLS_AFTER_DETECTION; index += 1) outcomes.push(await reserveOk(client));
    assert.equal(outcomes.filter(Boolean).length, CALLS_AFTER_DETECTION, JSON.stringify(outcomes));
  } finally {
    if (client) await client.close();
    for (const replica of replicas) await replica.stop();
  }
});
