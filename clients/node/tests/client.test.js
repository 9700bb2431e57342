'use strict';
// Pure tests: the outcome table, the error table and the int64 encoding, with
// no server.

const { describe, test } = require('node:test');
const assert = require('node:assert/strict');
const { Metadata, status: Status } = require('@grpc/grpc-js');
const {
  LaneClient,
  DEFAULT_DEADLINE_MS,
  ERROR_TABLE,
  ledgerErrorOf,
  ledgerPackage,
  markNotSent,
  CallNotSent,
  LedgerError,
  InvalidArgument,
  LaneNotFound,
  NotFound,
  BookingAlreadyEnded,
  FailedPrecondition,
  StoreUnavailable,
  Unavailable,
  DeadlineExceeded,
  InternalError,
  PermissionDenied,
  ClientClosed,
  isLedgerUnavailable,
  ledgerFetch,
  OutagePolicy,
} = require('..');
const { endingOf, reportOf, reportOfError, OUTCOME_TABLE } = require('../lib/outcomes');
const wire = require('../lib/wire');

describe('the outcome table', () => {
  const cases = [
    [{ httpStatus: 200, usage: { inputTokens: 10, outputTokens: 5 } }, 'SUCCEEDED'],
    [{ httpStatus: 200, billedNanos: 7n }, 'SUCCEEDED'],
    [{ httpStatus: 200, usage: { billedNanos: '7' } }, 'SUCCEEDED'],
    [{ httpStatus: 400 }, 'REFUND'],
    [{ httpStatus: 403 }, 'REFUND'],
    [{ httpStatus: 429 }, 'REFUND'],
    [{ httpStatus: 429, usage: { inputTokens: 1, outputTokens: 0 } }, 'REFUND'],
    [{ httpStatus: 500 }, 'UNKNOWN'],
    [{ httpStatus: 503 }, 'UNKNOWN'],
    [{ httpStatus: 502, usage: { inputTokens: 3, outputTokens: 4 } }, 'SUCCEEDED'],
    [{ timedOut: true }, 'UNKNOWN'],
    [{ connectionLost: true }, 'UNKNOWN'],
    [{ httpStatus: 200 }, 'UNKNOWN'],
    [{ notSent: true, reason: 'breaker open' }, 'REFUND'],
  ];
  for (const [returned, ending] of cases) {
    test(`${JSON.stringify(returned, (_key, value) => (typeof value === 'bigint' ? `${value}n` : value))} -> ${ending}`, () => {
      assert.equal(endingOf(reportOf(returned)).ending, ending);
    });
  }

  test('thrown errors: unknown, unless marked not sent or carrying a 4xx', () => {
    assert.equal(endingOf(reportOfError(new Error('socket hang up'))).ending, 'UNKNOWN');
    assert.equal(endingOf(reportOfError(Object.assign(new Error('x'), { name: 'TimeoutError' }))).ending, 'UNKNOWN');
    assert.equal(endingOf(reportOfError(markNotSent(new Error('breaker open')))).ending, 'REFUND');
    assert.equal(endingOf(reportOfError(Object.assign(new Error('x'), { notSent: true }))).ending, 'REFUND');
    assert.equal(endingOf(reportOfError(Object.assign(new Error('x'), { status: 429 }))).ending, 'REFUND');
    assert.equal(endingOf(reportOfError(Object.assign(new Error('x'), { httpStatus: 403 }))).ending, 'REFUND');
    assert.equal(endingOf(reportOfError(Object.assign(new Error('x'), { status: 500 }))).ending, 'UNKNOWN');
    assert.equal(endingOf(reportOfError(Object.assign(new Error('x'), { status: 'ECONNRESET' }))).ending, 'UNKNOWN');
    assert.equal(endingOf(reportOfError('a string')).ending, 'UNKNOWN');
  });

  test('a refund carries the status of a refusal, or a printable reason', () => {
    assert.deepEqual(endingOf(reportOf({ httpStatus: 429 })), {
      ending: 'REFUND',
      when: 'HTTP 4xx, 429 included: the provider refused',
      httpStatus: 429,
      usage: null,
      reason: 'the provider refused the call',
    });
    const marked = endingOf(reportOfError(markNotSent(new Error('secret provider text'))));
    assert.equal(marked.httpStatus, 0);
    assert.equal(marked.reason, 'the call was never sent', 'an error message never reaches the audit');
    const reasoned = endingOf(reportOfError(markNotSent(new Error('secret provider text'), 'could not connect: ECONNREFUSED')));
    assert.equal(reasoned.reason, 'could not connect: ECONNREFUSED', 'the reason given to markNotSent');
    const breaker = endingOf(reportOfError(new CallNotSent('breaker\nopen\u00a0now')));
    assert.equal(breaker.reason, 'breaker open now');
    const blank = endingOf(reportOf({ notSent: true, httpStatus: 200, reason: '\n\t' }));
    assert.equal(blank.httpStatus, 0);
    assert.equal(blank.reason, 'the call was never sent');
  });

  test('a callback that returns nothing reports nothing: UNKNOWN, as the Python client', () => {
    for (const nothing of [undefined, null]) {
      const report = reportOf(nothing);
      assert.equal(report.nothingReported, true);
      assert.equal(endingOf(report).ending, 'UNKNOWN');
      assert.equal(endingOf(report).reason, 'the callback ended without reporting an outcome');
    }
    assert.equal(reportOf({ httpStatus: 200 }).nothingReported, false);
    assert.equal(reportOfError(new Error('x')).nothingReported, false);
  });

  test('malformed reports are refused', () => {
    for (const malformed of ['ok', 42, true]) assert.throws(() => reportOf(malformed), TypeError);
    assert.throws(() => reportOf({ httpStatus: 42 }), TypeError);
    assert.throws(() => reportOf({ httpStatus: 200, usage: {} }), TypeError);
  });

  test('a usage or a flag the report does not have is refused, naming it', () => {
    // Each was read as something else in silence: a provider's own usage
    // object (its snake_case counts) or a misspelt cachedInputTokens was
    // dropped, and notSent: 'yes' (not true) charged a call never sent at
    // its hold instead of refunding it.
    for (const [report, message] of [
      [{ httpStatus: 200, usage: { prompt_tokens: 10, completion_tokens: 2 } }, /^usage has no field 'prompt_tokens'.*usageOf/],
      [{ httpStatus: 200, usage: { input_tokens: 10, output_tokens: 2, cache_read_input_tokens: 5 } }, /^usage has no field 'input_tokens'/],
      [{ httpStatus: 200, usage: { inputTokens: 10, outputTokens: 2, cachedTokens: 5 } }, /^usage has no field 'cachedTokens'/],
      [{ httpStatus: 200, usage: 12 }, /^usage must be an object such as usageOf\(body\) gives, not number/],
      [{ httpStatus: 200, usage: [10, 2] }, /^usage must be an object such as usageOf\(body\) gives, not an array/],
      [{ notSent: 'yes' }, /^notSent must be a boolean, not string/],
      [{ timedOut: 1 }, /^timedOut must be a boolean, not number/],
      [{ connectionLost: 'true' }, /^connectionLost must be a boolean, not string/],
      [{ httpStatus: 403, reason: 42 }, /^reason must be a string, not number/],
    ]) {
      assert.throws(() => reportOf(report), { name: 'TypeError', message }, JSON.stringify(report));
    }
    const usage = { inputTokens: 10n, outputTokens: 2n, cachedInputTokens: 5n, cacheWriteTokens: 0n };
    assert.equal(reportOf({ httpStatus: 200, usage, answer: { id: 'x' }, notSent: false, reason: undefined }).usage.cachedInputTokens, 5n);
    assert.equal(reportOf({ httpStatus: 200, usage: { billedNanos: 7 }, timedOut: null }).usage.billedNanos, 7);
  });

  test('every row names its case and ends in one of the three endings', () => {
    for (const row of OUTCOME_TABLE) {
      assert.ok(row.when.length > 0);
      assert.ok(['SUCCEEDED', 'REFUND', 'UNKNOWN'].includes(row.ending));
    }
    assert.equal(OUTCOME_TABLE.at(-1).ending, 'UNKNOWN', 'what nobody foresaw is charged at the hold, never more');
  });
});

