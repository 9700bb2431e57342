'use strict';
// Pure tests: provider usage blocks read by the ledger's convention, the cache
// counts of a reported usage, and the error table's newer reasons.

const { describe, test } = require('node:test');
const assert = require('node:assert/strict');
const { Metadata, status: Status } = require('@grpc/grpc-js');
const {
  usageOf,
  ledgerErrorOf,
  errorClassOf,
  LedgerError,
  Refusal,
  InvalidArgument,
  SettleWithoutUsage,
  OutputExceedsMaxTokens,
  ChargeExceedsCapMultiple,
  SumOutOfRange,
  BookingStillOpen,
  FailedPrecondition,
  CorrectionIdReused,
  AlreadyExists,
} = require('..');
const { endingOf, reportOf } = require('../lib/outcomes');

// 10,000 input tokens, of which 6,000 read from the cache and 2,000 written to it.
const CACHED = { inputTokens: 10_000n, outputTokens: 500n, cachedInputTokens: 6_000n, cacheWriteTokens: 2_000n };

describe('usageOf: a provider body by the ledger convention', () => {
  test('OpenAI prompt_tokens already counts the cached tokens; completion_tokens the reasoning ones', () => {
    const body = {
      choices: [{ message: { content: '...' } }],
      usage: {
        prompt_tokens: 10_000,
        completion_tokens: 500,
        total_tokens: 10_500,
        prompt_tokens_details: { cached_tokens: 6_000, audio_tokens: 0 },
        completion_tokens_details: { reasoning_tokens: 120 },
      },
    };
    assert.deepEqual(usageOf(body), { ...CACHED, cacheWriteTokens: 0n });
    assert.deepEqual(usageOf(body.usage), usageOf(body), 'the usage object itself is read too');
  });

  test('the OpenAI Responses API counts the same way under other names', () => {
    const usage = {
      input_tokens: 10_000,
      input_tokens_details: { cached_tokens: 6_000 },
      output_tokens: 500,
      output_tokens_details: { reasoning_tokens: 120 },
    };
    assert.deepEqual(usageOf({ usage }), { ...CACHED, cacheWriteTokens: 0n });
  });

  test('OpenAI cache writes (chat and Responses) are read as parts of the input, as Python reads them', () => {
    // Read as 0, the written tokens were priced at the input rate: under-booked
    // for a lane whose cache-write rate is dearer.
    const expected = { inputTokens: 1_200n, outputTokens: 30n, cachedInputTokens: 100n, cacheWriteTokens: 1_000n };
    const details = { cached_tokens: 100, cache_write_tokens: 1_000 };
    const chat = { prompt_tokens: 1_200, completion_tokens: 30, prompt_tokens_details: details };
    assert.deepEqual(usageOf({ usage: chat }), expected);
    const responses = { input_tokens: 1_200, output_tokens: 30, input_tokens_details: details };
    assert.deepEqual(usageOf({ usage: responses }), expected);
  });

  test('Anthropic input_tokens excludes the cache, so the cache reads and writes are added', () => {
    const usage = {
      input_tokens: 2_000,
      cache_read_input_tokens: 6_000,
      cache_creation_input_tokens: 2_000,
      cache_creation: { ephemeral_5m_input_tokens: 2_000, ephemeral_1h_input_tokens: 0 },
      output_tokens: 500,
    };
    assert.deepEqual(usageOf({ content: [], usage }), CACHED);
  });

  test('missing or null counts are 0', () => {
    const plain = { inputTokens: 40n, outputTokens: 7n, cachedInputTokens: 0n, cacheWriteTokens: 0n };
    assert.deepEqual(usageOf({ usage: { input_tokens: 40, output_tokens: 7 } }), plain);
    assert.deepEqual(usageOf({ usage: { input_tokens: 40, output_tokens: 7, cache_read_input_tokens: null } }), plain);
    assert.deepEqual(usageOf({ usage: { prompt_tokens: 40, completion_tokens: 7, prompt_tokens_details: null } }), plain);
  });

  test('no usage, or no input token at all, is no usage (the call is charged at its hold)', () => {
    for (const body of [
      null,
      undefined,
      'text',
      { error: { message: 'rate limited' } },
      { usage: null },
      { usage: { total_tokens: 5 } },
      { usage: { prompt_tokens: 0, completion_tokens: 0 } },
      { usage: { input_tokens: 0, output_tokens: 3 } },
    ]) {
      assert.equal(usageOf(body), null, JSON.stringify(body));
    }
  });

  test('malformed counts are refused', () => {
    for (const usage of [
      { prompt_tokens: '900', completion_tokens: 1 },
      { prompt_tokens: 900.5, completion_tokens: 1 },
      { prompt_tokens: true, completion_tokens: 1 },
      { input_tokens: -1, output_tokens: 1 },
      { prompt_tokens: 10, completion_tokens: 1, prompt_tokens_details: { cached_tokens: 11 } },
      { prompt_tokens: 10, completion_tokens: 1, prompt_tokens_details: { cached_tokens: 6, cache_write_tokens: 5 } },
      { prompt_tokens: 10, completion_tokens: 1, prompt_tokens_details: [] },
    ]) {
      assert.throws(() => usageOf({ usage }), (error) => error instanceof TypeError || error instanceof RangeError, JSON.stringify(usage));
    }
  });

  test('a count above the ledger bound (10^12 tokens) is refused, as the Python client refuses it', () => {
    const bound = 10 ** 12;
    for (const usage of [
      { prompt_tokens: 10 ** 13, completion_tokens: 1 },
      { prompt_tokens: 10, completion_tokens: bound + 1 },
      { input_tokens: bound + 1, input_tokens_details: { cached_tokens: 0 }, output_tokens: 1 },
      { input_tokens: 1, output_tokens: bound + 1 },
      // Anthropic's parts each within the bound, their sum (the ledger's input_tokens) above it.
      { input_tokens: bound, cache_read_input_tokens: 1, output_tokens: 1 },
    ]) {
      assert.throws(() => usageOf({ usage }), RangeError, JSON.stringify(usage));
    }
    const most = usageOf({ usage: { prompt_tokens: bound, completion_tokens: bound, prompt_tokens_details: { cached_tokens: bound } } });
    assert.deepEqual(most, { inputTokens: 10n ** 12n, outputTokens: 10n ** 12n, cachedInputTokens: 10n ** 12n, cacheWriteTokens: 0n });
    // JSON has one number type: 900.0 is the count 900.
    assert.equal(usageOf(JSON.parse('{"usage": {"prompt_tokens": 900.0, "completion_tokens": 1}}')).inputTokens, 900n);
  });
});

