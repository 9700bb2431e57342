'use strict';
// ledgerFetch reads a streamed request body whole before it books the call:
// the caller's signal must bound that read as fetch itself would, or a body
// that never ends holds the call past every timeout the lane set.

const { test } = require('node:test');
const assert = require('node:assert/strict');
const { LaneClient, ledgerFetch } = require('..');

const URL = 'http://127.0.0.1:1/v1/chat/completions';

/** A body that sends the start of a request and never ends. */
function endlessBody() {
  return new ReadableStream({
    start(controller) {
      controller.enqueue(new TextEncoder().encode('{"model": "m", "messages": ['));
    },
  });
}

/** Runs `body` with a ledgerFetch over a lane no ledger answers, and the requests it sent on. */
async function throughUnansweredLane(body) {
  const lane = new LaneClient('127.0.0.1:1', 'lane', { deadlineMs: 50, logger: null });
  const sent = [];
  const inner = async (url, init) => {
    sent.push(init);
    return new Response('{}');
  };
  try {
    await body(ledgerFetch(lane, { fetch: inner }));
  } finally {
    await lane.close();
  }
  assert.equal(sent.length, 0);
}

test('a streamed body that never ends rejects with the signal\'s reason once it aborts, nothing sent or booked', async () => {
  await throughUnansweredLane(async (fetchThrough) => {
    const controller = new AbortController();
    const pending = fetchThrough(URL, { method: 'POST', body: endlessBody(), duplex: 'half', signal: controller.signal });
    const reason = new Error('the caller gave up');
    setImmediate(() => controller.abort(reason));
    await assert.rejects(pending, (error) => error === reason);
    const aborted = AbortSignal.abort();
    await assert.rejects(
      fetchThrough(URL, { method: 'POST', body: endlessBody(), duplex: 'half', signal: aborted }),
      (error) => error === aborted.reason,
    );
  });
});

test('a request whose signal has already aborted rejects with its reason before any Reserve, as fetch does', async () => {
  // It was reserved and, its fetch rejecting at once, settled UNKNOWN at
  // its hold: a charge for a request that never left.
  await throughUnansweredLane(async (fetchThrough) => {
    const aborted = AbortSignal.abort(new Error('the caller gave up'));
    const body = JSON.stringify({ model: 'm', messages: [] });
    await assert.rejects(fetchThrough(URL, { method: 'POST', body, signal: aborted }), (error) => error === aborted.reason);
  });
});
