'use strict';
// Wire values to JS values and back. Every int64 travels as a decimal string
// (proto-loader `longs: String`) and is handed to callers as a BigInt, so an
// amount above 2^53 nanos (about 9 million USD) keeps every digit.

const INT64_MIN = -(2n ** 63n);
const INT64_MAX = 2n ** 63n - 1n;
const DECIMAL = /^-?\d+$/;

/**
 * A caller's integer (BigInt, safe-integer number or decimal string) as the
 * decimal string proto-loader encodes as int64. Negative values pass: the
 * server refuses them with INVALID_ARGUMENT naming the field.
 * @param {bigint|number|string} value
 * @param {string} name the field, for the error message
 * @returns {string}
 */
function int64(value, name) {
  let integer;
  if (typeof value === 'bigint') {
    integer = value;
  } else if (typeof value === 'number' && Number.isSafeInteger(value)) {
    integer = BigInt(value);
  } else if (typeof value === 'string' && DECIMAL.test(value)) {
    integer = BigInt(value);
  } else {
    throw new TypeError(
      `${name} must be a BigInt, a safe integer or a decimal string, not ${describe(value)}`,
    );
  }
  if (integer < INT64_MIN || integer > INT64_MAX) {
    throw new RangeError(`${name} does not fit in int64: ${integer}`);
  }
  return integer.toString();
}

/** Like int64, for a field that may be left out (undefined or null). */
function optionalInt64(value, name) {
  return value === undefined || value === null ? undefined : int64(value, name);
}

function describe(value) {
  if (typeof value === 'number') return `the number ${value} (not a safe integer)`;
  return typeof value === 'string' ? `the string ${JSON.stringify(value.slice(0, 40))}` : typeof value;
}

/** A wire int64 (decimal string) as a BigInt. */
function bigintOf(text) {
  return BigInt(text);
}

/**
 * A google.protobuf.Timestamp as a Date, or null when unset. Dates hold
 * milliseconds; `roundUp` rounds sub-millisecond parts up, for instants such as
 * retry_after that must not be reported early.
 */
function dateOf(timestamp, { roundUp = false } = {}) {
  if (!timestamp) return null;
  const nanos = Number(timestamp.nanos);
  const millis = roundUp ? Math.ceil(nanos / 1e6) : Math.floor(nanos / 1e6);
  return new Date(Number(BigInt(timestamp.seconds) * 1000n) + millis);
}

/** A google.protobuf.Duration as seconds (a number, possibly fractional), or null. */
function secondsOf(duration) {
  if (!duration) return null;
  return Number(duration.seconds) + Number(duration.nanos) / 1e9;
}

/** Integer milliseconds as a google.protobuf.Duration. */
function durationOfMs(milliseconds, name) {
  if (!Number.isSafeInteger(milliseconds)) throw new TypeError(`${name} must be integer milliseconds`);
  const seconds = Math.trunc(milliseconds / 1000);
  return { seconds: String(seconds), nanos: (milliseconds - seconds * 1000) * 1e6 };
}

/** @returns {import('../index').Balance|null} */
function balanceOf(message) {
  if (!message) return null;
  return {
    lane: message.lane,
    limitNanos: bigintOf(message.limit_nanos),
    spentNanos: bigintOf(message.spent_nanos),
    heldNanos: bigintOf(message.held_nanos),
    chargedNanos: bigintOf(message.charged_nanos),
    availableNanos: bigintOf(message.available_nanos),
    overrunNanos: bigintOf(message.overrun_nanos),
    openBookings: bigintOf(message.open_bookings),
    windowSeconds: secondsOf(message.window),
    asOf: dateOf(message.as_of),
  };
}

/** @returns {import('../index').ReserveResult} */
function reserveResultOf(message, reservationId) {
  const admitted = message.decision === 'ADMITTED';
  return {
    reservationId,
    admitted,
    decision: message.decision,
    holdNanos: bigintOf(message.hold_nanos),
    capNanos: bigintOf(message.cap_nanos),
    reservedAt: dateOf(message.reserved_at),
    expiresAt: dateOf(message.expires_at),
    retryAfter: dateOf(message.retry_after, { roundUp: true }),
    denialReason: admitted ? null : message.denial_reason,
    // When denied: the budget that said no, this lane or one of its parents
    // (a lane's name); "" when admitted.
    deniedBy: admitted ? '' : (message.denied_by ?? ''),
    // An earlier Reserve under this id made the booking (or denial): this is
    // its first answer repeated, and this Reserve booked nothing.
    alreadyReserved: message.already_reserved === true,
    reason: message.reason,
    balance: balanceOf(message.balance),
  };
}

/** @returns {import('../index').SettleResult} */
function settleResultOf(message) {
  return {
    chargedNanos: bigintOf(message.charged_nanos),
    state: message.state,
    balance: balanceOf(message.balance),
  };
}