describe('a reported usage carries its cache counts', () => {
  test('they go with a SUCCEEDED ending', () => {
    const move = endingOf(reportOf({ httpStatus: 200, usage: CACHED }));
    assert.equal(move.ending, 'SUCCEEDED');
    assert.equal(move.usage.cachedInputTokens, 6_000n);
    assert.equal(move.usage.cacheWriteTokens, 2_000n);
    const plain = endingOf(reportOf({ httpStatus: 200, usage: { inputTokens: 10, outputTokens: 1 } }));
    assert.equal(plain.usage.cachedInputTokens, 0);
    assert.equal(plain.usage.cacheWriteTokens, 0);
  });

  test('cached and cache-write tokens are parts of inputTokens', () => {
    assert.throws(() => reportOf({ httpStatus: 200, usage: { ...CACHED, cachedInputTokens: 8_001n } }), RangeError);
    assert.throws(() => reportOf({ httpStatus: 200, usage: { inputTokens: 1, outputTokens: 1, cacheWriteTokens: 1.5 } }), TypeError);
  });
});

function serviceError(code, reason, field) {
  const metadata = new Metadata();
  metadata.set('ledger-reason', reason);
  if (field) metadata.set('ledger-field', field);
  return Object.assign(new Error('message'), { code, details: 'details', metadata });
}

describe('the error table: the newer reasons', () => {
  const rows = [
    [Status.INVALID_ARGUMENT, 'SETTLE_WITHOUT_USAGE', SettleWithoutUsage, InvalidArgument],
    [Status.INVALID_ARGUMENT, 'OUTPUT_EXCEEDS_MAX_TOKENS', OutputExceedsMaxTokens, InvalidArgument],
    [Status.INVALID_ARGUMENT, 'CHARGE_EXCEEDS_CAP_MULTIPLE', ChargeExceedsCapMultiple, InvalidArgument],
    [Status.INVALID_ARGUMENT, 'SUM_OUT_OF_RANGE', SumOutOfRange, InvalidArgument],
    [Status.FAILED_PRECONDITION, 'BOOKING_STILL_OPEN', BookingStillOpen, FailedPrecondition],
    [Status.ALREADY_EXISTS, 'CORRECTION_ID_REUSED', CorrectionIdReused, AlreadyExists],
  ];
  for (const [code, reason, errorClass, parent] of rows) {
    test(`${reason} -> ${errorClass.name}, a refusal never worth a retry`, () => {
      assert.equal(errorClassOf(code, reason), errorClass);
      const error = ledgerErrorOf(serviceError(code, reason, 'output_tokens'));
      assert.equal(error.constructor, errorClass);
      assert.ok(error instanceof parent && error instanceof Refusal && error instanceof LedgerError);
      assert.equal(error.reason, reason);
      assert.equal(error.field, 'output_tokens');
      assert.equal(error.retryable, false);
      assert.equal(error.mayHaveApplied, false);
    });
  }
});
