'use strict';
// The arguments the client checks itself, before any call, refused the way the
// ledger would refuse them (ledger_service/domain/moves.py): an InvalidArgument
// with the reason INVALID_ARGUMENT, `.field` the wire's name and the message
// "field: rule", so one `catch (error instanceof InvalidArgument)` takes a
// mistake whether this client or the ledger saw it. The Python client refuses
// the same arguments with the same error (ledger_client/bookings.py); the cases
// are clients/cases/arguments.json.

const { randomUUID } = require('node:crypto');
const { status: Status } = require('@grpc/grpc-js');
const { InvalidArgument, TtlExceedsHoldTtl } = require('./errors');

// The ledger's bounds of a call's arguments and usage: their one home in this
// client (the journal and the outcome table check with them too).
const MAX_NAME_LENGTH = 200;
const MAX_REQUEST_BYTES = 2n ** 40n;
const MAX_TOKENS = 10n ** 12n;
const MAX_AMOUNT_NANOS = 2n ** 62n;
const MAX_TTL_US = 7n * 86_400n * 1_000_000n;
const MAX_REASON_LENGTH = 1000;
// What Python's str.isprintable() refuses (the ledger's rule for a reason):
// control, format and unassigned characters, lone surrogates, and every
// separator but the ASCII space.
const NOT_PRINTABLE = /(?! )[\p{C}\p{Z}]/u;
const RESERVATION_ID = /^[\x21-\x7e]+$/;
const DECIMAL = /^-?\d+$/;
// What Python's str.strip() takes away (the ledger's test for a blank reason).
const PYTHON_SPACE = /^[\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]*$/;

/** The InvalidArgument the ledger would send for this field and rule. */
function invalidArgument(field, rule) {
  return new InvalidArgument(`${field}: ${rule}`, { code: Status.INVALID_ARGUMENT, reason: 'INVALID_ARGUMENT', field });
}

/** Length in characters (code points), as the ledger counts: not UTF-16 units. */
function characters(text) {
  let count = 0;
  for (const _ of text) count += 1;
  return count;
}

// The ledger's rule for names (ledger_service/domain/policies.py): ASCII, a
// letter or digit first. The shared cases hold the two to the same answers.
const NAME = /^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$/;

/** The rule a text of 1 to 200 characters breaks (a reservation id's own rule aside), or null. */
function lengthRefusal(value) {
  if (typeof value !== 'string') return 'must be a string';
  if (value.length === 0) return 'is required';
  if (value.length > MAX_NAME_LENGTH && characters(value) > MAX_NAME_LENGTH) {
    return `must be at most ${MAX_NAME_LENGTH} characters`;
  }
  return null;
}

/** The rule a lane's or a model's name breaks, by the ledger's rule for names, or null. */
function nameRefusal(value) {
  const refused = lengthRefusal(value);
  if (refused !== null || NAME.test(value)) return refused;
  return 'must start with a letter or digit and use only letters, digits and ._:/@+-';
}

/** A lane's or a model's name, by the ledger's rule for names. */
function checkName(field, value) {
  const refused = nameRefusal(value);
  if (refused !== null) throw invalidArgument(field, refused);
  return value;
}

/** The lane a client is built for, by the ledger's rule for names. */
function checkLane(lane) {
  return checkName('lane', lane);
}

// A grant travels in an HTTP/2 header: visible ASCII, no spaces (as the Python
// client's channels.check_grant).
// The longest grant the ledger takes (ledger_service/domain/grants.py): a longer
// one could only be refused, and past 8 KiB of headers gRPC refuses some calls at
// random with RESOURCE_EXHAUSTED, taken for an overloaded ledger.
const MAX_GRANT_LENGTH = 4096;
const GRANT = /^[\x21-\x7e]+$/;

/**
 * A grant the header can carry. Refused with a message that never quotes it:
 * grpc-js would refuse the header itself with an error holding the whole
 * value, and a grant read from a file often ends with a line break.
 */
function checkGrant(grant, ErrorClass = TypeError) {
  if (typeof grant !== 'string' || grant.length > MAX_GRANT_LENGTH || !GRANT.test(grant)) {
    throw new ErrorClass(`a grant must be 1 to ${MAX_GRANT_LENGTH} visible ASCII characters without spaces`);
  }
  return grant;
}