function serviceError(code, reason, extra = {}) {
  const metadata = new Metadata();
  if (reason) metadata.set('ledger-reason', reason);
  for (const [key, value] of Object.entries(extra)) metadata.set(key, value);
  return Object.assign(new Error(`${code} message`), { code, details: 'details', metadata });
}

describe('the error table', () => {
  test('reason and status pick the class', () => {
    const lane = ledgerErrorOf(serviceError(Status.NOT_FOUND, 'LANE_NOT_FOUND'));
    assert.ok(lane instanceof LaneNotFound && lane instanceof NotFound && lane instanceof LedgerError);
    assert.equal(lane.message, 'details');
    const field = ledgerErrorOf(serviceError(Status.INVALID_ARGUMENT, 'INVALID_ARGUMENT', { 'ledger-field': 'request_bytes' }));
    assert.ok(field instanceof InvalidArgument);
    assert.equal(field.field, 'request_bytes');
    assert.ok(ledgerErrorOf(serviceError(Status.FAILED_PRECONDITION, 'BOOKING_ALREADY_ENDED')) instanceof BookingAlreadyEnded);
    const store = ledgerErrorOf(serviceError(Status.UNAVAILABLE, 'STORE_UNAVAILABLE'));
    assert.ok(store instanceof StoreUnavailable && store instanceof Unavailable);
    assert.equal(store.retryable, true);
    assert.equal(store.mayHaveApplied, true);
    const internal = ledgerErrorOf(serviceError(Status.INTERNAL, 'INTERNAL', { 'ledger-error-id': 'abc123' }));
    assert.ok(internal instanceof InternalError);
    assert.equal(internal.errorId, 'abc123');
    assert.ok(ledgerErrorOf(serviceError(Status.PERMISSION_DENIED, 'PERMISSION_DENIED')) instanceof PermissionDenied);
  });

  test('without a reason (transport errors) or with a new one, the status decides', () => {
    const deadline = ledgerErrorOf(serviceError(Status.DEADLINE_EXCEEDED, ''));
    assert.ok(deadline instanceof DeadlineExceeded);
    assert.equal(deadline.retryable, true);
    assert.ok(ledgerErrorOf(serviceError(Status.UNAVAILABLE, '')) instanceof Unavailable);
    const novel = ledgerErrorOf(serviceError(Status.FAILED_PRECONDITION, 'SOMETHING_NEW'));
    assert.equal(novel.constructor, FailedPrecondition);
    assert.equal(novel.reason, 'SOMETHING_NEW');
    assert.equal(novel.mayHaveApplied, false);
    assert.equal(ledgerErrorOf(serviceError(Status.DATA_LOSS, '')).constructor, LedgerError);
  });

  test('each (status, reason) pair has one row', () => {
    const keys = ERROR_TABLE.map(([code, reason]) => `${code}/${reason}`);
    assert.equal(new Set(keys).size, keys.length);
  });
});

