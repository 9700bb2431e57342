'use strict';
// How a model call's end becomes the end of its booking: ONE table, the same
// as the Python client's (clients/python/ledger_client/outcomes.py). A refused
// call costs zero; an unknown outcome is charged at the hold (the server never
// charges more); real usage is the real cost. See docs/semantics.md, "The
// moves".

const wire = require('./wire');
const { NOT_PRINTABLE, MAX_TOKENS, MAX_AMOUNT_NANOS, kindOf } = require('./arguments');

const Ending = Object.freeze({
  /** Settle SUCCEEDED with the usage: charged the real cost. */
  SUCCEEDED: 'SUCCEEDED',
  /** Refund: the provider refused the call or it was never sent. Costs zero. */
  REFUND: 'REFUND',
  /** Settle UNKNOWN: charged the hold, never more. */
  UNKNOWN: 'UNKNOWN',
});

const isStatus = (report, low, high) => report.httpStatus >= low && report.httpStatus <= high;

// What the lane knows about the call -> how the booking ends. The first row
// that matches wins. `report` is what reportOf/reportOfError below make.
const OUTCOME_TABLE = Object.freeze([
  { when: 'the call was never sent', matches: (r) => r.notSent, ending: Ending.REFUND },
  { when: 'HTTP 4xx, 429 included: the provider refused', matches: (r) => isStatus(r, 400, 499), ending: Ending.REFUND },
  { when: 'HTTP 2xx with usage', matches: (r) => isStatus(r, 200, 299) && r.usage !== null, ending: Ending.SUCCEEDED },
  { when: 'any other answer with usage: real data wins', matches: (r) => r.usage !== null, ending: Ending.SUCCEEDED },
  { when: 'HTTP 5xx without usage', matches: (r) => isStatus(r, 500, 599), ending: Ending.UNKNOWN },
  { when: 'timeout', matches: (r) => r.timedOut, ending: Ending.UNKNOWN },
  { when: 'connection lost', matches: (r) => r.connectionLost, ending: Ending.UNKNOWN },
  { when: 'the callback threw', matches: (r) => r.thrown, ending: Ending.UNKNOWN },
  { when: 'anything else, e.g. 2xx without usage, or nothing reported', matches: () => true, ending: Ending.UNKNOWN },
]);

const REFUSED_REASON = 'the provider refused the call';
const NOT_SENT_REASON = 'the call was never sent';
// The callback returned nothing (undefined or null): settled UNKNOWN, with a
// warning, as the Python client's model_call block that reports nothing.
const NO_OUTCOME_REASON = 'the callback ended without reporting an outcome';
// A call's own reason (its callback's, or its CallNotSent's) must not keep its
// booking from ending: what the ledger would refuse as not printable becomes a
// space, and it is cut to 200 characters, never inside one, as the Python
// client's _printable_reason does.
const MAX_REASON_LENGTH = 200;

function printable(text) {
  const spaced = String(text).replace(new RegExp(NOT_PRINTABLE.source, 'gu'), ' ');
  return Array.from(spaced).slice(0, MAX_REASON_LENGTH).join('').trim();
}

/**
 * The move for a report: the first row of the table that matches, with what
 * goes with it on the wire (the status, the usage of a SUCCEEDED settle, the
 * reason of a refund).
 * @returns {{ending: string, when: string, httpStatus: number, usage: object|null, reason: string}}
 */
function endingOf(report) {
  const { when, ending } = OUTCOME_TABLE.find((row) => row.matches(report));
  if (ending === Ending.REFUND) {
    const refused = isStatus(report, 400, 499) && !report.notSent;
    return {
      ending,
      when,
      httpStatus: refused ? report.httpStatus : 0,
      usage: null,
      reason: printable(report.reason) || (refused ? REFUSED_REASON : NOT_SENT_REASON),
    };
  }
  const usage = ending === Ending.SUCCEEDED ? report.usage : null;
  return { ending, when, httpStatus: report.httpStatus, usage, reason: report.reason };
}

