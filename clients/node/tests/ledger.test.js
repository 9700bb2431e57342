'use strict';
// Against a real ledger server (../../.venv/bin/ledger, or LEDGER_BIN) with a
// test clock: every figure below is what the server booked.

const { after, before, describe, test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const http = require('node:http');
const path = require('node:path');
const { startLedger } = require('./ledger-server');
const {
  LaneClient,
  Completed,
  Denied,
  markNotSent,
  CallNotSent,
  InvalidArgument,
  UnknownModel,
  TtlExceedsHoldTtl,
  NotFound,
  LaneNotFound,
  BookingNotFound,
  AlreadyExists,
  ReservationIdReused,
  BookingAlreadyEnded,
  BookingWasDenied,
  Unauthenticated,
  Unavailable,
  SettleWithoutUsage,
  OutputExceedsMaxTokens,
  ChargeExceedsCapMultiple,
  usageOf,
} = require('..');
const { status: Status } = require('@grpc/grpc-js');

const T0_SECONDS = 1_790_000_000;
const DAY_SECONDS = 86_400;
// 1000 nanos per input token, 4000 per output token.
const PRICES = { m: { input_nanos_per_million_tokens: '1000000000', output_nanos_per_million_tokens: '4000000000' } };
// 3500 bytes at 3.5 bytes per token: 1000 input tokens (1_000_000) + 100 output tokens (400_000).
const REQUEST = Object.freeze({ model: 'm', requestBytes: 3500, maxOutputTokens: 100 });
const CAP = 1_400_000n;
// The tests' own deadline: generous, so that a loaded CI machine does not turn
// a slow answer into a failure. The 250 ms default is checked in client.test.js.
const DEADLINE_MS = 3000;
const STRETCH = 12;

let ledger;
const clients = [];

before(async () => {
  ledger = await startLedger();
  await ledger.clock.setTime({ seconds: String(T0_SECONDS), nanos: 0 });
});

after(async () => {
  for (const client of clients) client.close();
  await ledger?.stop();
});

/** Creates the lane (limit 1 USD unless `policy` says otherwise) and a client of it. */
async function laneClient(name, policy = {}, options = {}) {
  await ledger.admin.putLane({ lane: { lane: name, limit_nanos: '1000000000', prices: PRICES, ...policy } });
  const client = new LaneClient(ledger.address, name, {
    grant: ledger.adminGrant ?? undefined,
    deadlineMs: DEADLINE_MS,
    ...options,
  });
  clients.push(client);
  await client.waitForReady();
  return client;
}

async function nowMs() {
  const time = await ledger.clock.getTime({});
  return Number(time.seconds) * 1000 + Math.floor(time.nanos / 1e6);
}

async function advanceSeconds(seconds) {
  await ledger.clock.advance({ seconds: String(seconds), nanos: 0 });
}

describe('call()', () => {
  test('an admitted call is settled SUCCEEDED at its real cost', async () => {
    const client = await laneClient('real-cost');
    let seen = null;
    const result = await client.call(REQUEST, async (booking) => {
      seen = booking;
      return { httpStatus: 200, usage: { inputTokens: 900, outputTokens: 20 }, text: 'hello' };
    });
    assert.ok(result instanceof Completed);
    assert.equal(result.ending, 'SUCCEEDED');
    assert.equal(seen.holdNanos, CAP);
    // 32 hex digits, as the Python client's: the same request books the same bytes.
    assert.match(seen.reservationId, /^[0-9a-f]{32}$/);
    assert.equal(result.reservationId, seen.reservationId);
    assert.equal(result.chargedNanos, 900n * 1000n + 20n * 4000n);
    assert.equal(result.value.text, 'hello');

    const billed = await client.call(REQUEST, async () => ({ httpStatus: 200, billedNanos: 123_457n }));
    assert.equal(billed.chargedNanos, 123_457n);

    const balance = await client.balance();
    assert.equal(balance.chargedNanos, 980_000n + 123_457n);
    assert.equal(balance.heldNanos, 0n);
    assert.equal(balance.openBookings, 0n);
    const booking = await client.booking(result.reservationId);
    assert.equal(booking.state, 'SETTLED');
    assert.equal(booking.amountNanos, 980_000n);
  });

  test('refused calls cost zero: 403, 429, and 429 thrown by an SDK', async () => {
    const client = await laneClient('refused');
    for (const httpStatus of [403, 429]) {
      const result = await client.call(REQUEST, async () => ({ httpStatus }));
      assert.equal(result.ending, 'REFUND');
      assert.equal(result.chargedNanos, 0n);
      const booking = await client.booking(result.reservationId);
      assert.equal(booking.state, 'REFUNDED');
      assert.equal(booking.amountNanos, 0n);
    }
    const rateLimited = Object.assign(new Error('Too Many Requests'), { status: 429 });
    let reservationId;
    await assert.rejects(
      client.call(REQUEST, async (booking) => {
        reservationId = booking.reservationId;
        throw rateLimited;
      }),
      (error) => error === rateLimited,
    );
    assert.equal((await client.booking(reservationId)).state, 'REFUNDED');
    const balance = await client.balance();
    assert.equal(balance.spentNanos, 0n);
  });

  test('a call never sent is refunded', async () => {
    const client = await laneClient('not-sent');
    let reservationId;
    const error = markNotSent(new Error('circuit open\nnot calling the provider'));
    await assert.rejects(
      client.call(REQUEST, async (booking) => {
        reservationId = booking.reservationId;
        throw error;
      }),
      (thrown) => thrown === error && thrown.ledgerError === undefined,
    );
    const booking = await client.booking(reservationId);
    assert.equal(booking.state, 'REFUNDED');
    assert.equal(booking.amountNanos, 0n);
  });

  test("a never-sent call's reason is cut at 200 characters, as the Python client's, never inside one", async () => {
    const client = await laneClient('not-sent-long');
    let reservationId;
    // 1 + 300 characters, 601 UTF-16 units: a cut at unit 200 would split a pair.
    const reason = `n${'\u{1F600}'.repeat(300)}`;
    await assert.rejects(
      client.call(REQUEST, async (booking) => {
        reservationId = booking.reservationId;
        throw new CallNotSent(reason);
      }),
      CallNotSent,
    );
    const refunded = (await ledger.events('not-sent-long')).find((event) => event.kind === 'refunded');
    assert.equal(refunded.reservation_id, reservationId);
    assert.equal(refunded.reason, `n${'\u{1F600}'.repeat(199)}`);
  });

  test('a bare refund() sends its reason whole, up to the 1,000 characters the ledger keeps', async () => {
    const client = await laneClient('refund-reason');
    const reason = 'r'.repeat(1000);
    await client.reserve({ ...REQUEST, reservationId: 'whole-reason' });
    await client.refund({ reservationId: 'whole-reason', reason });
    const refunded = (await ledger.events('refund-reason')).find((event) => event.kind === 'refunded');
    assert.equal(refunded.reason, reason);
  });

  test('a call() under an id a call() of this client was admitted under is refused: the model call is not made again', async () => {
    const client = await laneClient('id-used');
    const first = await client.call({ ...REQUEST, reservationId: 'used-once' }, async () => ({
      httpStatus: 200,
      usage: { inputTokens: 900, outputTokens: 20 },
    }));
    assert.equal(first.ending, 'SUCCEEDED');
    let ran = false;
    await assert.rejects(
      client.call({ ...REQUEST, reservationId: 'used-once' }, async () => {
        ran = true;
        return { httpStatus: 200, usage: { inputTokens: 900, outputTokens: 20 } };
      }),
      (error) => error instanceof ReservationIdReused && error.message.includes('used-once') && !error.retryable,
    );
    assert.equal(ran, false);
    assert.equal((await client.balance()).chargedNanos, first.chargedNanos);
  });

  test('a call() under an id another process reserved is refused: the model call runs once under one id', async () => {
    // A lane restarted under an id it chose: the ledger answers its Reserve
    // with the earlier process's first answer, admitted. Made again, the model
    // call could never be booked (ended), or two calls would share one hold (open).
    for (const earlierEnded of [true, false]) {
      const lane = `elsewhere-${earlierEnded ? 'ended' : 'open'}`;
      const earlier = await laneClient(lane);
      const client = await laneClient(lane);
      const request = { ...REQUEST, reservationId: 'chosen-1' };
      const modelCalls = [];
      const callModel = async (booking) => {
        modelCalls.push(booking.reservationId);
        return { httpStatus: 200, usage: { inputTokens: 900, outputTokens: 20 } };
      };
      if (earlierEnded) assert.equal((await earlier.call(request, callModel)).ending, 'SUCCEEDED');
      else assert.equal((await earlier.reserve(request)).admitted, true); // then the process died
      const events = (await ledger.events(lane)).length;
      await assert.rejects(
        client.call(request, callModel),
        (error) => error instanceof ReservationIdReused && error.reason === 'RESERVATION_ID_REUSED' && error.message.includes('chosen-1'),
      );
      assert.deepEqual(modelCalls, earlierEnded ? ['chosen-1'] : [], lane);
      assert.equal((await ledger.events(lane)).length, events, 'nothing sent after the Reserve');
    }
  });

  test('unknown outcomes are charged at the hold, never more', async () => {
    const client = await laneClient('unknown');
    const timeout = Object.assign(new Error('The operation was aborted due to timeout'), { name: 'TimeoutError' });
    let reservationId;
    await assert.rejects(
      client.call(REQUEST, async (booking) => {
        reservationId = booking.reservationId;
        throw timeout;
      }),
      (error) => error === timeout,
    );
    const thrown = await client.booking(reservationId);
    assert.equal(thrown.state, 'SETTLED_UNKNOWN');
    assert.equal(thrown.amountNanos, CAP);

    const serverError = await client.call(REQUEST, async () => ({ httpStatus: 503 }));
    assert.equal(serverError.ending, 'UNKNOWN');
    assert.equal(serverError.chargedNanos, CAP);

    const estimated = await client.call({ ...REQUEST, estimateNanos: 500_000n }, async (booking) => {
      assert.equal(booking.holdNanos, 500_000n);
      return { timedOut: true };
    });
    assert.equal(estimated.chargedNanos, 500_000n);

    const lost = await client.call(REQUEST, async () => ({ connectionLost: true }));
    assert.equal(lost.chargedNanos, CAP);

    const balance = await client.balance();
    assert.equal(balance.chargedNanos, 3n * CAP + 500_000n);
    assert.equal(balance.heldNanos, 0n);
  });

  test('a callback that reports nothing is settled UNKNOWN, with a warning, and call() resolves', async () => {
    const warnings = [];
    const logger = { warn: (message) => warnings.push(message), error: (message) => warnings.push(`error: ${message}`) };
    const client = await laneClient('no-report', {}, { logger });
    for (const nothing of [undefined, null]) {
      warnings.length = 0;
      const result = await client.call(REQUEST, async () => nothing);
      assert.ok(result instanceof Completed, String(nothing));
      assert.equal(result.ending, 'UNKNOWN');
      assert.equal(result.value, nothing);
      assert.equal(result.chargedNanos, CAP, 'charged at the hold, never more');
      assert.equal(result.ledgerError, null);
      assert.equal((await client.booking(result.reservationId)).state, 'SETTLED_UNKNOWN');
      assert.equal(warnings.length, 1, String(nothing));
      assert.match(warnings[0], new RegExp(`${result.reservationId}.*no outcome`));
    }
    // A callback without a return statement at all.
    const bare = await client.call(REQUEST, async () => {});
    assert.equal(bare.ending, 'UNKNOWN');
    // Something malformed is still an error, rethrown once the booking is settled UNKNOWN.
    let reservationId;
    await assert.rejects(
      client.call(REQUEST, async (booking) => {
        reservationId = booking.reservationId;
        return 'ok';
      }),
      TypeError,
    );
    assert.equal((await client.booking(reservationId)).state, 'SETTLED_UNKNOWN');
  });

  test('a usage outside the ledger\'s bounds is malformed: settled UNKNOWN and rethrown, as the Python client\'s Usage', async () => {
    // Python's Usage refuses a count outside [0, 10^12] and a billed amount
    // outside [0, 2^62] inside the block, so model_call settles UNKNOWN. Sent
    // as it is, the ledger would refuse the Settle and leave the booking open
    // until it expires.
    const client = await laneClient('usage-bounds');
    const bad = [
      { inputTokens: 10n ** 12n + 1n, outputTokens: 1 },
      { inputTokens: 10, outputTokens: -1 },
      { inputTokens: -1, outputTokens: 1 },
      { inputTokens: 10, outputTokens: 1, cachedInputTokens: -1 },
      { billedNanos: -1 },
      { billedNanos: 2n ** 62n + 1n },
    ];
    for (const usage of bad) {
      let reservationId;
      await assert.rejects(
        client.call(REQUEST, async (booking) => {
          reservationId = booking.reservationId;
          return { httpStatus: 200, usage };
        }),
        RangeError,
        JSON.stringify(usage, (key, value) => (typeof value === 'bigint' ? String(value) : value)),
      );
      const booking = await client.booking(reservationId);
      assert.equal(booking.state, 'SETTLED_UNKNOWN');
      assert.equal(booking.amountNanos, CAP, 'charged at the hold');
    }
  });

  test('a usage the ledger refuses is settled UNKNOWN at once, the refusal reported on Completed and logged', async () => {
    // The paid call happened but its usage cannot be booked: settled UNKNOWN
    // (at most the cap), not left open to expire at the lane's expire_charge,
    // as the Python client's model_call and both clients' SDK transports do.
    const warnings = [];
    const logger = { warn: (message) => warnings.push(message), error: (message) => warnings.push(`error: ${message}`) };
    const client = await laneClient('refused-ending', {}, { logger });
    const result = await client.call(REQUEST, async () => ({ httpStatus: 200, usage: { inputTokens: 10, outputTokens: 101 } }));
    assert.ok(result.ledgerError instanceof OutputExceedsMaxTokens);
    assert.equal(result.ending, 'UNKNOWN');
    assert.equal(result.chargedNanos, CAP);
    const booking = await client.booking(result.reservationId);
    assert.equal(booking.state, 'SETTLED_UNKNOWN');
    assert.equal(booking.amountNanos, CAP, 'charged at the hold');
    assert.equal(warnings.length, 1);
    assert.match(warnings[0], new RegExp(`^ledger: .*${result.reservationId}.*OUTPUT_EXCEEDS_MAX_TOKENS.*settled UNKNOWN`));
  });

  test('a denial skips the callback and says when to retry', async () => {
    const client = await laneClient('denial', { limit_nanos: '2000000' });
    const first = await client.call(REQUEST, async () => ({ httpStatus: 504 }));
    assert.equal(first.chargedNanos, CAP);
    const firstReservedAt = (await client.booking(first.reservationId)).reservedAt;
    await advanceSeconds(3600);

    let ran = false;
    const denied = await client.call(REQUEST, async () => {
      ran = true;
      return { httpStatus: 200 };
    });
    assert.equal(ran, false);
    assert.ok(denied instanceof Denied);
    assert.equal(denied.admitted, false);
    assert.equal(denied.reason, 'BUDGET_EXHAUSTED');
    assert.equal(denied.deniedBy, 'denial', 'the lane itself said no');
    assert.ok(denied.message.length > 0);
    assert.ok(denied.retryAfter instanceof Date);
    assert.equal(denied.retryAfter.getTime(), firstReservedAt.getTime() + DAY_SECONDS * 1000);
    assert.equal(denied.holdNanos, CAP);
    assert.equal(denied.balance.availableNanos, 2_000_000n - CAP);

    // At retryAfter the first booking has aged out of the window.
    const seconds = Math.floor(denied.retryAfter.getTime() / 1000);
    await ledger.clock.setTime({ seconds: String(seconds), nanos: (denied.retryAfter.getTime() % 1000) * 1e6 });
    const again = await client.call(REQUEST, async () => ({ httpStatus: 200, usage: { inputTokens: 1, outputTokens: 1 } }));
    assert.equal(again.ending, 'SUCCEEDED');

    const never = await client.call({ ...REQUEST, maxOutputTokens: 1_000 }, async () => {
      ran = true;
    });
    assert.equal(ran, false);
    assert.equal(never.reason, 'HOLD_EXCEEDS_LIMIT');
    assert.equal(never.retryAfter, null);
  });

  test('a ledger that cannot be reached: a LEDGER_UNAVAILABLE denial, callback not run', async () => {
    const client = new LaneClient('127.0.0.1:1', 'nowhere', { deadlineMs: DEADLINE_MS });
    let ran = false;
    const denied = await client.call(REQUEST, async () => {
      ran = true;
    });
    assert.equal(ran, false);
    assert.ok(denied instanceof Denied);
    assert.equal(denied.reason, 'LEDGER_UNAVAILABLE');
    assert.equal(denied.deniedBy, '', 'no budget was asked');
    assert.ok(denied.ledgerError instanceof Unavailable);
    // The bare move still rejects: only call() has an outage mode.
    await assert.rejects(client.reserve({ ...REQUEST, reservationId: 'bare' }), Unavailable);
    client.close();
  });
});

describe('reserve / settle / refund', () => {
  test('a repeated Reserve returns the first answer and books nothing new', async () => {
    const client = await laneClient('idempotent');
    const request = { ...REQUEST, reservationId: 'repeat-1' };
    const first = await client.reserve(request);
    await advanceSeconds(5);
    const second = await client.reserve(request);
    assert.equal(first.admitted, true);
    // The first answer, said to be an earlier Reserve's.
    assert.equal(first.alreadyReserved, false);
    assert.deepEqual(second, { ...first, alreadyReserved: true });
    const balance = await client.balance();
    assert.equal(balance.heldNanos, CAP);
    assert.equal(balance.openBookings, 1n);

    await assert.rejects(client.reserve({ ...request, maxOutputTokens: 101 }), (error) => {
      assert.ok(error instanceof ReservationIdReused);
      assert.ok(error instanceof AlreadyExists);
      assert.equal(error.code, Status.ALREADY_EXISTS);
      assert.equal(error.reason, 'RESERVATION_ID_REUSED');
      return true;
    });

    const settle = { reservationId: 'repeat-1', outcome: 'SUCCEEDED', inputTokens: 10, outputTokens: 10 };
    const settled = await client.settle(settle);
    assert.deepEqual(await client.settle(settle), settled);
    assert.equal(settled.chargedNanos, 50_000n);
    assert.equal(settled.state, 'SETTLED');
    await assert.rejects(client.refund({ reservationId: 'repeat-1', httpStatus: 429 }), BookingAlreadyEnded);
  });

  test('a denial names the budget that said no: the lane or a parent', async () => {
    // The parent holds room for one call; each child lane alone for many.
    await ledger.admin.putLane({ lane: { lane: 'family', limit_nanos: String(CAP + CAP / 2n), prices: PRICES } });
    const child = await laneClient('family-child', { parent: 'family' });
    const admitted = await child.reserve({ ...REQUEST, reservationId: 'family-1' });
    assert.equal(admitted.admitted, true);
    assert.equal(admitted.deniedBy, '', 'admitted: no budget said no');
    const byParent = await child.reserve({ ...REQUEST, reservationId: 'family-2' });
    assert.equal(byParent.admitted, false);
    assert.equal(byParent.denialReason, 'BUDGET_EXHAUSTED');
    assert.equal(byParent.deniedBy, 'family');
    const called = await child.call(REQUEST, async () => ({ httpStatus: 200 }));
    assert.ok(called instanceof Denied);
    assert.equal(called.deniedBy, 'family');

    const alone = await laneClient('alone', { limit_nanos: String(CAP) });
    assert.equal((await alone.reserve({ ...REQUEST, reservationId: 'alone-1' })).deniedBy, '');
    const byLane = await alone.reserve({ ...REQUEST, reservationId: 'alone-2' });
    assert.equal(byLane.admitted, false);
    assert.equal(byLane.deniedBy, 'alone');
  });

  test('errors follow the one table', async () => {
    const client = await laneClient('errors', { hold_ttl: { seconds: '60', nanos: 0 } });
    const ghost = new LaneClient(ledger.address, 'no-such-lane', { grant: ledger.adminGrant ?? undefined, deadlineMs: DEADLINE_MS });
    clients.push(ghost);
    await assert.rejects(ghost.reserve({ ...REQUEST, reservationId: 'x' }), (error) => {
      assert.ok(error instanceof LaneNotFound);
      assert.ok(error instanceof NotFound);
      assert.equal(error.code, Status.NOT_FOUND);
      assert.equal(error.reason, 'LANE_NOT_FOUND');
      assert.equal(error.mayHaveApplied, false);
      return true;
    });
    await assert.rejects(ghost.balance(), LaneNotFound);

    await assert.rejects(client.reserve({ ...REQUEST, reservationId: 'neg', requestBytes: -1n }), (error) => {
      assert.ok(error instanceof InvalidArgument);
      assert.equal(error.code, Status.INVALID_ARGUMENT);
      assert.equal(error.field, 'request_bytes');
      return true;
    });
    await assert.rejects(client.reserve({ ...REQUEST, reservationId: 'model', model: 'other' }), (error) => {
      assert.ok(error instanceof UnknownModel);
      assert.ok(error instanceof InvalidArgument);
      assert.equal(error.field, 'model');
      return true;
    });
    await assert.rejects(client.reserve({ ...REQUEST, reservationId: 'ttl', ttlMs: 61_000 }), (error) => {
      assert.ok(error instanceof TtlExceedsHoldTtl);
      assert.equal(error.field, 'ttl');
      return true;
    });
    await assert.rejects(client.settle({ reservationId: 'never-made', outcome: 'UNKNOWN' }), (error) => {
      assert.ok(error instanceof BookingNotFound);
      assert.equal(error.reason, 'BOOKING_NOT_FOUND');
      return true;
    });

    const denied = await client.reserve({ ...REQUEST, reservationId: 'too-big', maxOutputTokens: 1_000_000 });
    assert.equal(denied.admitted, false);
    await assert.rejects(client.refund({ reservationId: 'too-big', httpStatus: 403 }), BookingWasDenied);
    // A client-side mistake never reaches the wire: refused as the ledger would refuse it.
    await assert.rejects(client.reserve({ ...REQUEST, reservationId: 'float', requestBytes: 1.5 }), (error) => {
      assert.ok(error instanceof InvalidArgument);
      assert.equal(error.field, 'request_bytes');
      return true;
    });
  });

  test('cache reads and writes are priced at their own rates; the cap at the dearest input rate', async () => {
    // $3 / $15 per million tokens, $0.30 to read the prompt cache, $3.75 to write it.
    const cached = {
      input_nanos_per_million_tokens: '3000000',
      output_nanos_per_million_tokens: '15000000',
      cached_input_nanos_per_million_tokens: '300000',
      cache_write_nanos_per_million_tokens: '3750000',
    };
    const client = await laneClient('cache-prices', { prices: { c: cached } });
    // 35,000 bytes at 3.5 bytes per token: 10,000 request tokens, each at the
    // write's 3.75 (the dearest input rate), plus 500 output tokens at 15.
    const request = { model: 'c', requestBytes: 35_000, maxOutputTokens: 500 };
    const anthropic = {
      usage: { input_tokens: 2_000, cache_read_input_tokens: 6_000, cache_creation_input_tokens: 2_000, output_tokens: 500 },
    };
    let capNanos = null;
    const result = await client.call(request, async (booking) => {
      capNanos = booking.capNanos;
      return { httpStatus: 200, usage: usageOf(anthropic) };
    });
    assert.equal(capNanos, 37_500n + 7_500n);
    // 2,000 uncached * 3 + 6,000 cached * 0.3 + 2,000 written * 3.75 + 500 output * 15.
    assert.equal(result.chargedNanos, 6_000n + 1_800n + 7_500n + 7_500n);
  });

  test('usage no billed call could have is refused by the table, and the booking stays open', async () => {
    const client = await laneClient('implausible');
    await client.reserve({ ...REQUEST, reservationId: 'odd' });
    const settle = { reservationId: 'odd', outcome: 'SUCCEEDED' };
    const refusedAs = (errorClass, field) => (error) => {
      assert.ok(error instanceof errorClass && error instanceof InvalidArgument, error.name);
      assert.equal(error.field, field);
      assert.equal(error.retryable, false);
      return true;
    };
    await assert.rejects(client.settle({ ...settle, outputTokens: 10 }), refusedAs(SettleWithoutUsage, 'input_tokens'));
    const tooLong = { ...settle, inputTokens: 900, outputTokens: 101 };
    await assert.rejects(client.settle(tooLong), refusedAs(OutputExceedsMaxTokens, 'output_tokens'));
    // The lane's default max_charge_multiple: 100 times the cap.
    const tooDear = { ...settle, billedNanos: 100n * CAP + 1n };
    await assert.rejects(client.settle(tooDear), refusedAs(ChargeExceedsCapMultiple, 'billed_nanos'));
    const settled = await client.settle({ ...settle, inputTokens: 900, outputTokens: 20 });
    assert.equal(settled.chargedNanos, 900n * 1000n + 20n * 4000n);
  });

  test('int64 amounts beyond 2^53 round-trip exactly', async () => {
    // 2^62 nanos is the largest limit this server accepts (MAX_AMOUNT_NANOS).
    const limit = 2n ** 62n;
    const bigPrices = { big: { input_nanos_per_million_tokens: '0', output_nanos_per_million_tokens: '1000000000000000' } };
    const client = await laneClient('int64', { limit_nanos: limit.toString(), prices: bigPrices });
    assert.equal((await client.balance()).limitNanos, limit);

    const estimate = 4_000_000_000_000_000_001n; // odd: a double cannot hold it
    assert.notEqual(BigInt(Number(estimate)), estimate);
    const answer = await client.reserve({
      reservationId: 'huge',
      model: 'big',
      requestBytes: 0,
      maxOutputTokens: 4_100_000_000n, // cap 4.1e18 nanos
      estimateNanos: estimate,
    });
    assert.equal(answer.admitted, true);
    assert.equal(answer.capNanos, 4_100_000_000_000_000_000n);
    assert.equal(answer.holdNanos, estimate);
    assert.equal(answer.balance.availableNanos, limit - estimate);

    const billed = 4_000_000_000_000_000_003n;
    const settled = await client.settle({ reservationId: 'huge', outcome: 'SUCCEEDED', billedNanos: billed });
    assert.equal(settled.chargedNanos, billed);
    const balance = await client.balance();
    assert.equal(balance.chargedNanos, billed);
    assert.equal(balance.availableNanos, limit - billed);
  });

  test('auth: no grant is Unauthenticated; a grant may be a function', { skip: false }, async (t) => {
    if (!ledger.adminGrant) {
      t.skip('this server runs without auth');
      return;
    }
    await laneClient('auth');
    const anonymous = new LaneClient(ledger.address, 'auth', { deadlineMs: DEADLINE_MS });
    clients.push(anonymous);
    await assert.rejects(anonymous.balance(), (error) => {
      assert.ok(error instanceof Unauthenticated);
      assert.equal(error.code, Status.UNAUTHENTICATED);
      return true;
    });
    const rotating = new LaneClient(ledger.address, 'auth', { grant: async () => ledger.adminGrant, deadlineMs: DEADLINE_MS });
    clients.push(rotating);
    assert.equal((await rotating.balance()).lane, 'auth');
  });
});

describe('README', () => {
  /** The README's first JavaScript example, as written. */
  function readmeExample() {
    const readme = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
    const match = /```js\n([\s\S]*?)```/.exec(readme);
    assert.ok(match, 'the README has a JavaScript example');
    assert.ok(match[1].split('\n').length <= 20, 'the example stays under 20 lines');
    return match[1];
  }

  // Anthropic-style: its input_tokens leaves out the 100 tokens read from the cache.
  const ANTHROPIC_USAGE = { input_tokens: 40, cache_read_input_tokens: 100, output_tokens: 7 };

  /** A provider that refuses prompts saying "refuse" and answers the rest with usage. */
  async function startProvider() {
    const server = http.createServer((request, response) => {
      let body = '';
      request.on('data', (chunk) => {
        body += chunk;
      });
      request.on('end', () => {
        const refused = body.includes('refuse');
        response.writeHead(refused ? 429 : 200, { 'content-type': 'application/json' });
        response.end(JSON.stringify(refused ? { error: 'rate limited' } : { text: 'yes', usage: ANTHROPIC_USAGE }));
      });
    });
    await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
    return server;
  }

  test('the example runs as written', async () => {
    const jevSmall = {
      input_nanos_per_million_tokens: '1000000000',
      output_nanos_per_million_tokens: '4000000000',
      cached_input_nanos_per_million_tokens: '100000000',
    };
    await laneClient('recall', { prices: { 'jev-small': jevSmall } });
    const provider = await startProvider();
    const environment = {
      LEDGER_ADDRESS: ledger.address,
      LEDGER_GRANT: ledger.adminGrant ?? '',
      PROVIDER_URL: `http://127.0.0.1:${provider.address().port}/v1/messages`,
    };
    const saved = Object.fromEntries(Object.keys(environment).map((name) => [name, process.env[name]]));
    Object.assign(process.env, environment);
    // The example's 300 ms provider timeout and 250 ms ledger deadline are
    // stretched, so that a loaded test machine does not fail it.
    const stretched = { timeout: (milliseconds) => AbortSignal.timeout(milliseconds * STRETCH) };
    const load = new Function('require', 'AbortSignal', `${readmeExample()}\nreturn { judge, ledger };`);
    const example = load((name) => require(name === '@lane-ledger/client' ? '..' : name), stretched);
    example.ledger.deadlineMs *= STRETCH;
    try {
      await example.ledger.waitForReady();
      assert.deepEqual(await example.judge('is this memory relevant?'), { text: 'yes', usage: ANTHROPIC_USAGE });
      assert.equal(await example.judge('please refuse'), null);
      const balance = await example.ledger.balance();
      // 40 uncached input tokens at 1000, 100 cached at 100, 7 output at 4000.
      assert.equal(balance.chargedNanos, 40n * 1000n + 100n * 100n + 7n * 4000n);
      assert.equal(balance.heldNanos, 0n);
    } finally {
      example.ledger.close();
      provider.close();
      for (const [name, value] of Object.entries(saved)) {
        if (value === undefined) delete process.env[name];
        else process.env[name] = value;
      }
    }
  });
});