describe('int64 on the wire', () => {
  const { definition } = ledgerPackage();
  const Lane = definition['ledger.v1.Lane'];

  test('amounts far beyond 2^53 keep every digit, both ways', () => {
    for (const amount of [9_000_000_000_000_000_000n, 2n ** 63n - 1n, -(2n ** 63n), 2n ** 53n + 1n]) {
      const bytes = Lane.serialize({ lane: 'x', limit_nanos: wire.int64(amount, 'limit') });
      assert.equal(wire.bigintOf(Lane.deserialize(bytes).limit_nanos), amount);
    }
  });

  test('numbers that are not safe integers are refused, never rounded', () => {
    assert.equal(wire.int64(12, 'n'), '12');
    assert.equal(wire.int64('-5', 'n'), '-5');
    assert.throws(() => wire.int64(2 ** 53 + 2, 'n'), TypeError);
    assert.throws(() => wire.int64(1.5, 'n'), TypeError);
    assert.throws(() => wire.int64('1e3', 'n'), TypeError);
    assert.throws(() => wire.int64(2n ** 63n, 'n'), RangeError);
  });

  test('a retry_after in the middle of a millisecond is rounded up', () => {
    const timestamp = { seconds: '1790000000', nanos: 1_000_001 };
    assert.equal(wire.dateOf(timestamp, { roundUp: true }).getTime(), 1_790_000_000_002);
    assert.equal(wire.dateOf(timestamp).getTime(), 1_790_000_000_001);
  });
});

test('the default deadline is 250 ms', () => {
  assert.equal(DEFAULT_DEADLINE_MS, 250);
  const client = new LaneClient('127.0.0.1:1', 'lane');
  assert.equal(client.deadlineMs, 250);
  client.close();
});