function statusOf(value) {
  if (value === undefined || value === null || value === 0) return 0;
  if (Number.isInteger(value) && value >= 100 && value <= 599) return value;
  throw new TypeError(`httpStatus must be an HTTP status (100 to 599) or 0, not ${String(value).slice(0, 40)}`);
}

// The ledger's bounds of a usage, as the Python client's Usage holds them: a
// count outside them is malformed (settled UNKNOWN, the error rethrown) rather
// than sent, refused by the ledger, and left open to expire (MAX_TOKENS, MAX_AMOUNT_NANOS).
const TOKEN_FIELDS = ['inputTokens', 'outputTokens', 'cachedInputTokens', 'cacheWriteTokens'];

// Each count within the ledger's bounds; the cached and cache-write tokens are
// parts of inputTokens (see usage.js), so together at most it: the server
// refuses more, and so does this check.
function checkUsage(usage) {
  const integer = (value, name) => BigInt(wire.int64(value, name));
  for (const name of TOKEN_FIELDS) {
    const count = integer(usage[name], name);
    if (count < 0n || count > MAX_TOKENS) throw new RangeError(`${name} must be between 0 and ${MAX_TOKENS}`);
  }
  if (usage.billedNanos !== null) {
    const billed = integer(usage.billedNanos, 'billedNanos');
    if (billed < 0n || billed > MAX_AMOUNT_NANOS) throw new RangeError(`billedNanos must be between 0 and ${MAX_AMOUNT_NANOS}`);
  }
  const parts = integer(usage.cachedInputTokens, 'cachedInputTokens') + integer(usage.cacheWriteTokens, 'cacheWriteTokens');
  if (parts > integer(usage.inputTokens, 'inputTokens')) {
    throw new RangeError('cachedInputTokens + cacheWriteTokens must be at most inputTokens, which counts every input token');
  }
}

// A usage's own fields (Usage in index.d.ts). Any other is refused, not
// dropped: a provider's usage object (snake_case, Anthropic's input_tokens
// without its cache) or a misspelt count would book another usage in silence.
const USAGE_FIELDS = new Set([...TOKEN_FIELDS, 'billedNanos']);

function checkUsageFields(usage) {
  if (typeof usage !== 'object' || Array.isArray(usage)) {
    throw new TypeError(`usage must be an object such as usageOf(body) gives, not ${kindOf(usage)}`);
  }
  for (const name of Object.keys(usage)) {
    if (!USAGE_FIELDS.has(name)) {
      throw new TypeError(`usage has no field '${name.slice(0, 40)}' (see Usage in index.d.ts; usageOf(body) reads a provider's usage into it)`);
    }
  }
}

// A flag left out (or null) is false; any other value than a boolean is a
// mistake: notSent: 'yes' would charge a call never sent at its hold.
function flagOf(returned, name) {
  const value = returned[name];
  if (value === undefined || value === null) return false;
  if (typeof value !== 'boolean') throw new TypeError(`${name} must be a boolean, not ${kindOf(value)}`);
  return value;
}

function reasonOf(returned) {
  const reason = returned.reason;
  if (reason === undefined || reason === null) return '';
  if (typeof reason !== 'string') throw new TypeError(`reason must be a string, not ${kindOf(reason)}`);
  return reason;
}

function reportedUsage(returned) {
  const usage = returned.usage ?? null;
  if (usage !== null) checkUsageFields(usage);
  const billedNanos = returned.billedNanos ?? usage?.billedNanos ?? null;
  if (usage === null && billedNanos === null) return null;
  const tokens = usage !== null && (usage.inputTokens !== undefined || usage.outputTokens !== undefined);
  if (!tokens && billedNanos === null) throw new TypeError('usage needs inputTokens/outputTokens or billedNanos');
  const reported = {
    inputTokens: usage?.inputTokens ?? 0,
    outputTokens: usage?.outputTokens ?? 0,
    billedNanos,
    cachedInputTokens: usage?.cachedInputTokens ?? 0,
    cacheWriteTokens: usage?.cacheWriteTokens ?? 0,
  };
  checkUsage(reported);
  return reported;
}

