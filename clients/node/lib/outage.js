'use strict';
// What a lane does while the ledger cannot be reached, chosen by its operator
// (the same choices as the Python client's clients/python/ledger_client/outage.py).
//
// - `deny` (fail closed): every call falls back until the ledger answers again.
// - `allowance`: at most `maxNanos` and `maxCalls` of calls the ledger has not
//   booked yet, priced locally with the ledger's own formula (pricing.js). Each
//   such call is journaled before it is made and replayed to the ledger later;
//   the allowance frees up only as the ledger acknowledges the replayed calls,
//   so a long outage spends it once, not once per reconnect. There is no
//   unbounded setting.

const wire = require('./wire');
const { capNanos, realCostNanos, DEFAULT_BYTES_PER_TOKEN_MILLI } = require('./pricing');
const { checkName, checkNames } = require('./arguments');
const { JournalError, Source, Settlement, MAX_AMOUNT_NANOS, checkArguments, newEntry } = require('./journal');

const MAX_ALLOWANCE_CALLS = 100_000;
const MAX_OVERHEAD_TOKENS = 10_000_000n;
const MIN_BYTES_PER_TOKEN_MILLI = 100n;
const MAX_BYTES_PER_TOKEN_MILLI = 64_000n;
const MAX_PRICE_NANOS_PER_MILLION = 10n ** 15n;

const OutageMode = Object.freeze({ DENY: 'deny', ALLOWANCE: 'allowance' });

/** Why call() resolved with a Denied. */
const DenialReason = Object.freeze({
  /** The ledger said no; retryAfter says when. */
  BUDGET_EXHAUSTED: 'BUDGET_EXHAUSTED',
  /** The ledger said no, for ever. */
  HOLD_EXCEEDS_LIMIT: 'HOLD_EXCEEDS_LIMIT',
  /** Unreachable, and the outage mode is deny (or the allowance has no price for the model). */
  LEDGER_UNAVAILABLE: 'LEDGER_UNAVAILABLE',
  /** Unreachable, and the allowance is spent. */
  ALLOWANCE_EXHAUSTED: 'ALLOWANCE_EXHAUSTED',
});

/** Who admitted a call of call(). */
const CallSource = Object.freeze({
  /** The ledger admitted it. */
  LEDGER: 'ledger',
  /** The ledger was unreachable; the outage allowance admitted it. */
  ALLOWANCE: 'allowance',
});

function bigintIn(value, name, low, high) {
  const integer = BigInt(wire.int64(value, name));
  if (integer < low || integer > high) throw new RangeError(`${name} must be between ${low} and ${high}`);
  return integer;
}

function priceOf(model, price) {
  if (price === null || typeof price !== 'object') throw new TypeError(`the price of ${model} must be an object`);
  checkNames(price, 'ModelPrice', `the price of ${model}`);
  const rate = (name, optional) => {
    const value = price[name];
    if (optional && (value === undefined || value === null)) return undefined;
    return bigintIn(value, `${model}: ${name}`, 0n, MAX_PRICE_NANOS_PER_MILLION);
  };
  return Object.freeze({
    inputNanosPerMillionTokens: rate('inputNanosPerMillionTokens', false),
    outputNanosPerMillionTokens: rate('outputNanosPerMillionTokens', false),
    cachedInputNanosPerMillionTokens: rate('cachedInputNanosPerMillionTokens', true),
    cacheWriteNanosPerMillionTokens: rate('cacheWriteNanosPerMillionTokens', true),
  });
}

function pricesOf(prices) {
  if (prices === null || typeof prices !== 'object') throw new TypeError('prices must be an object or a Map of model to price');
  const pairs = prices instanceof Map ? [...prices.entries()] : Object.entries(prices);
  // A price under a name the ledger refuses could never price a call. A Map's
  // key is checked as it is, not as text: null would pass as the model "null".
  return new Map(pairs.map(([model, price]) => [checkName('model', model), priceOf(model, price)]));
}

