'use strict';
// The rich error model (grpc-status-details-bin: a google.rpc.Status with an
// ErrorInfo) read from a real ledger's refusals, standing in for the
// ledger-* trailers when a proxy drops them.

const { after, before, test } = require('node:test');
const assert = require('node:assert/strict');
const { startLedger } = require('./ledger-server');
const { ledgerErrorOf, richErrorInfo, LaneNotFound, InvalidArgument } = require('../lib/errors');

let ledger;

before(async () => {
  ledger = await startLedger();
});

after(async () => {
  await ledger?.stop();
});

/** The refusal of `call`, and the same with the ledger's own trailers dropped. */
async function refused(call) {
  const error = await call().then(
    () => assert.fail('the call was not refused'),
    (rejected) => rejected,
  );
  const stripped = Object.assign(Object.create(Object.getPrototypeOf(error)), error);
  stripped.metadata = error.metadata.clone();
  for (const key of Object.keys(stripped.metadata.getMap())) {
    if (key.startsWith('ledger-')) stripped.metadata.remove(key);
  }
  return { error, stripped };
}

test('a refusal carries the reason in the rich error model too', async () => {
  const { error, stripped } = await refused(() => ledger.admin.getLane({ lane: 'nowhere' }));
  assert.deepEqual(richErrorInfo(error.metadata), { 'ledger-reason': 'LANE_NOT_FOUND' });
  const fromTrailers = ledgerErrorOf(error);
  const fromRichModel = ledgerErrorOf(stripped);
  assert.ok(fromTrailers instanceof LaneNotFound);
  assert.ok(fromRichModel instanceof LaneNotFound);
  assert.equal(fromRichModel.reason, 'LANE_NOT_FOUND');
});

test('a bad field is named in the ErrorInfo metadata', async () => {
  const { stripped } = await refused(() =>
    ledger.admin.putLane({ lane: { lane: 'x', limit_nanos: '-1', prices: { jev: {} } } }),
  );
  const found = ledgerErrorOf(stripped);
  assert.ok(found instanceof InvalidArgument);
  assert.equal(found.reason, 'INVALID_ARGUMENT');
  assert.equal(found.field, 'lane.limit_nanos');
});

test('bytes that are not a Status are no reason at all', () => {
  const { Metadata } = require('@grpc/grpc-js');
  const metadata = new Metadata();
  metadata.set('grpc-status-details-bin', Buffer.from([0x1a, 0x7f, 0x01]));
  assert.deepEqual(richErrorInfo(metadata), {});
  assert.deepEqual(richErrorInfo(new Metadata()), {});
});
