'use strict';
// The cases both clients run (clients/cases/*.json): the outcome table, the
// error table, local pricing, the arguments refused before any call and the
// client's settings, the usage read from a provider's body, the policy of a
// lane_configured event and when a call() runs under a repeated Reserve answer, against this client's lib/outcomes.js, lib/errors.js,
// lib/pricing.js, lib/usage.js, lib/wire.js and LaneClient. The Python client runs the same files in
// clients/python/tests/test_client_shared_cases.py; the server's tests
// (tests/test_error_cases.py, tests/test_pricing_cases.py) check that the files
// say what the server does.

const { describe, test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const outcomes = require('../lib/outcomes');
const errors = require('../lib/errors');
const pricing = require('../lib/pricing');
const wire = require('../lib/wire');
const { ledgerPackage } = require('../lib/proto');

const CASES_DIR = path.resolve(__dirname, '..', '..', 'cases');
const load = (name) => JSON.parse(fs.readFileSync(path.join(CASES_DIR, name), 'utf8'));
const OUTCOMES = load('outcomes.json');
const ERRORS = load('errors.json');
const PRICING = load('pricing.json');
const ARGUMENTS = load('arguments.json');
const BYTES = load('bytes.json');
const EVENTS = load('events.json');

// --- outcomes ----------------------------------------------------------------

const MOVES = Object.freeze({
  settle_succeeded: outcomes.Ending.SUCCEEDED,
  settle_unknown: outcomes.Ending.UNKNOWN,
  refund: outcomes.Ending.REFUND,
});

function statusesOf(outcomeCase) {
  const [low, high] = outcomeCase.http_status_range ?? [outcomeCase.http_status, outcomeCase.http_status];
  const statuses = [];
  for (let status = low; status <= high; status += 1) statuses.push(status);
  return statuses;
}

/** The report the client makes of a call that ended this way (see reportOf/reportOfError). */
function reportOf(failure, httpStatus, usagePresent) {
  const usage = usagePresent
    ? { inputTokens: 10n, outputTokens: 5n, billedNanos: null, cachedInputTokens: 0n, cacheWriteTokens: 0n }
    : null;
  const base = { httpStatus, usage, timedOut: false, connectionLost: false, notSent: false, thrown: false, reason: '' };
  switch (failure) {
    case 'none':
      return base;
    case 'not_sent':
      return { ...base, notSent: true, reason: 'refused locally' };
    case 'timeout':
      return { ...base, timedOut: true };
    case 'connection_lost':
      return { ...base, connectionLost: true };
    case 'exception':
      return { ...base, thrown: true };
    default:
      throw new Error(`unknown failure kind ${failure}`);
  }
}

describe('outcome cases', () => {
  for (const outcomeCase of OUTCOMES.cases) {
    test(outcomeCase.name, () => {
      const expected = MOVES[outcomeCase.move];
      assert.ok(expected, `unknown move ${outcomeCase.move}`);
      for (const httpStatus of statusesOf(outcomeCase)) {
        const ended = outcomes.endingOf(reportOf(outcomeCase.failure, httpStatus, outcomeCase.usage));
        assert.equal(ended.ending, expected, `${httpStatus}: ${ended.when}`);
      }
    });
  }

  test('the cases reach every row of the table', () => {
    const reached = new Set();
    for (const outcomeCase of OUTCOMES.cases) {
      for (const httpStatus of statusesOf(outcomeCase)) {
        reached.add(outcomes.endingOf(reportOf(outcomeCase.failure, httpStatus, outcomeCase.usage)).when);
      }
    }
    assert.deepEqual(outcomes.OUTCOME_TABLE.map((row) => row.when).filter((when) => !reached.has(when)), []);
  });

  test('the cases name every move', () => {
    assert.deepEqual(new Set(OUTCOMES.cases.map((c) => c.move)), new Set(Object.keys(MOVES)));
  });
});

// --- errors ------------------------------------------------------------------

function serviceError(statusName, pairs) {
  const code = grpc.status[statusName];
  assert.equal(typeof code, 'number', `unknown status ${statusName}`);
  const metadata = new grpc.Metadata();
  for (const [key, value] of pairs) metadata.set(key, value);
  return Object.assign(new Error('a message nobody parses'), { code, details: 'a message nobody parses', metadata });
}

/** A case's value for this client (a by_status value may differ per client). */
const forNode = (value) => (typeof value === 'object' && value !== null ? value.node : value);

function checkRetryAndOutage(error, row) {
  assert.equal(error.retryable, forNode(row.retry), 'retryable');
  assert.equal(errors.resendsReserve(error), forNode(row.resend_reserve), 'resendsReserve');
  assert.equal(errors.settlesUnknownAfterRefusal(error), row.settle_unknown_after_refusal, 'settlesUnknownAfterRefusal');
  assert.equal(errors.isLedgerUnavailable(error), forNode(row.outage), 'isLedgerUnavailable');
}

function errorClass(name) {
  const found = errors[name];
  assert.equal(typeof found, 'function', `lib/errors.js exports no ${name}`);
  return found;
}

describe('error cases', () => {
  for (const row of ERRORS.reasons) {
    test(`${row.status} ${row.reason}`, () => {
      const pairs = [['ledger-reason', row.reason]];
      if (row.field) pairs.push(['ledger-field', 'request_bytes']);
      const error = errors.ledgerErrorOf(serviceError(row.status, pairs));
      assert.equal(error.constructor, errorClass(row.node), `${row.reason} -> ${error.constructor.name}`);
      assert.equal(error.reason, row.reason);
      assert.equal(error.code, grpc.status[row.status]);
      checkRetryAndOutage(error, row);
      if (row.field) {
        assert.ok(error instanceof errors.InvalidArgument);
        assert.equal(error.field, 'request_bytes');
      }
    });
  }

  for (const row of ERRORS.by_status) {
    test(`${row.status} without a known reason`, () => {
      for (const pairs of [[], [['ledger-reason', 'A_REASON_NOBODY_KNOWS']]]) {
        const error = errors.ledgerErrorOf(serviceError(row.status, pairs));
        assert.equal(error.constructor, errorClass(row.node), JSON.stringify(pairs));
        checkRetryAndOutage(error, row);
      }
    });
  }

  for (const row of ERRORS.transport) {
    test(`${row.case}: a bare ${row.status} with gRPC's own text`, () => {
      const signal = forNode(row.signal);
      const failure = Object.assign(serviceError(row.status, []), { details: `gRPC says: ${signal} (in its words)` });
      const error = errors.ledgerErrorOf(failure);
      assert.equal(error.constructor, errorClass(row.node), `${row.case} -> ${error.constructor.name}`);
      assert.equal(error.code, grpc.status[row.status]);
      checkRetryAndOutage(error, row);
      if (row.field) assert.equal(error.field, 'request');
      // A ledger reason wins: the text is read only when the transport answered.
      const withReason = errors.ledgerErrorOf(Object.assign(serviceError(row.status, [['ledger-reason', 'SHUTTING_DOWN']]), { details: signal }));
      assert.notEqual(withReason.constructor, errorClass(row.node));
    });
  }

  test("the README's error table names every reason, each with its class", () => {
    const readme = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
    const header = '| status | `ledger-reason` | class |';
    assert.ok(readme.includes(header), 'the README has the error table');
    const lines = readme.slice(readme.indexOf(header)).split('\n\n')[0].split('\n').slice(2);
    const rows = lines.map((line) => {
      const cells = line.split(' | ').map((cell) => cell.replace(/^\|\s*|\s*\|$/g, '').trim());
      assert.equal(cells.length, 3, line);
      const [status, reasons, classCell] = cells;
      const named = classCell.match(/^`(\w+)`/);
      assert.ok(named, `a class first: ${line}`);
      return {
        line,
        status, // a gRPC status, or "any other (...)"
        reasons: [...reasons.matchAll(/`([A-Z_]+)`/g)].map((match) => match[1]),
        // "any", or "none or another": calls without a reason or with an unknown one.
        fallback: reasons.startsWith('any') || reasons.includes('none or another'),
        errorClass: errorClass(named[1]),
      };
    });
    const statusOf = (row) => (row.status.startsWith('any other') ? grpc.status.UNKNOWN : grpc.status[row.status]);
    // Each row says what lib/errors.js does.
    for (const row of rows) {
      assert.equal(typeof statusOf(row), 'number', `unknown status in: ${row.line}`);
      const reasons = [...row.reasons, ...(row.fallback ? ['', 'A_REASON_NOBODY_KNOWS'] : [])];
      assert.ok(reasons.length > 0, `a row names a reason or says none: ${row.line}`);
      for (const reason of reasons) {
        assert.equal(errors.errorClassOf(statusOf(row), reason), row.errorClass, `${row.line} (${reason || 'no reason'})`);
      }
    }
    // And every case of clients/cases/errors.json has exactly one row, with its class.
    for (const row of ERRORS.reasons) {
      const found = rows.filter((candidate) => candidate.status === row.status && candidate.reasons.includes(row.reason));
      assert.equal(found.length, 1, `${row.status} ${row.reason}: ${found.length} rows`);
      assert.equal(found[0].errorClass, errorClass(row.node), `${row.status} ${row.reason}`);
    }
    for (const row of ERRORS.by_status) {
      let found = rows.filter((candidate) => candidate.status === row.status && candidate.fallback);
      if (!rows.some((candidate) => candidate.status === row.status)) found = rows.filter((candidate) => candidate.status.startsWith('any other'));
      assert.equal(found.length, 1, `${row.status} without a reason: ${found.length} rows`);
      assert.equal(found[0].errorClass, errorClass(forNode(row.node)), `${row.status} without a reason`);
    }
  });

  test("the README's transport table names every transport case, each with its class", () => {
    const readme = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
    const header = '| transport failure | status | class |';
    assert.ok(readme.includes(header), 'the README has the transport table');
    const lines = readme.slice(readme.indexOf(header)).split('\n\n')[0].split('\n').slice(2);
    const cells = lines.map((line) => line.split(' | ').map((cell) => cell.replace(/^\|\s*|\s*\|$/g, '').trim()));
    assert.deepEqual(cells.map(([name]) => name), ERRORS.transport.map((row) => `\`${row.case}\``));
    for (const [index, row] of ERRORS.transport.entries()) {
      assert.equal(cells[index][1], row.status);
      assert.ok(cells[index][2].startsWith(`\`${row.node}\``), cells[index][2]);
    }
  });

  test('every reason of the table is a case', () => {
    const listed = new Set(ERRORS.reasons.map((row) => row.reason));
    const known = errors.ERROR_TABLE.map(([, reason]) => reason).filter((reason) => reason !== null);
    assert.deepEqual(known.filter((reason) => !listed.has(reason)), []);
  });
});

// --- pricing -----------------------------------------------------------------

function priceOf(pricingCase) {
  const { input, output, cached_input: cached, cache_write: write } = pricingCase.price;
  return {
    inputNanosPerMillionTokens: BigInt(input),
    outputNanosPerMillionTokens: BigInt(output),
    cachedInputNanosPerMillionTokens: cached === undefined ? undefined : BigInt(cached),
    cacheWriteNanosPerMillionTokens: write === undefined ? null : BigInt(write),
  };
}

function usageOf(pricingCase) {
  const usage = pricingCase.usage;
  return {
    inputTokens: BigInt(usage.input_tokens),
    outputTokens: BigInt(usage.output_tokens),
    cachedInputTokens: BigInt(usage.cached_input_tokens),
    cacheWriteTokens: BigInt(usage.cache_write_tokens),
  };
}

describe('pricing cases', () => {
  for (const capCase of PRICING.caps) {
    test(`cap: ${capCase.name}`, () => {
      const requestBytes = BigInt(capCase.request_bytes);
      const milli = BigInt(capCase.bytes_per_token_milli);
      const overhead = BigInt(capCase.overhead_tokens);
      assert.equal(pricing.requestTokens(requestBytes, milli, overhead), BigInt(capCase.request_tokens));
      const cap = pricing.capNanos(priceOf(capCase), requestBytes, BigInt(capCase.max_output_tokens), milli, overhead);
      assert.equal(cap, BigInt(capCase.cap_nanos));
    });
  }

  for (const chargeCase of PRICING.charges) {
    test(`charge: ${chargeCase.name}`, () => {
      assert.equal(pricing.realCostNanos(priceOf(chargeCase), usageOf(chargeCase)), BigInt(chargeCase.charge_nanos));
    });
  }

  for (const refusedCase of PRICING.refused_charges) {
    test(`refused: ${refusedCase.name}`, () => {
      assert.throws(() => pricing.realCostNanos(priceOf(refusedCase), usageOf(refusedCase)), RangeError);
    });
  }

  test('the package exports the pricing API', () => {
    const index = require('..');
    assert.equal(index.capNanos, pricing.capNanos);
    assert.equal(index.realCostNanos, pricing.realCostNanos);
  });

  test('arguments are BigInts', () => {
    const price = { inputNanosPerMillionTokens: 1n, outputNanosPerMillionTokens: 1n };
    assert.throws(() => pricing.capNanos(price, 1, 1n, 3500n, 0n), TypeError);
    assert.throws(() => pricing.capNanos({ ...price, inputNanosPerMillionTokens: 1 }, 1n, 1n, 3500n, 0n), TypeError);
    assert.throws(() => pricing.capNanos(price, 1n, 1n, 0n, 0n), RangeError);
    assert.throws(() => pricing.realCostNanos(price, { inputTokens: -1n, outputTokens: 0n }), RangeError);
    assert.equal(pricing.realCostNanos(price, { inputTokens: 1n, outputTokens: 0n }), 1n);
  });
});

// --- arguments checked before any call ----------------------------------------

const { LaneClient } = require('../lib/client');
const { OutagePolicy } = require('../lib/outage');
const { Denied } = require('..');
const { startFakeLedger, ledgerStatus } = require('./fake-ledger');

// Nothing listens on this port (the discard service): an argument the client
// lets through gets as far as the call, which fails as an outage.
const NOWHERE = '127.0.0.1:9';
const camel = (name) => name.replace(/_([a-z])/g, (_, letter) => letter.toUpperCase());
/** A case's value: {"int": "..."} is an integer past 2^53, a BigInt here. */
const argumentOf = (value) =>
  value !== null && typeof value === 'object' && Object.keys(value).join() === 'int' ? BigInt(value.int) : value;

function requestOf(argumentCase) {
  const request = {};
  for (const [name, value] of Object.entries({ ...ARGUMENTS.reserve_defaults, ...argumentCase.set })) {
    request[camel(name)] = argumentOf(value);
  }
  return request;
}

function isRefusal(argumentCase) {
  return (error) => {
    assert.equal(error.constructor, errors[argumentCase.error], `${error.name}: ${error.message}`);
    assert.ok(error instanceof errors.InvalidArgument);
    assert.equal(error.code, grpc.status.INVALID_ARGUMENT);
    assert.deepEqual(
      { reason: error.reason, field: error.field, message: error.message },
      { reason: argumentCase.reason, field: argumentCase.field, message: argumentCase.message },
    );
    return true;
  };
}

const isOutage = (error) => {
  assert.ok(errors.isLedgerUnavailable(error), `${error.name}: ${error.message}`);
  return true;
};

describe('argument cases', () => {
  const lane = new LaneClient(NOWHERE, 'arguments', { deadlineMs: 2000, logger: null });
  test.after(() => lane.close());

  for (const argumentCase of ARGUMENTS.reserve) {
    test(`reserve: ${argumentCase.why}`, async () => {
      const reserve = lane.reserve(requestOf(argumentCase));
      await assert.rejects(reserve, argumentCase.accepted ? isOutage : isRefusal(argumentCase));
    });
  }

  for (const argumentCase of ARGUMENTS.reserve.filter((item) => !item.accepted)) {
    test(`call: ${argumentCase.why}`, async () => {
      const call = lane.call(requestOf(argumentCase), async () => assert.fail('not called'));
      await assert.rejects(call, isRefusal(argumentCase));
    });
  }

  // A price under a name the ledger refuses could never price a call: the
  // allowance refuses it when it is made, as a Reserve would refuse the name.
  // A Map's key may be anything, null among them: refused as a Reserve's model
  // would be, as the Python client refuses a None key.
  const modelCases = ARGUMENTS.reserve.filter((item) => Object.keys(item.set).join() === 'model');
  for (const argumentCase of modelCases) {
    test(`allowance prices: ${argumentCase.why}`, () => {
      const price = { inputNanosPerMillionTokens: 1n, outputNanosPerMillionTokens: 2n };
      const prices = new Map([[argumentCase.set.model, price]]);
      const allowance = () => OutagePolicy.allowance({ maxNanos: 1n, maxCalls: 1, journalPath: 'journal.jsonl', prices });
      if (argumentCase.accepted) allowance();
      else assert.throws(allowance, isRefusal(argumentCase));
    });
  }

  for (const argumentCase of ARGUMENTS.refund) {
    test(`refund: ${argumentCase.why}`, async () => {
      const { http_status: httpStatus, reason } = argumentCase.set;
      const refund = lane.refund({ reservationId: 'r-1', httpStatus, reason });
      await assert.rejects(refund, argumentCase.accepted ? isOutage : isRefusal(argumentCase));
    });
  }

  const reservationIdCases = ARGUMENTS.reserve.filter(
    (item) => !item.accepted && Object.keys(item.set).length === 1 && 'reservation_id' in item.set,
  );
  for (const argumentCase of reservationIdCases) {
    test(`settle, refund, booking: ${argumentCase.why}`, async () => {
      const reservationId = argumentCase.set.reservation_id;
      await assert.rejects(lane.settle({ reservationId, outcome: 'UNKNOWN' }), isRefusal(argumentCase));
      await assert.rejects(lane.refund({ reservationId, httpStatus: 429 }), isRefusal(argumentCase));
      await assert.rejects(lane.booking(reservationId), isRefusal(argumentCase));
    });
  }

  for (const argumentCase of ARGUMENTS.events) {
    test(`events: ${argumentCase.why}`, async () => {
      // Nothing listens at the address: an accepted page goes out and finds no
      // ledger; a refused one is never sent.
      const { page_size: pageSize, after_seq: afterSeq } = argumentCase.set;
      const options = { pageSize, afterSeq };
      if (argumentCase.accepted) {
        await assert.rejects(lane.listEvents(options), isOutage);
        await assert.rejects(lane.allEvents(options).next(), isOutage);
        return;
      }
      await assert.rejects(lane.listEvents(options), isRefusal(argumentCase));
      assert.throws(() => lane.allEvents(options), isRefusal(argumentCase));
      if (pageSize === undefined) assert.throws(() => lane.watchEvents({ afterSeq }), isRefusal(argumentCase));
    });
  }

  const deadline = ARGUMENTS.deadline;
  const deadlineRefusal = { ...deadline, field: deadline.node, message: deadline.message.node };
  for (const deadlineMs of deadline.accepted) {
    test(`a call's deadlineMs: ${deadlineMs} is taken`, async () => {
      // Taken, the call goes out and finds no ledger.
      await assert.rejects(lane.reserve({ ...requestOf({ set: {} }), deadlineMs }), isOutage);
      await assert.rejects(lane.listEvents({ deadlineMs }), isOutage);
    });
  }
  for (const deadlineMs of deadline.refused) {
    test(`a call's deadlineMs: ${JSON.stringify(deadlineMs)} is refused`, async () => {
      await assert.rejects(lane.reserve({ ...requestOf({ set: {} }), deadlineMs }), isRefusal(deadlineRefusal));
      await assert.rejects(lane.refund({ reservationId: 'r-1', httpStatus: 429, deadlineMs }), isRefusal(deadlineRefusal));
      assert.throws(() => lane.allEvents({ deadlineMs }), isRefusal(deadlineRefusal));
      // The Python client's watch_events takes deadline_seconds the same way.
      assert.throws(() => lane.watchEvents({ deadlineMs }), isRefusal(deadlineRefusal));
    });
  }

  for (const argumentCase of ARGUMENTS.lane) {
    test(`lane: ${argumentCase.why}`, async () => {
      const make = () => new LaneClient(NOWHERE, argumentCase.set.lane, { logger: null });
      if (argumentCase.accepted) await make().close();
      else assert.throws(make, isRefusal(argumentCase));
    });
  }
});

// --- request bytes ---------------------------------------------------------------

describe('request byte cases', () => {
  const { estimateTokens } = require('../lib/context');
  for (const bytesCase of BYTES.cases) {
    test(bytesCase.why, () => {
      const value = JSON.parse(bytesCase.value);
      // The canonical text is JSON.stringify's: what ledgerFetch sends and books.
      assert.equal(JSON.stringify(value), bytesCase.json);
      assert.equal(Buffer.byteLength(bytesCase.json, 'utf8'), bytesCase.bytes);
      // 1,000 bytes a token: the estimate is the byte count.
      assert.equal(estimateTokens(value, 1000), bytesCase.bytes);
    });
  }
});

// --- settings ----------------------------------------------------------------

const SETTINGS = load('settings.json');

describe('settings cases', () => {
  /** The client made with one setting, closed at once; nothing listens at NOWHERE. */
  const made = (name, value) => {
    const client = new LaneClient(NOWHERE, 'settings', { [name]: value, logger: null });
    client.close();
    return client;
  };
  for (const setting of SETTINGS.settings) {
    test(`${setting.node}: its default and bounds`, () => {
      if ('default' in setting) assert.equal(made(setting.node, undefined)[setting.node], setting.default);
      for (const value of setting.accepted) made(setting.node, value);
      for (const value of setting.refused) assert.throws(() => made(setting.node, value), RangeError, `${setting.node} ${value}`);
    });
  }
  for (const constant of SETTINGS.constants) {
    test(`${constant.node} is ${constant.value}`, () => {
      assert.equal(require('..')[constant.node], constant.value);
    });
  }
});

// --- usage -------------------------------------------------------------------

const USAGE = load('usage.json');

describe('usage cases', () => {
  const { usageOf } = require('../lib/usage');
  for (const usageCase of USAGE.cases) {
    test(usageCase.why, () => {
      const body = JSON.parse(usageCase.body);
      if (usageCase.refused) {
        assert.throws(() => usageOf(body), (error) => error instanceof TypeError || error instanceof RangeError);
        return;
      }
      const usage = usageOf(body);
      if (usageCase.usage === null) {
        assert.equal(usage, null);
        return;
      }
      const expected = usageCase.usage;
      assert.deepEqual(usage, {
        inputTokens: BigInt(expected.input_tokens),
        outputTokens: BigInt(expected.output_tokens),
        cachedInputTokens: BigInt(expected.cached_input_tokens),
        cacheWriteTokens: BigInt(expected.cache_write_tokens),
      });
    });
  }
});

// --- events ------------------------------------------------------------------

/** The case's policy, in this client's types and names. */
function typedPolicy(policy) {
  const optional = (value) => (value === null ? null : BigInt(value));
  const priceOf = ({ input, output, cached_input: cached, cache_write: write }) => ({
    inputNanosPerMillionTokens: BigInt(input),
    outputNanosPerMillionTokens: BigInt(output),
    cachedInputNanosPerMillionTokens: optional(cached),
    cacheWriteNanosPerMillionTokens: optional(write),
  });
  return {
    lane: policy.lane,
    limitNanos: BigInt(policy.limit_nanos),
    windowSeconds: policy.window_seconds,
    holdTtlSeconds: policy.hold_ttl_seconds,
    bytesPerTokenMilli: optional(policy.bytes_per_token_milli),
    overheadTokens: optional(policy.overhead_tokens),
    prices: new Map(Object.entries(policy.prices).map(([model, price]) => [model, priceOf(price)])),
    expireCharge: policy.expire_charge,
    version: BigInt(policy.version),
    updatedAt: policy.updated_at_us === null ? null : new Date(Math.floor(policy.updated_at_us / 1000)),
    parent: policy.parent,
    maxChargeMultiple: optional(policy.max_charge_multiple),
  };
}

describe('event cases', () => {
  const Event = ledgerPackage().definition['ledger.v1.Event'];
  for (const eventCase of EVENTS.cases) {
    test(eventCase.why, () => {
      const event = wire.eventOf(Event.deserialize(Event.serialize(eventCase.wire)));
      assert.deepEqual(event.policy, eventCase.policy === null ? null : typedPolicy(eventCase.policy));
    });
  }
});

const REPEATS = load('repeats.json');
const REPEAT_ID = 'chosen-1';

/** A ledger with the contract's idempotency whose next `lost` Reserves are booked, then answered UNAVAILABLE. */
async function repeatingLedger(answers, lost) {
  const admitted = { decision: 'ADMITTED', hold_nanos: '110', cap_nanos: '110' };
  return startFakeLedger({
    Reserve: (request) => {
      const repeat = answers.has(request.reservation_id);
      if (!repeat) answers.set(request.reservation_id, admitted);
      if (lost > 0) {
        lost -= 1;
        throw ledgerStatus(grpc.status.UNAVAILABLE, '');
      }
      return { ...answers.get(request.reservation_id), already_reserved: repeat };
    },
    Settle: () => ({ charged_nanos: '1', state: 'SETTLED', balance: null }),
    Refund: () => ({ balance: null }),
  });
}

describe('repeats.json: one model call per reservation id', () => {
  for (const c of REPEATS.cases) {
    test(c.name, async () => {
      const earlier = {
        none: null,
        another_process_admitted: { decision: 'ADMITTED', hold_nanos: '110', cap_nanos: '110' },
        another_process_denied: { decision: 'DENIED', denial_reason: 'BUDGET_EXHAUSTED', reason: 'does not fit' },
      }[c.earlier];
      const fake = await repeatingLedger(new Map(earlier === null ? [] : [[REPEAT_ID, earlier]]), c.lost_answers);
      const client = new LaneClient(`127.0.0.1:${fake.port}`, 'lane', { deadlineMs: 2000, logger: null, outage: OutagePolicy.deny() });
      let modelCalls = 0;
      let result;
      try {
        await client.waitForReady();
        const request = { model: 'm', requestBytes: 100, maxOutputTokens: 10, reservationId: REPEAT_ID };
        const answer = await client.call(request, async () => {
          modelCalls += 1;
          return { httpStatus: 200, usage: { inputTokens: 90, outputTokens: 5 } };
        });
        result = answer instanceof Denied ? 'denied' : 'completed';
      } catch (error) {
        result = error.reason;
      } finally {
        await client.close();
        await fake.stop();
      }
      assert.deepEqual([modelCalls, result], [c.model_calls, c.result]);
    });
  }
});