describe('grants', () => {
  // Shaped like a real grant; what matters is that it never shows up in an error.
  const GRANT = 'lg1.k3f9a01c2.eyJleHAiOjE4fQ.q0JxSECRETSIGNATURE5Uk';
  const leaks = (error) => [error.message, String(error), error.stack ?? ''].some((text) => text.includes('SECRETSIGNATURE'));

  test('a grant that no header can carry is refused at construction, without quoting it', () => {
    // Longer than the ledger takes (4096): past 8 KiB of headers gRPC refuses some
    // calls at random with RESOURCE_EXHAUSTED (an overload), the others UNAUTHENTICATED.
    for (const grant of [`${GRANT}\n`, ` ${GRANT}`, `${GRANT} x`, `${GRANT}\u00e9`, 'x'.repeat(4097 - GRANT.length) + GRANT, 'x'.repeat(16 * 1024 + 1) + GRANT]) {
      assert.throws(
        () => new LaneClient('127.0.0.1:1', 'lane', { grant }),
        (error) => error instanceof TypeError && !leaks(error) && /grant/.test(error.message),
      );
    }
  });

  test('a grant function that returns one no header can carry fails the call, without quoting it', async () => {
    // Read from a file, a grant often ends with a line break: grpc-js would
    // refuse the header with an error that quotes it, grant and all.
    const client = new LaneClient('127.0.0.1:1', 'lane', { grant: () => `${GRANT}\n`, deadlineMs: 50 });
    try {
      await assert.rejects(client.balance(), (error) => error instanceof TypeError && !leaks(error));
      await assert.rejects(
        client.reserve({ reservationId: 'r-1', model: 'm', requestBytes: 10, maxOutputTokens: 1 }),
        (error) => !leaks(error),
      );
    } finally {
      client.close();
    }
  });

  test('a grant function that gives no grant fails the call with a TypeError, never sending it without one', async () => {
    // The README: any value but a grant is a TypeError on the call. Sent without
    // the header, it came back as the server's UNAUTHENTICATED (here: the
    // closed port's UNAVAILABLE, an outage).
    for (const given of ['', null, undefined]) {
      const client = new LaneClient('127.0.0.1:1', 'lane', { grant: () => given, deadlineMs: 50 });
      try {
        await assert.rejects(client.balance(), (error) => error instanceof TypeError && /grant/.test(error.message));
      } finally {
        client.close();
      }
    }
  });

  test('a grant function that throws or rejects fails the call with a GrantError, its failure kept as the cause', async () => {
    // The README: the client's own error, never the function's raw one (which a
    // replay took for a bad entry when it was a TypeError, and dropped it).
    const { GrantError } = require('..');
    const failure = new Error('the secret store is down');
    for (const grant of [() => { throw failure; }, async () => { throw failure; }]) {
      const client = new LaneClient('127.0.0.1:1', 'lane', { grant, deadlineMs: 50 });
      try {
        await assert.rejects(client.balance(), (error) => {
          assert.ok(error instanceof GrantError && error instanceof TypeError, `${error}`);
          assert.equal(error.cause, failure);
          assert.match(error.message, /grant function/);
          return true;
        });
      } finally {
        client.close();
      }
    }
  });

  test('a grant function that never answers fails the call with a GrantError at its deadline, never sending it', async () => {
    // The README: each ledger call is bounded by deadlineMs, and a call() in
    // deny mode answers at the deadline; a pending grant promise hung them all.
    const { GrantError } = require('..');
    const client = new LaneClient('127.0.0.1:1', 'lane', { grant: () => new Promise(() => {}), deadlineMs: 50 });
    const isLate = (error) => error instanceof GrantError && /grant function/.test(error.message) && /50 ms/.test(error.message);
    try {
      await assert.rejects(client.balance(), isLate);
      await assert.rejects(client.balance({ deadlineMs: 80 }), (error) => error instanceof GrantError && /80 ms/.test(error.message));
      await assert.rejects(client.call({ model: 'm', requestBytes: 10, maxOutputTokens: 1 }, async () => ({ httpStatus: 200 })), isLate);
      const tail = client.watchEvents();
      await assert.rejects(tail.next(), isLate);
    } finally {
      await client.close();
    }
  });

  test('a request that is not an object is a TypeError naming the method, not the engine\'s', async () => {
    const client = new LaneClient('127.0.0.1:1', 'lane', { deadlineMs: 50 });
    try {
      const methods = {
        call: (request) => client.call(request, async () => ({ httpStatus: 200 })),
        reserve: (request) => client.reserve(request),
        settle: (request) => client.settle(request),
        refund: (request) => client.refund(request),
      };
      for (const [name, send] of Object.entries(methods)) {
        for (const request of [undefined, null, 'r-1', 42, []]) {
          await assert.rejects(send(request), (error) => error instanceof TypeError && error.message.startsWith(`${name}() needs its request as an object`));
        }
      }
    } finally {
      await client.close();
    }
  });

  test('waitForReady on a ledger that cannot be reached rejects with Unavailable, an outage', async () => {
    // A lane that waits at start-up must be able to start in its outage mode,
    // with the same predicate as its calls: grpc-js's bare Error was none of these.
    const client = new LaneClient('127.0.0.1:1', 'lane');
    try {
      await assert.rejects(client.waitForReady(200), (error) => error instanceof Unavailable && isLedgerUnavailable(error) && /200 ms/.test(error.message));
      await assert.rejects(client.waitForReady(0), RangeError);
      await assert.rejects(client.waitForReady('5000'), RangeError);
    } finally {
      await client.close();
    }
    await assert.rejects(client.waitForReady(200), ClientClosed);
  });

  test('an option LaneClient does not know is a TypeError naming it, not a default in silence', () => {
    // A misspelt deadlineMs got 250 ms; a journalPath given to the client
    // instead of its OutagePolicy left the lane with no journal at all.
    for (const name of ['deadlineMS', 'journalPath', 'watchResumeMS', 'timeout']) {
      assert.throws(
        () => new LaneClient('127.0.0.1:1', 'lane', { [name]: 1000 }),
        (error) => error instanceof TypeError && error.message.includes(`'${name}'`),
      );
    }
  });

  test('a request or options field a call does not take is a TypeError naming it, and nothing is sent', async () => {
    // Ignored, a misspelt cacheWriteTokens priced the cache writes at the
    // input rate (under-booked where writes cost more), a misspelt deadlineMs
    // got the client's, a page_size the default page.
    const client = new LaneClient('127.0.0.1:1', 'lane', { deadlineMs: 50, logger: null });
    const usage = { reservationId: 'r-1', outcome: 'SUCCEEDED', inputTokens: 10 };
    const reserve = { reservationId: 'r-1', model: 'm', requestBytes: 10, maxOutputTokens: 10 };
    const refused = [
      ['cacheWriteToken', () => client.settle({ ...usage, cacheWriteToken: 5 })],
      ['deadlineMS', () => client.reserve({ ...reserve, deadlineMS: 1000 })],
      ['http_status', () => client.refund({ reservationId: 'r-1', http_status: 403 })],
      ['deadlineMs', () => client.call({ ...reserve, deadlineMs: 1000 }, async () => ({ status: 200 }))],
      ['traceParent', () => client.balance({ traceParent: 'x' })],
      ['deadline', () => client.booking('r-1', { deadline: 1000 })],
      ['page_size', () => client.listEvents({ page_size: 5 })],
      ['after', () => client.allEvents({ after: 5 })],
      ['afterSeqs', () => client.watchEvents({ afterSeqs: 5 })],
      ['overheadToken', () => OutagePolicy.allowance({ maxNanos: 1n, maxCalls: 1, prices: {}, journalPath: '/tmp/j', overheadToken: 5n })],
      ['maxTokens', () => ledgerFetch(client, { maxTokens: 10 })],
      // A misspelt cache rate priced the cache reads at the input rate.
      ['cachedNanosPerMillionTokens', () => OutagePolicy.allowance({ maxNanos: 1n, maxCalls: 1, journalPath: '/tmp/j', prices: { m: { inputNanosPerMillionTokens: 1n, outputNanosPerMillionTokens: 1n, cachedNanosPerMillionTokens: 0n } } })],
    ];
    try {
      for (const [name, call] of refused) {
        await assert.rejects(
          async () => call(),
          (error) => error instanceof TypeError && error.message.includes(`'${name}'`),
          name,
        );
      }
    } finally {
      await client.close();
    }
  });

  test("a settle() outcome that is not 'SUCCEEDED' or 'UNKNOWN' is refused naming outcome, and nothing is sent", async () => {
    // The wire's enum numbers were taken: outcome 1 settled SUCCEEDED, 2 UNKNOWN.
    const client = new LaneClient('127.0.0.1:1', 'lane', { deadlineMs: 50, logger: null });
    try {
      for (const outcome of [1, 2, 1n, true, undefined, 'succeeded', 'OUTCOME_UNSPECIFIED']) {
        await assert.rejects(
          client.settle({ reservationId: 'r-1', outcome, inputTokens: 10 }),
          (error) => error instanceof InvalidArgument && error.field === 'outcome' && error.message === 'outcome: must be SUCCEEDED or UNKNOWN',
          String(outcome),
        );
      }
    } finally {
      await client.close();
    }
  });

  test('a visible ASCII grant is sent as it is', () => {
    const client = new LaneClient('127.0.0.1:1', 'lane', { grant: GRANT });
    client.close();
  });
});