/**
 * What the lane's grant function gave is no grant (empty, null, a line break):
 * a TypeError on the call. It says nothing of the request, so the journal's
 * replay leaves its entries for a later attempt instead of refusing them.
 */
class GrantError extends TypeError {}
GrantError.prototype.name = 'GrantError';

/**
 * An integer in [low, high] as a BigInt: a BigInt, a safe-integer Number or a
 * decimal string (as every int64 this client takes); anything else, or a value
 * out of range, is refused.
 */
function checkRange(field, value, low, high) {
  let integer = null;
  if (typeof value === 'bigint') integer = value;
  else if (typeof value === 'number' && Number.isSafeInteger(value)) integer = BigInt(value);
  else if (typeof value === 'string' && DECIMAL.test(value)) integer = BigInt(value);
  if (integer === null) throw invalidArgument(field, `must be an integer between ${low} and ${high}`);
  if (integer < low || integer > high) throw invalidArgument(field, `must be between ${low} and ${high}`);
  return integer;
}

/** A ttl in microseconds (BigInt), from ttlUs (the journal's) or ttlMs; null when neither is set. */
function checkTtl({ ttlMs, ttlUs }) {
  let micros;
  if (ttlUs !== undefined && ttlUs !== null) {
    if (typeof ttlUs !== 'bigint') throw invalidArgument('ttl', 'must be a whole number of microseconds');
    micros = ttlUs;
  } else if (ttlMs !== undefined && ttlMs !== null) {
    if (!Number.isSafeInteger(ttlMs)) throw invalidArgument('ttl', 'must be a whole number of milliseconds');
    micros = BigInt(ttlMs) * 1000n;
  } else {
    return null;
  }
  if (micros <= 0n) throw invalidArgument('ttl', 'must be positive');
  if (micros > MAX_TTL_US) {
    // No lane's hold_ttl is longer: the ledger refuses it as too long for the lane.
    throw new TtlExceedsHoldTtl("ttl: must not exceed the lane's hold_ttl, which is at most 7 days", {
      code: Status.INVALID_ARGUMENT,
      reason: 'TTL_EXCEEDS_HOLD_TTL',
      field: 'ttl',
    });
  }
  return micros;
}

/**
 * A Reserve's arguments, checked: {reservationId, model, requestBytes,
 * maxOutputTokens, estimateNanos (or null), ttlUs (or null)}, the integers as
 * BigInts. Throws InvalidArgument (TtlExceedsHoldTtl for a ttl past 7 days).
 */
function checkReserve({ reservationId, model, requestBytes, maxOutputTokens, estimateNanos, ttlMs, ttlUs }) {
  checkReservationId(reservationId);
  checkName('model', model);
  return {
    reservationId,
    model,
    requestBytes: checkRange('request_bytes', requestBytes, 0n, MAX_REQUEST_BYTES),
    maxOutputTokens: checkRange('max_output_tokens', maxOutputTokens, 0n, MAX_TOKENS),
    estimateNanos:
      estimateNanos === undefined || estimateNanos === null
        ? null
        : checkRange('estimate_nanos', estimateNanos, 0n, MAX_AMOUNT_NANOS),
    ttlUs: checkTtl({ ttlMs, ttlUs }),
  };
}

/**
 * The rule a reservation id breaks, by the ledger's rule, or null. The one home
 * of that rule in this client: the journal checks the ids it keeps with it too.
 */
function reservationIdRefusal(value) {
  const refused = lengthRefusal(value);
  if (refused !== null || RESERVATION_ID.test(value)) return refused;
  return 'must be printable ASCII without spaces';
}

/** The id a Reserve, Settle, Refund or GetBooking names, by the ledger's rule. */
function checkReservationId(reservationId) {
  const refused = reservationIdRefusal(reservationId);
  if (refused !== null) throw invalidArgument('reservation_id', refused);
  return reservationId;
}

/**
 * A Settle's outcome by its name, as the ledger refuses any other: the
 * wire's enum numbers (1, 2) would be taken as SUCCEEDED and UNKNOWN.
 */
function checkOutcome(outcome) {
  if (outcome !== 'SUCCEEDED' && outcome !== 'UNKNOWN') throw invalidArgument('outcome', 'must be SUCCEEDED or UNKNOWN');
}

/**
 * A Refund's reason is printable text of at most 1,000 characters, sent as
 * given; one of a call never sent (httpStatus 0) is required.
 */