/** @returns {import('../index').Booking} */
function bookingOf(message) {
  return {
    lane: message.lane,
    reservationId: message.reservation_id,
    model: message.model,
    state: message.state,
    requestBytes: bigintOf(message.request_bytes),
    maxOutputTokens: bigintOf(message.max_output_tokens),
    holdNanos: bigintOf(message.hold_nanos),
    capNanos: bigintOf(message.cap_nanos),
    amountNanos: bigintOf(message.amount_nanos),
    reservedAt: dateOf(message.reserved_at),
    expiresAt: dateOf(message.expires_at),
    agesOutAt: dateOf(message.ages_out_at),
  };
}

/** A proto3 optional int64: a BigInt, or null when the event has none. */
function optionalBigintOf(message, name) {
  return message[`_${name}`] === name ? bigintOf(message[name]) : null;
}

/** @returns {import('../index').ModelPrice} */
function modelPriceOf(message) {
  return {
    inputNanosPerMillionTokens: bigintOf(message.input_nanos_per_million_tokens),
    outputNanosPerMillionTokens: bigintOf(message.output_nanos_per_million_tokens),
    cachedInputNanosPerMillionTokens: optionalBigintOf(message, 'cached_input_nanos_per_million_tokens'),
    cacheWriteNanosPerMillionTokens: optionalBigintOf(message, 'cache_write_nanos_per_million_tokens'),
  };
}

/**
 * A lane's policy as a lane_configured event carries it (the proto's Lane).
 * The Python client's LanePolicy (convert.lane_policy).
 * @returns {import('../index').LanePolicy}
 */
function lanePolicyOf(message) {
  // The ledger sends bytes per token as thousandths / 1000: rounding gives
  // back the integer it keeps.
  const milli = message._bytes_per_token === 'bytes_per_token' ? BigInt(Math.round(message.bytes_per_token * 1000)) : null;
  return {
    lane: message.lane,
    limitNanos: bigintOf(message.limit_nanos),
    windowSeconds: secondsOf(message.window),
    holdTtlSeconds: secondsOf(message.hold_ttl),
    bytesPerTokenMilli: milli,
    overheadTokens: optionalBigintOf(message, 'overhead_tokens'),
    prices: new Map(Object.entries(message.prices).map(([model, price]) => [model, modelPriceOf(price)])),
    expireCharge: message.expire_charge === 'EXPIRE_CHARGE_UNSPECIFIED' ? '' : message.expire_charge,
    version: bigintOf(message.version),
    updatedAt: dateOf(message.updated_at),
    parent: message.parent,
    maxChargeMultiple: optionalBigintOf(message, 'max_charge_multiple'),
  };
}

/**
 * One event of the lane's log (the proto's Event). The Python client's LedgerEvent.
 * @returns {import('../index').LedgerEvent}
 */
function eventOf(message) {
  return {
    seq: bigintOf(message.seq),
    lane: message.lane,
    kind: message.kind,
    reservationId: message.reservation_id,
    amountNanos: bigintOf(message.amount_nanos),
    previousAmountNanos: bigintOf(message.previous_amount_nanos),
    occurredAt: dateOf(message.occurred_at),
    outcome: message.outcome === 'OUTCOME_UNSPECIFIED' ? '' : message.outcome,
    httpStatus: bigintOf(message.http_status),
    model: message.model,
    requestBytes: bigintOf(message.request_bytes),
    maxOutputTokens: bigintOf(message.max_output_tokens),
    inputTokens: bigintOf(message.input_tokens),
    outputTokens: bigintOf(message.output_tokens),
    cachedInputTokens: bigintOf(message.cached_input_tokens),
    cacheWriteTokens: bigintOf(message.cache_write_tokens),
    billedNanos: optionalBigintOf(message, 'billed_nanos'),
    estimateNanos: optionalBigintOf(message, 'estimate_nanos'),
    holdNanos: bigintOf(message.hold_nanos),
    capNanos: bigintOf(message.cap_nanos),
    reservedAt: dateOf(message.reserved_at),
    expiresAt: dateOf(message.expires_at),
    retryAfter: dateOf(message.retry_after, { roundUp: true }),
    denialReason: message.kind === 'denied' ? message.denial_reason : null,
    deniedBy: message.denied_by,
    reason: message.reason,
    traceId: message.trace_id,
    spentAfterNanos: bigintOf(message.spent_after_nanos),
    limitNanos: bigintOf(message.limit_nanos),
    correctionId: message.correction_id,
    grantId: message.grant_id,
    hash: message.hash,
    previousHash: message.previous_hash,
    policy: message.policy ? lanePolicyOf(message.policy) : null,
  };
}

module.exports = {
  int64,
  optionalInt64,
  bigintOf,
  dateOf,
  secondsOf,
  durationOfMs,
  balanceOf,
  reserveResultOf,
  settleResultOf,
  bookingOf,
  eventOf,
};
