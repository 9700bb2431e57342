'use strict';
// The one error table: a gRPC status code plus the server's `ledger-reason`
// trailer become one error class. It inverts the server's table
// (ledger_service/api/errors.py). Nothing here reads an error's message text.

const { status: Status } = require('@grpc/grpc-js');

const REASON_KEY = 'ledger-reason';
const FIELD_KEY = 'ledger-field';
const ERROR_ID_KEY = 'ledger-error-id';

/** Base of every error a ledger call rejects with. */
class LedgerError extends Error {
  /**
   * Whether the same request may succeed if sent again (with the same
   * reservation id: every move is idempotent).
   */
  static retryable = false;

  /**
   * Whether the server may have applied the request although the caller got
   * an error (a deadline passed, the connection dropped, the commit was
   * unconfirmed). False only for definite refusals, which book nothing.
   */
  static mayHaveApplied = true;

  constructor(message, { code, reason = '', field = '', errorId = '', metadata = null, cause } = {}) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = new.target.name;
    /** gRPC status code (a number, see @grpc/grpc-js `status`). */
    this.code = code;
    /** The server's `ledger-reason`, e.g. "LANE_NOT_FOUND"; empty when none came. */
    this.reason = reason;
    /** The server's `ledger-field` for bad input, e.g. "request_bytes". */
    this.field = field;
    /** For INTERNAL errors: the id the server logged the failure under. */
    this.errorId = errorId;
    this.metadata = metadata;
  }

  get retryable() {
    return this.constructor.retryable;
  }

  get mayHaveApplied() {
    return this.constructor.mayHaveApplied;
  }
}

// Definite refusals: the server looked at the request and booked nothing.
class Refusal extends LedgerError {
  static mayHaveApplied = false;
}
class InvalidArgument extends Refusal {}
class TtlExceedsHoldTtl extends InvalidArgument {}
class UnknownModel extends InvalidArgument {}
// Usage no billed call could have: the booking stays open; settle it with the
// real usage, or UNKNOWN.
class SettleWithoutUsage extends InvalidArgument {}
class OutputExceedsMaxTokens extends InvalidArgument {}
class ChargeExceedsCapMultiple extends InvalidArgument {}
class SumOutOfRange extends InvalidArgument {}
// The ledger refused the request for its size: gRPC's own bare
// RESOURCE_EXHAUSTED ("Received message larger than max"), not an overload;
// the server's max_message_bytes is below the request. field: 'request'.
class RequestTooLarge extends InvalidArgument {}
// TLS (the `tls` option) to a ledger serving plaintext, or plaintext to one
// serving TLS, or a ledger's certificate this client refuses (rootCerts,
// serverName), or a client certificate (or none) a mutual-TLS ledger refuses
// (the last three told apart in client.js, which knows the tls option): every
// retry fails the same way, so no outage mode.
class TlsMismatch extends Refusal {}
class NotFound extends Refusal {}
class LaneNotFound extends NotFound {}
class BookingNotFound extends NotFound {}
class AlreadyExists extends Refusal {}
class ReservationIdReused extends AlreadyExists {}
class CorrectionIdReused extends AlreadyExists {}
class FailedPrecondition extends Refusal {}
class BookingAlreadyEnded extends FailedPrecondition {}
class BookingWasDenied extends FailedPrecondition {}
class BookingStillOpen extends FailedPrecondition {}
class ResourceExhausted extends Refusal {
  static retryable = true;
}
class TooManyWatchers extends ResourceExhausted {}
// Reconcile only: every turn stayed taken while it waited; nothing changed.
class TooManyReconciles extends ResourceExhausted {}
// The grant already had its share of the server's calls running, or the
// server's calls were nearly all taken and it ran more than a few: slow down,
// send it again later.
class TooManyCalls extends ResourceExhausted {}
class Unauthenticated extends Refusal {}
class PermissionDenied extends Refusal {}
class Unimplemented extends Refusal {}

// Unconfirmed: the request may or may not have been applied.
class Unavailable extends LedgerError {
  static retryable = true;
}
class StoreUnavailable extends Unavailable {}
// The ledger's database reports damage: no answer until an operator restores it.
class StoreDamaged extends Unavailable {}
class DeadlineExceeded extends LedgerError {
  static retryable = true;
}
// Cut off before its answer: grpc-js reports CANCELLED for a call the server
// reset, as a server shutting down does (and for calls on a channel this
// client closed). The client never cancels a call of its own, so this is an
// outage, not a refusal: retried like Unavailable, and it drives the outage mode.
class Cancelled extends LedgerError {
  static retryable = true;
}
// The ledger's own INTERNAL: it always carries the reason INTERNAL (and the
// id the server logged the failure under). Not worth a retry.
class InternalError extends LedgerError {}

