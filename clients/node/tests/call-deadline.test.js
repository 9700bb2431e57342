'use strict';
// A call's own deadline (`deadlineMs` among its options), as the Python
// client's `deadline_seconds` on each call: a first 1,000-event page of
// listEvents took 291 ms with the connection's set-up, past the client's
// 250 ms, and the only way round it was a second LaneClient. The refusals of
// a bad one are the shared cases (clients/cases/arguments.json, "deadline").

const { test } = require('node:test');
const assert = require('node:assert/strict');
const { startFakeLedger } = require('./fake-ledger');
const { LaneClient, DeadlineExceeded } = require('..');

const ANSWER_AFTER_MS = 400;
const pause = (milliseconds) => new Promise((resolve) => setTimeout(resolve, milliseconds));
const BALANCE = Object.freeze({ lane: 'slow', limit_nanos: '10', spent_nanos: '0', held_nanos: '0', available_nanos: '10' });
const BOOKING = Object.freeze({ lane: 'slow', reservation_id: 'r-1', model: 'm', state: 'OPEN' });
const ANSWERS = Object.freeze({
  Reserve: { decision: 'ADMITTED', hold_nanos: '1', cap_nanos: '1' },
  Settle: { charged_nanos: '1', state: 'SETTLED', balance: BALANCE },
  Refund: { balance: BALANCE },
  GetBalance: BALANCE,
  GetBooking: BOOKING,
  ListEvents: { events: [], next_page_token: '' },
});

/** Every unary call that takes a deadline of its own, with `extra` among its options. */
function everyCall(client, extra) {
  return {
    reserve: () => client.reserve({ reservationId: 'r-1', model: 'm', requestBytes: 10, maxOutputTokens: 10, ...extra }),
    settle: () => client.settle({ reservationId: 'r-1', outcome: 'UNKNOWN', ...extra }),
    refund: () => client.refund({ reservationId: 'r-1', httpStatus: 429, ...extra }),
    balance: () => client.balance({ ...extra }),
    booking: () => client.booking('r-1', { ...extra }),
    listEvents: () => client.listEvents({ ...extra }),
    allEvents: async () => {
      for await (const _ of client.allEvents({ ...extra })) assert.fail('no events were scripted');
    },
  };
}

async function slowLedger() {
  const script = {};
  for (const [method, answer] of Object.entries(ANSWERS)) {
    script[method] = async () => {
      await pause(ANSWER_AFTER_MS);
      return answer;
    };
  }
  return startFakeLedger(script);
}

test("a call's own deadlineMs outlasts a slow answer the client's default deadline does not", async () => {
  const fake = await slowLedger();
  // The default deadline, 250 ms: shorter than the ledger takes to answer.
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'slow', { logger: null });
  try {
    const given = Object.entries(everyCall(client, { deadlineMs: 1000 }));
    const results = await Promise.allSettled(given.map(([, call]) => call()));
    for (const [index, [name]] of given.entries()) {
      assert.equal(results[index].status, 'fulfilled', `${name}: ${results[index].reason}`);
    }
    const fallen = Object.entries(everyCall(client, {}));
    const failures = await Promise.allSettled(fallen.map(([, call]) => call()));
    for (const [index, [name]] of fallen.entries()) {
      assert.equal(failures[index].status, 'rejected', `${name} took the client's deadlineMs`);
      assert.ok(failures[index].reason instanceof DeadlineExceeded, `${name}: ${failures[index].reason}`);
    }
  } finally {
    await client.close();
    await fake.stop();
  }
});

test('a bad deadlineMs of a call is refused before any call', async () => {
  const fake = await slowLedger();
  const client = new LaneClient(`127.0.0.1:${fake.port}`, 'slow', { logger: null });
  try {
    for (const [name, call] of Object.entries(everyCall(client, { deadlineMs: 0 }))) {
      await assert.rejects(call, (error) => {
        assert.equal(error.field, 'deadlineMs', `${name}: ${error.name}: ${error.message}`);
        return true;
      });
    }
    // allEvents refuses it at once, as a bad pageSize, not at its first page.
    assert.throws(() => client.allEvents({ deadlineMs: 60_001 }), (error) => error.field === 'deadlineMs');
    assert.deepEqual(fake.calls, [], 'nothing reached the ledger');
  } finally {
    await client.close();
    await fake.stop();
  }
});