/** The lane's outage mode. Make one with OutagePolicy.deny() or OutagePolicy.allowance(). */
class OutagePolicy {
  constructor({
    mode,
    journalPath = null,
    maxNanos = 0n,
    maxCalls = 0,
    prices = new Map(),
    bytesPerTokenMilli = DEFAULT_BYTES_PER_TOKEN_MILLI,
    overheadTokens = 0n,
  }) {
    if (!Object.values(OutageMode).includes(mode)) throw new RangeError(`mode must be "deny" or "allowance"`);
    if (journalPath !== null && (typeof journalPath !== 'string' || journalPath === '')) {
      throw new TypeError('journalPath must be a non-empty string');
    }
    this.mode = mode;
    /**
     * Where calls the ledger has not heard of are kept. Required for an
     * allowance; with `deny` it still lets endings that could not be sent, and
     * Reserves that got no answer, reach the ledger later.
     */
    this.journalPath = journalPath;
    if (mode === OutageMode.DENY) {
      this.maxNanos = 0n;
      this.maxCalls = 0;
      this.prices = new Map();
      this.bytesPerTokenMilli = DEFAULT_BYTES_PER_TOKEN_MILLI;
      this.overheadTokens = 0n;
      Object.freeze(this);
      return;
    }
    if (journalPath === null) throw new TypeError('an outage allowance needs a journalPath');
    if (!(Number.isSafeInteger(maxCalls) && maxCalls >= 1 && maxCalls <= MAX_ALLOWANCE_CALLS)) {
      throw new RangeError(`maxCalls must be an integer between 1 and ${MAX_ALLOWANCE_CALLS}`);
    }
    this.maxCalls = maxCalls;
    this.maxNanos = bigintIn(maxNanos, 'maxNanos', 1n, MAX_AMOUNT_NANOS);
    /** Local prices for the allowance: the lane's prices in the ledger, copied. */
    this.prices = pricesOf(prices);
    if (this.prices.size === 0) throw new RangeError("an outage allowance needs the lane's prices");
    this.bytesPerTokenMilli = bigintIn(bytesPerTokenMilli, 'bytesPerTokenMilli', MIN_BYTES_PER_TOKEN_MILLI, MAX_BYTES_PER_TOKEN_MILLI);
    this.overheadTokens = bigintIn(overheadTokens, 'overheadTokens', 0n, MAX_OVERHEAD_TOKENS);
    Object.freeze(this);
  }

  /** Fail closed. With a journal, unsent endings and unanswered Reserves still reach the ledger later. */
  static deny(journalPath = null) {
    return new OutagePolicy({ mode: OutageMode.DENY, journalPath });
  }

  /**
   * A bounded allowance: at most maxNanos (a BigInt) and maxCalls, each call
   * priced at its byte cap from `prices` (model -> ModelPrice, the lane's own).
   * @param {import('../index').AllowanceOptions} options
   */
  static allowance(options = {}) {
    checkNames(options, 'AllowanceOptions', 'OutagePolicy.allowance() options');
    const { maxNanos, maxCalls, journalPath, prices, bytesPerTokenMilli, overheadTokens } = options;
    return new OutagePolicy({
      mode: OutageMode.ALLOWANCE,
      journalPath: journalPath ?? null,
      maxNanos,
      maxCalls,
      prices,
      bytesPerTokenMilli: bytesPerTokenMilli ?? DEFAULT_BYTES_PER_TOKEN_MILLI,
      overheadTokens: overheadTokens ?? 0n,
    });
  }

  /**
   * What the ledger would hold for this call (the byte cap, or the estimate
   * when lower) and its cap; null for a model without a local price.
   */
  localHold(args) {
    const price = this.prices.get(args.model);
    if (price === undefined) return null;
    const cap = capNanos(price, args.requestBytes, args.maxOutputTokens, this.bytesPerTokenMilli, this.overheadTokens);
    const hold = args.estimateNanos === null || args.estimateNanos > cap ? cap : args.estimateNanos;
    return { holdNanos: hold, capNanos: cap };
  }

  /** What the ledger will charge for this ending of an allowance entry, as far as the lane can tell. */
  localChargeNanos(entry, ending) {
    if (ending.settlement === Settlement.REFUND) return 0n;
    const usage = ending.usage;
    if (ending.settlement === Settlement.SETTLE_UNKNOWN) {
      if (usage !== null && usage.billedNanos !== null) {
        return usage.billedNanos < entry.localHoldNanos ? usage.billedNanos : entry.localHoldNanos;
      }
      return entry.localHoldNanos;
    }
    if (usage.billedNanos !== null) return usage.billedNanos;
    const price = this.prices.get(entry.arguments.model);
    if (price === undefined) return entry.localHoldNanos; // never for an allowance entry
    return realCostNanos(price, usage);
  }
}

/** A call()'s request as the journal keeps it: every integer a BigInt. Throws RangeError or TypeError. */
function argumentsOf(request) {
  const optional = (value, name) => (value === undefined || value === null ? null : BigInt(wire.int64(value, name)));
  let ttlUs = null;
  if (request.ttlUs !== undefined && request.ttlUs !== null) {
    ttlUs = BigInt(wire.int64(request.ttlUs, 'ttlUs'));
  } else if (request.ttlMs !== undefined && request.ttlMs !== null) {
    if (!Number.isSafeInteger(request.ttlMs)) throw new TypeError('ttlMs must be integer milliseconds');
    ttlUs = BigInt(request.ttlMs) * 1000n;
  }
  return checkArguments({
    reservationId: request.reservationId,
    model: request.model,
    requestBytes: BigInt(wire.int64(request.requestBytes, 'requestBytes')),
    maxOutputTokens: BigInt(wire.int64(request.maxOutputTokens, 'maxOutputTokens')),
    estimateNanos: optional(request.estimateNanos, 'estimateNanos'),
    ttlUs,
  });
}