/**
 * The lane's own code used the client after close(): a programming error, not
 * an outage, so no outage mode answers it (no allowance spent, nothing
 * journaled) and nothing is sent. Also for a call close() cancelled once its
 * grace was over (`mayHaveApplied`: the ledger may have booked it). Not a
 * LedgerError: the ledger never sends it, so it has no row in the error table.
 */
class ClientClosed extends Error {
  constructor(message, { mayHaveApplied = false, cause } = {}) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = 'ClientClosed';
    this.mayHaveApplied = mayHaveApplied;
  }
}

/**
 * Whether the ledger could not be reached or could not answer now: the Python
 * client's LedgerUnavailable family. UNAVAILABLE (any reason: a refused or
 * dropped connection, a GOAWAY from a server shutting down, STORE_UNAVAILABLE,
 * RECOVERY_REQUIRED), INTERNAL without the reason INTERNAL (the transport's,
 * made an Unavailable by the table), DEADLINE_EXCEEDED, CANCELLED (a server
 * shutdown), and RESOURCE_EXHAUSTED without a known reason (an overloaded
 * server). This is what switches call() to the lane's outage mode; every such
 * error is safe to retry with the same reservation id.
 * @param {unknown} error
 * @returns {boolean}
 */
function isLedgerUnavailable(error) {
  return (
    error instanceof Unavailable ||
    error instanceof DeadlineExceeded ||
    error instanceof Cancelled ||
    (error instanceof ResourceExhausted && error.constructor === ResourceExhausted)
  );
}

// [gRPC status, ledger-reason or null for "any other reason, or none", class].
// A row with a reason wins over the row of its status without one.
const ERROR_TABLE = Object.freeze([
  [Status.INVALID_ARGUMENT, 'TTL_EXCEEDS_HOLD_TTL', TtlExceedsHoldTtl],
  [Status.INVALID_ARGUMENT, 'UNKNOWN_MODEL', UnknownModel],
  [Status.INVALID_ARGUMENT, 'SETTLE_WITHOUT_USAGE', SettleWithoutUsage],
  [Status.INVALID_ARGUMENT, 'OUTPUT_EXCEEDS_MAX_TOKENS', OutputExceedsMaxTokens],
  [Status.INVALID_ARGUMENT, 'CHARGE_EXCEEDS_CAP_MULTIPLE', ChargeExceedsCapMultiple],
  [Status.INVALID_ARGUMENT, 'SUM_OUT_OF_RANGE', SumOutOfRange],
  [Status.INVALID_ARGUMENT, null, InvalidArgument],
  [Status.NOT_FOUND, 'LANE_NOT_FOUND', LaneNotFound],
  [Status.NOT_FOUND, 'BOOKING_NOT_FOUND', BookingNotFound],
  [Status.NOT_FOUND, null, NotFound],
  [Status.ALREADY_EXISTS, 'RESERVATION_ID_REUSED', ReservationIdReused],
  [Status.ALREADY_EXISTS, 'CORRECTION_ID_REUSED', CorrectionIdReused],
  [Status.ALREADY_EXISTS, null, AlreadyExists],
  [Status.FAILED_PRECONDITION, 'BOOKING_ALREADY_ENDED', BookingAlreadyEnded],
  [Status.FAILED_PRECONDITION, 'BOOKING_WAS_DENIED', BookingWasDenied],
  [Status.FAILED_PRECONDITION, 'BOOKING_STILL_OPEN', BookingStillOpen],
  [Status.FAILED_PRECONDITION, null, FailedPrecondition],
  [Status.RESOURCE_EXHAUSTED, 'TOO_MANY_WATCHERS', TooManyWatchers],
  [Status.RESOURCE_EXHAUSTED, 'TOO_MANY_RECONCILES', TooManyReconciles],
  [Status.RESOURCE_EXHAUSTED, 'TOO_MANY_CALLS', TooManyCalls],
  [Status.RESOURCE_EXHAUSTED, null, ResourceExhausted],
  [Status.UNAUTHENTICATED, null, Unauthenticated],
  [Status.PERMISSION_DENIED, null, PermissionDenied],
  [Status.UNIMPLEMENTED, null, Unimplemented],
  [Status.UNAVAILABLE, 'STORE_UNAVAILABLE', StoreUnavailable],
  [Status.UNAVAILABLE, 'STORE_DAMAGED', StoreDamaged],
  [Status.UNAVAILABLE, 'SHUTTING_DOWN', Unavailable],
  [Status.UNAVAILABLE, null, Unavailable],
  [Status.DEADLINE_EXCEEDED, null, DeadlineExceeded],
  [Status.CANCELLED, null, Cancelled],
  // The server's own INTERNAL always carries its reason. A bare one is the
  // transport's (a stream reset, e.g. "Received RST_STREAM with code 2", the
  // connection closed under the call): the ledger went away, as for UNAVAILABLE.
  [Status.INTERNAL, 'INTERNAL', InternalError],
  [Status.INTERNAL, null, Unavailable],
]);