/**
 * What a callback's return value says about its call:
 * `{httpStatus?, usage?: {inputTokens, outputTokens, cachedInputTokens?, cacheWriteTokens?} | {billedNanos},
 *   billedNanos?,
 *   timedOut?, connectionLost?, notSent?, reason?}`.
 * `undefined` or `null` reports nothing: an UNKNOWN ending (`nothingReported`
 * is then true, and call() warns), like the Python client's model_call block
 * that ends without a report. Throws TypeError on a malformed value (any other
 * non-object, a bad status or usage), RangeError on a count outside the
 * ledger's bounds or cache counts above inputTokens (the wrapper then settles UNKNOWN).
 */
function reportOf(returned) {
  if (returned === undefined || returned === null) {
    return {
      httpStatus: 0,
      usage: null,
      timedOut: false,
      connectionLost: false,
      notSent: false,
      thrown: false,
      nothingReported: true,
      reason: NO_OUTCOME_REASON,
    };
  }
  if (typeof returned !== 'object') {
    throw new TypeError('the callback must return an object such as {httpStatus, usage}, or nothing');
  }
  return {
    httpStatus: statusOf(returned.httpStatus),
    usage: reportedUsage(returned),
    timedOut: flagOf(returned, 'timedOut'),
    connectionLost: flagOf(returned, 'connectionLost'),
    notSent: flagOf(returned, 'notSent'),
    thrown: false,
    nothingReported: false,
    reason: reasonOf(returned),
  };
}

/**
 * Throw it from a call() callback when the request never left the lane (a
 * request refused locally, a circuit breaker that is open): the booking is
 * refunded. The reason goes to the ledger's audit, so it must carry neither
 * secrets nor provider text.
 */
class CallNotSent extends Error {
  constructor(reason) {
    super(reason);
    this.name = 'CallNotSent';
    this.reason = reason;
  }
}

const NOT_SENT = Symbol.for('lane-ledger.notSent');
const NOT_SENT_REASON_KEY = Symbol.for('lane-ledger.notSentReason');

/**
 * Marks any error as "the call was never sent", like CallNotSent, for errors
 * made elsewhere. Returns the error. `reason`, when given, is the refund's
 * reason (it goes to the ledger's audit: no secrets, no provider text); the
 * error's own message is never read.
 * @template {Error} E
 * @param {E} error
 * @param {string} [reason]
 * @returns {E}
 */
function markNotSent(error, reason) {
  Object.defineProperty(error, NOT_SENT, { value: true, enumerable: false, configurable: true });
  if (typeof reason === 'string') {
    Object.defineProperty(error, NOT_SENT_REASON_KEY, { value: reason, enumerable: false, configurable: true });
  }
  return error;
}

function notSentReasonOf(error) {
  if (error instanceof CallNotSent && typeof error.reason === 'string') return error.reason;
  const marked = error?.[NOT_SENT_REASON_KEY];
  return typeof marked === 'string' ? marked : '';
}

function isNotSent(error) {
  return error instanceof CallNotSent || error?.[NOT_SENT] === true || error?.notSent === true;
}

/**
 * What a thrown error says about its call. A CallNotSent, or an error marked
 * by markNotSent (or with `notSent: true`), was never sent. An error carrying
 * an integer HTTP status (`httpStatus`, or `status` as provider SDKs set it)
 * is read by that status, so an SDK that throws on 429 still gets its refund.
 * Everything else is a call whose outcome is unknown. The error's message is
 * never read: it may hold provider text or secrets.
 */
function reportOfError(error) {
  let httpStatus = 0;
  for (const candidate of [error?.httpStatus, error?.status]) {
    if (Number.isInteger(candidate) && candidate >= 100 && candidate <= 599) {
      httpStatus = candidate;
      break;
    }
  }
  return {
    httpStatus,
    usage: null,
    timedOut: false,
    connectionLost: false,
    notSent: isNotSent(error),
    thrown: true,
    nothingReported: false,
    reason: notSentReasonOf(error),
  };
}

module.exports = { Ending, OUTCOME_TABLE, endingOf, reportOf, reportOfError, CallNotSent, markNotSent };
