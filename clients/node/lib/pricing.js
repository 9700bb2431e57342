'use strict';
// Local pricing, in integer nanos (BigInt), used only to bound the outage
// allowance. The ledger prices every booking itself; this is the same formula
// with the same rounding (every division rounds up) as the ledger's
// ledger_service/domain/pricing.py and the Python client's
// clients/python/ledger_client/pricing.py, checked by clients/cases/pricing.json.
//
// A price: {inputNanosPerMillionTokens, outputNanosPerMillionTokens,
// cachedInputNanosPerMillionTokens?, cacheWriteNanosPerMillionTokens?}, all
// BigInt; an unset (undefined or null) cache rate costs the input rate.
// A usage: {inputTokens, outputTokens, cachedInputTokens, cacheWriteTokens},
// all BigInt; the cached and cache-write tokens are PARTS of inputTokens.

const TOKENS_PER_MILLION = 1000000n;
// bytes_per_token in thousandths: 3.5 bytes per token is 3500n.
const BYTES_PER_TOKEN_SCALE = 1000n;
const DEFAULT_BYTES_PER_TOKEN_MILLI = 3500n;

function big(value, name) {
  if (typeof value !== 'bigint') {
    throw new TypeError(`${name} must be a BigInt, got ${typeof value}`);
  }
  if (value < 0n) {
    throw new RangeError(`${name} must not be negative`);
  }
  return value;
}

function optionalBig(value, name) {
  return value === undefined || value === null ? 0n : big(value, name);
}

function ceilDiv(numerator, denominator) {
  if (denominator <= 0n) throw new RangeError('denominator must be positive');
  if (numerator < 0n) throw new RangeError('numerator must not be negative');
  return (numerator + denominator - 1n) / denominator;
}

function priced(tokens, nanosPerMillionTokens) {
  return ceilDiv(tokens * nanosPerMillionTokens, TOKENS_PER_MILLION);
}

function ratesOf(price) {
  if (price === null || typeof price !== 'object') throw new TypeError('price must be an object');
  const input = big(price.inputNanosPerMillionTokens, 'inputNanosPerMillionTokens');
  const output = big(price.outputNanosPerMillionTokens, 'outputNanosPerMillionTokens');
  const cachedRate = price.cachedInputNanosPerMillionTokens;
  const writeRate = price.cacheWriteNanosPerMillionTokens;
  const cached = cachedRate === undefined || cachedRate === null ? input : big(cachedRate, 'cachedInputNanosPerMillionTokens');
  const write = writeRate === undefined || writeRate === null ? input : big(writeRate, 'cacheWriteNanosPerMillionTokens');
  return { input, output, cached, write };
}

/** The rate the cap prices every request token at: the dearest input rate. */
function dearestInputRate(price) {
  const { input, cached, write } = ratesOf(price);
  let rate = input;
  if (cached > rate) rate = cached;
  if (write > rate) rate = write;
  return rate;
}

/** Pessimistic tokens for a request: ceil(bytes / bytes_per_token) + overhead. */
function requestTokens(requestBytes, bytesPerTokenMilli, overheadTokens) {
  big(requestBytes, 'requestBytes');
  big(bytesPerTokenMilli, 'bytesPerTokenMilli');
  big(overheadTokens, 'overheadTokens');
  if (bytesPerTokenMilli === 0n) throw new RangeError('bytesPerTokenMilli must be positive');
  return ceilDiv(requestBytes * BYTES_PER_TOKEN_SCALE, bytesPerTokenMilli) + overheadTokens;
}

/**
 * The most a request of this many bytes can cost (the ledger's byte cap):
 * every request token at the dearest input rate, plus maxOutputTokens at the
 * output rate, each part rounded up.
 */
function capNanos(price, requestBytes, maxOutputTokens, bytesPerTokenMilli, overheadTokens) {
  const { output } = ratesOf(price);
  big(maxOutputTokens, 'maxOutputTokens');
  const tokensIn = requestTokens(requestBytes, bytesPerTokenMilli, overheadTokens);
  return priced(tokensIn, dearestInputRate(price)) + priced(maxOutputTokens, output);
}

/**
 * The provider's formula: each kind of token at its own rate, each part
 * rounded up on its own. cachedInputTokens and cacheWriteTokens are parts of
 * inputTokens (missing ones count 0).
 */
function realCostNanos(price, usage) {
  const { input, output, cached, write } = ratesOf(price);
  if (usage === null || typeof usage !== 'object') throw new TypeError('usage must be an object');
  const inputTokens = big(usage.inputTokens, 'inputTokens');
  const outputTokens = big(usage.outputTokens, 'outputTokens');
  const cachedTokens = optionalBig(usage.cachedInputTokens, 'cachedInputTokens');
  const writeTokens = optionalBig(usage.cacheWriteTokens, 'cacheWriteTokens');
  const uncached = inputTokens - cachedTokens - writeTokens;
  if (uncached < 0n) {
    throw new RangeError('cached and cache-write tokens are parts of inputTokens');
  }
  return (
    priced(uncached, input) +
    priced(cachedTokens, cached) +
    priced(writeTokens, write) +
    priced(outputTokens, output)
  );
}

module.exports = {
  TOKENS_PER_MILLION,
  BYTES_PER_TOKEN_SCALE,
  DEFAULT_BYTES_PER_TOKEN_MILLI,
  ceilDiv,
  dearestInputRate,
  requestTokens,
  capNanos,
  realCostNanos,
};