/** The class the table gives a status code and a reason; LedgerError when none. */
function errorClassOf(code, reason) {
  let fallback = LedgerError;
  for (const [rowCode, rowReason, errorClass] of ERROR_TABLE) {
    if (rowCode !== code) continue;
    if (rowReason === reason) return errorClass;
    if (rowReason === null && fallback === LedgerError) fallback = errorClass;
  }
  return fallback;
}

function firstValue(metadata, key) {
  const values = metadata && typeof metadata.get === 'function' ? metadata.get(key) : [];
  return values.length > 0 ? String(values[0]) : '';
}

// gRPC's rich error model, which the server sends beside its own trailers: a
// google.rpc.Status (grpc-status-details-bin) whose ErrorInfo carries the same
// reason and fields. Read where our own trailers are missing (a proxy dropped
// them). Decoded by hand from the protobuf wire format: three small messages.
const DETAILS_KEY = 'grpc-status-details-bin';
const ERROR_DOMAIN = 'ledger.v1';
const ERROR_INFO_TYPE = 'type.googleapis.com/google.rpc.ErrorInfo';

/** The length-delimited fields of a protobuf message: [[fieldNumber, Buffer]]. */
function delimitedFields(buffer) {
  const fields = [];
  let at = 0;
  const varint = () => {
    let value = 0;
    for (let shift = 0; shift < 35; shift += 7) {
      if (at >= buffer.length) throw new RangeError('truncated varint');
      const byte = buffer[at++];
      value += (byte & 0x7f) * 2 ** shift;
      if (byte < 0x80) return value;
    }
    throw new RangeError('varint too long');
  };
  while (at < buffer.length) {
    const key = varint();
    const wireType = key % 8;
    if (wireType === 0) varint();
    else if (wireType === 2) {
      const length = varint();
      if (at + length > buffer.length) throw new RangeError('truncated field');
      fields.push([Math.floor(key / 8), buffer.subarray(at, at + length)]);
      at += length;
    } else if (wireType === 1) at += 8;
    else if (wireType === 5) at += 4;
    else throw new RangeError(`wire type ${wireType}`);
  }
  return fields;
}

/**
 * The ledger's ErrorInfo in a call's trailers, as trailer names
 * ({'ledger-reason': ..., 'ledger-field': ...}); {} when there is none.
 */
function richErrorInfo(metadata) {
  const values = metadata && typeof metadata.get === 'function' ? metadata.get(DETAILS_KEY) : [];
  if (values.length === 0 || !Buffer.isBuffer(values[0])) return {};
  try {
    for (const [number, any] of delimitedFields(values[0])) {
      if (number !== 3) continue; // Status.details: repeated Any
      const anyFields = delimitedFields(any);
      const typeUrl = anyFields.find(([n]) => n === 1)?.[1]?.toString('utf8');
      const value = anyFields.find(([n]) => n === 2)?.[1];
      if (typeUrl !== ERROR_INFO_TYPE || value === undefined) continue;
      const found = {};
      let domain = '';
      for (const [field, bytes] of delimitedFields(value)) {
        if (field === 1) found[REASON_KEY] = bytes.toString('utf8');
        else if (field === 2) domain = bytes.toString('utf8');
        else if (field === 3) {
          const entry = delimitedFields(bytes);
          const name = entry.find(([n]) => n === 1)?.[1]?.toString('utf8') ?? '';
          found[`ledger-${name.replaceAll('_', '-')}`] =
            entry.find(([n]) => n === 2)?.[1]?.toString('utf8') ?? '';
        }
      }
      if (domain === ERROR_DOMAIN) return found;
    }
  } catch (error) {
    if (!(error instanceof RangeError)) throw error;
  }
  return {};
}