function isJournalTrouble(error) {
  // The journal refused (full, closed) or the file system did (ENOSPC, EIO, ...).
  return error instanceof JournalError || error instanceof RangeError || typeof error?.code === 'string';
}

/**
 * Whether nothing says what the call cost: still open, or ended UNKNOWN (timed
 * out, cut off, the lane died) without a billed amount. The ledger will charge
 * its hold, the estimate when one lowered it, but the provider may bill up to
 * the cap: the allowance bounds what may have been spent.
 */
function costUnknown(entry) {
  const ending = entry.ending;
  if (ending === null) return true;
  return ending.settlement === Settlement.SETTLE_UNKNOWN && (ending.usage === null || ending.usage.billedNanos === null);
}

function exhausted(message) {
  return { admitted: false, denialReason: DenialReason.ALLOWANCE_EXHAUSTED, message: `the ledger is unreachable and ${message}` };
}

/**
 * The bounded local allowance. Its use is derived from the journal (the
 * allowance entries not yet replayed), so it survives a restart of the lane.
 */
class Allowance {
  constructor(policy, journal) {
    if (policy.mode !== OutageMode.ALLOWANCE) throw new TypeError('an Allowance needs an allowance policy');
    this._policy = policy;
    this._journal = journal;
    this._tail = Promise.resolve();
  }

  /** What is spent of the allowance: {nanos, calls} of the entries not yet acknowledged. */
  used() {
    let nanos = 0n;
    let calls = 0;
    for (const entry of this._journal.pending()) {
      if (entry.source !== Source.ALLOWANCE) continue;
      calls += 1;
      nanos += costUnknown(entry) ? this._openCost(entry) : entry.localChargeNanos;
    }
    return { nanos, calls };
  }

  /** An open call, or one ended UNKNOWN without a bill, may cost its cap, whatever estimate lowered its hold. */
  _openCost(entry) {
    const priced = this._policy.localHold(entry.arguments);
    if (priced === null || priced.capNanos < entry.localHoldNanos) return entry.localHoldNanos;
    return priced.capNanos;
  }

  /**
   * Admits one call on the allowance and journals it (fsync'd) before
   * answering, or says why not: {admitted, holdNanos, capNanos} or
   * {admitted: false, denialReason, message}.
   */
  async take(lane, request, traceId = '') {
    let args;
    try {
      args = argumentsOf(request);
    } catch (error) {
      return {
        admitted: false,
        denialReason: DenialReason.LEDGER_UNAVAILABLE,
        message: `the ledger is unreachable and this call cannot be journaled (${error.message})`,
      };
    }
    const priced = this._policy.localHold(args);
    if (priced === null) {
      return {
        admitted: false,
        denialReason: DenialReason.LEDGER_UNAVAILABLE,
        message: 'the ledger is unreachable and the allowance has no price for this model',
      };
    }
    // One take at a time: the use read and the line written are one step.
    const run = this._tail.then(() => this._take(lane, args, priced, traceId));
    this._tail = run.catch(() => undefined);
    return run;
  }

  async _take(lane, args, { holdNanos, capNanos: cap }, traceId) {
    const policy = this._policy;
    const use = this.used();
    if (use.calls + 1 > policy.maxCalls) return exhausted(`all ${policy.maxCalls} allowance calls are used`);
    // Admitted at its cap: an estimate lowers the ledger's hold, not what the
    // call may cost, and the allowance bounds the cost.
    if (use.nanos + cap > policy.maxNanos) {
      const left = use.nanos < policy.maxNanos ? policy.maxNanos - use.nanos : 0n;
      return exhausted(`a call capped at ${cap} nanos does not fit the ${left} nanos left of the allowance`);
    }
    try {
      await this._journal.recordReserve(newEntry(lane, args, Source.ALLOWANCE, holdNanos, { traceId }));
    } catch (error) {
      if (!isJournalTrouble(error)) throw error;
      return exhausted('the journal cannot take another call');
    }
    return { admitted: true, holdNanos, capNanos: cap };
  }

  /** Journals how an allowance call ended, with what it will cost. */
  async recordEnd(reservationId, ending) {
    const entry = this._journal.entry(reservationId);
    if (entry === null || entry.source !== Source.ALLOWANCE) throw new JournalError('not an allowance entry');
    await this._journal.recordEnd(reservationId, ending, this._policy.localChargeNanos(entry, ending));
  }
}

module.exports = {
  OutagePolicy,
  OutageMode,
  Allowance,
  DenialReason,
  CallSource,
  argumentsOf,
  isJournalTrouble,
  MAX_ALLOWANCE_CALLS,
  MAX_OVERHEAD_TOKENS,
  MAX_PRICE_NANOS_PER_MILLION,
};