function checkRefund({ httpStatus = 0, reason = '' }) {
  if (typeof reason !== 'string') throw invalidArgument('reason', 'must be a string');
  if ((httpStatus === 0 || httpStatus === 0n || httpStatus === '0') && (typeof reason !== 'string' || PYTHON_SPACE.test(reason))) {
    throw invalidArgument('reason', 'is required when http_status is 0 (a call that was never sent)');
  }
  if (reason.length > MAX_REASON_LENGTH && characters(reason) > MAX_REASON_LENGTH) {
    throw invalidArgument('reason', `must be at most ${MAX_REASON_LENGTH} characters`);
  }
  if (NOT_PRINTABLE.test(reason)) throw invalidArgument('reason', 'must be printable text');
}

/** A fresh reservation id: 32 hex digits, as the Python client's new_reservation_id. */
function newReservationId() {
  return randomUUID().replaceAll('-', '');
}

// The names each public call takes (their types in index.d.ts): a misspelt
// one would leave its default in silence (a deadline; cache-write tokens
// priced at the input rate; no journal for a journalPath meant for the
// OutagePolicy), where the Python client's keyword arguments refuse it.
const TRACE_NAMES = ['traceparent', 'tracestate'];
const NAMES = {
  LaneClientOptions: new Set([
    'grant', 'tls', 'deadlineMs', 'endAttempts', 'maxCallsInFlight', 'channelOptions', 'outage',
    'replayIntervalMs', 'replayDeadlineMs', 'maxReplayEntriesPerAttempt', 'maxReplayMsPerAttempt',
    'maxJournalBytes', 'rotateJournalBytes', 'logger', 'watchResumeMs',
  ]),
  ReserveRequest: new Set([...TRACE_NAMES, 'deadlineMs', 'reservationId', 'model', 'requestBytes', 'maxOutputTokens', 'estimateNanos', 'ttlMs']),
  CallRequest: new Set([...TRACE_NAMES, 'reservationId', 'model', 'requestBytes', 'maxOutputTokens', 'estimateNanos', 'ttlMs']),
  SettleRequest: new Set([
    ...TRACE_NAMES, 'deadlineMs', 'reservationId', 'outcome', 'inputTokens', 'outputTokens', 'billedNanos', 'httpStatus',
    'cachedInputTokens', 'cacheWriteTokens',
  ]),
  RefundRequest: new Set([...TRACE_NAMES, 'deadlineMs', 'reservationId', 'httpStatus', 'reason']),
  TraceOptions: new Set([...TRACE_NAMES, 'deadlineMs']),
  EventPageOptions: new Set(['deadlineMs', 'afterSeq', 'pageSize']),
  WatchOptions: new Set(['deadlineMs', 'afterSeq']),
  AllowanceOptions: new Set(['maxNanos', 'maxCalls', 'journalPath', 'prices', 'bytesPerTokenMilli', 'overheadTokens']),
  LedgerFetchOptions: new Set(['fetch', 'maxOutputTokens']),
  TlsOptions: new Set(['rootCerts', 'clientCert', 'clientKey', 'serverName']),
  ModelPrice: new Set(['inputNanosPerMillionTokens', 'outputNanosPerMillionTokens', 'cachedInputNanosPerMillionTokens', 'cacheWriteNanosPerMillionTokens']),
};

/** What a value is, for a TypeError's message: `null`, `an array` or its typeof. */
function kindOf(value) {
  return value === null ? 'null' : Array.isArray(value) ? 'an array' : typeof value;
}

/** Refuses a name `type` (a key of NAMES) does not have, naming it. */
function checkNames(object, type, what) {
  if (object === null || typeof object !== 'object') throw new TypeError(`${what} must be an object`);
  for (const name of Object.keys(object)) {
    if (!NAMES[type].has(name)) throw new TypeError(`${what} has no field '${name}' (see ${type} in index.d.ts)`);
  }
}

module.exports = { invalidArgument, checkNames, kindOf, checkOutcome, newReservationId, checkGrant, GrantError, checkLane, checkName, nameRefusal, reservationIdRefusal, checkRange, checkReservationId, checkReserve, checkRefund, MAX_NAME_LENGTH, MAX_REQUEST_BYTES, MAX_TOKENS, MAX_AMOUNT_NANOS, MAX_TTL_US, NOT_PRINTABLE };