/** A trailer of ours, or what the rich error model says in its place. */
function trailerValue(metadata, key, rich) {
  return firstValue(metadata, key) || (rich[key] ?? '');
}

// gRPC's own texts for a client's mistake that every retry repeats. Messages
// are otherwise never read: these come from the transport, with no ledger
// reason, and are the only signal there is (clients/cases/errors.json, "transport").
const NOT_TLS = 'wrong version number';
const TOO_LARGE = 'message larger than max';

/** The client error for a bare transport status no outage produces, or null. */
function transportMistake(serviceError, reason) {
  if (ERROR_TABLE.some(([, rowReason]) => rowReason !== null && rowReason === reason)) return null;
  const details = String(serviceError.details || serviceError.message || '');
  const options = { code: serviceError.code, metadata: serviceError.metadata ?? null, cause: serviceError };
  if (serviceError.code === Status.UNAVAILABLE && details.includes(NOT_TLS)) {
    const message =
      'the ledger does not speak TLS (the handshake got "wrong version number"): leave out the tls option, ' +
      'or give the address of a ledger serving TLS';
    return new TlsMismatch(message, options);
  }
  if (serviceError.code === Status.RESOURCE_EXHAUSTED && details.includes(TOO_LARGE)) {
    const message = `request: too large for the ledger's max_message_bytes (${details})`;
    return new RequestTooLarge(message, { ...options, field: 'request' });
  }
  return null;
}

/**
 * Converts a @grpc/grpc-js ServiceError into the table's error class.
 * @param {import('@grpc/grpc-js').ServiceError} serviceError
 * @returns {LedgerError}
 */
function ledgerErrorOf(serviceError) {
  const metadata = serviceError.metadata ?? null;
  const rich = richErrorInfo(metadata);
  const reason = trailerValue(metadata, REASON_KEY, rich);
  const mistake = transportMistake(serviceError, reason);
  if (mistake !== null) return mistake;
  const errorClass = errorClassOf(serviceError.code, reason);
  return new errorClass(serviceError.details || serviceError.message, {
    code: serviceError.code,
    reason,
    field: trailerValue(metadata, FIELD_KEY, rich),
    errorId: trailerValue(metadata, ERROR_ID_KEY, rich),
    metadata,
    cause: serviceError,
  });
}

/**
 * Whether a call()'s Reserve that failed this way is sent again while the
 * call's deadline has time left: a retryable error whose time is not spent
 * (not DEADLINE_EXCEEDED), as `resend_reserve` in clients/cases/errors.json says.
 */
function resendsReserve(error) {
  return error instanceof LedgerError && error.retryable && error.code !== Status.DEADLINE_EXCEEDED;
}

/**
 * Whether a call()'s Settle SUCCEEDED refused this way is settled UNKNOWN at
 * once: the ledger refused its usage (an InvalidArgument: more output than the
 * max, no input tokens, ...), so the paid call's real cost cannot be booked
 * from it, and left open the booking would expire at the lane's
 * expire_charge, maybe zero. `settle_unknown_after_refusal` in
 * clients/cases/errors.json.
 */
function settlesUnknownAfterRefusal(error) {
  return error instanceof InvalidArgument;
}

module.exports = {
  ERROR_TABLE,
  resendsReserve,
  settlesUnknownAfterRefusal,
  errorClassOf,
  ledgerErrorOf,
  richErrorInfo,
  isLedgerUnavailable,
  ClientClosed,
  LedgerError,
  Refusal,
  InvalidArgument,
  TtlExceedsHoldTtl,
  UnknownModel,
  SettleWithoutUsage,
  OutputExceedsMaxTokens,
  ChargeExceedsCapMultiple,
  SumOutOfRange,
  RequestTooLarge,
  TlsMismatch,
  NotFound,
  LaneNotFound,
  BookingNotFound,
  AlreadyExists,
  ReservationIdReused,
  CorrectionIdReused,
  FailedPrecondition,
  BookingAlreadyEnded,
  BookingWasDenied,
  BookingStillOpen,
  ResourceExhausted,
  TooManyWatchers,
  TooManyReconciles,
  TooManyCalls,
  Unauthenticated,
  PermissionDenied,
  Unimplemented,
  Unavailable,
  StoreUnavailable,
  StoreDamaged,
  DeadlineExceeded,
  Cancelled,
  InternalError,
};
