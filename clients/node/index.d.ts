// Types of the lane ledger's Node client. Every int64 of the wire is a bigint.

import type { ServiceClientConstructor, status, Metadata, ChannelOptions } from '@grpc/grpc-js';
import type { PackageDefinition } from '@grpc/proto-loader';

/** An integer for the wire: a bigint, a safe-integer number or a decimal string. */
export type Int64Input = bigint | number | string;

export interface TlsOptions {
  /** PEM root certificates; the system's roots when left out. */
  rootCerts?: string | Buffer;
  /** PEM client certificate chain, for mutual TLS. */
  clientCert?: string | Buffer;
  /** PEM private key of clientCert. */
  clientKey?: string | Buffer;
  /** The name the server's certificate is checked against, when not the address's host. */
  serverName?: string;
}

export interface LaneClientOptions {
  /** Sent as `authorization: Bearer <grant>` on every call; a function is called per call. */
  grant?: string | (() => string | Promise<string>);
  /** true: TLS with the system's roots. Left out: plaintext. */
  tls?: boolean | TlsOptions;
  /** Deadline of each ledger call; default 250 ms (see README, "Deadlines"). */
  deadlineMs?: number;
  /** Attempts at an unconfirmed Settle or Refund in call(); default 3. */
  endAttempts?: number;
  /** Extra @grpc/grpc-js channel options. */
  channelOptions?: ChannelOptions;
}

/**
 * W3C trace context for one ledger call (see README, "Tracing"). A valid
 * `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`, lowercase, ids not all zeros)
 * is sent as gRPC metadata and wins over the active OpenTelemetry context; an
 * invalid one is ignored, never sent. `tracestate` goes only with a valid
 * traceparent of its own. With neither, `call()` starts a trace of its own
 * and sends it with both its Reserve and its Settle or Refund.
 */
export interface TraceOptions {
  traceparent?: string;
  tracestate?: string;
}

export interface Balance {
  lane: string;
  limitNanos: bigint;
  spentNanos: bigint;
  heldNanos: bigint;
  chargedNanos: bigint;
  availableNanos: bigint;
  overrunNanos: bigint;
  openBookings: bigint;
  windowSeconds: number | null;
  asOf: Date | null;
}

export interface ReserveRequest extends TraceOptions {
  reservationId: string;
  model: string;
  requestBytes: Int64Input;
  maxOutputTokens: Int64Input;
  estimateNanos?: Int64Input;
  /** At most the lane's hold_ttl. */
  ttlMs?: number;
}

export type DenialReason = 'BUDGET_EXHAUSTED' | 'HOLD_EXCEEDS_LIMIT';

export interface ReserveResult {
  reservationId: string;
  admitted: boolean;
  decision: 'ADMITTED' | 'DENIED';
  holdNanos: bigint;
  capNanos: bigint;
  reservedAt: Date | null;
  expiresAt: Date | null;
  /** Denied for budget: when enough of the window ages out (rounded up to the ms). */
  retryAfter: Date | null;
  denialReason: DenialReason | null;
  reason: string;
  balance: Balance | null;
}

export interface SettleRequest extends TraceOptions {
  reservationId: string;
  outcome: 'SUCCEEDED' | 'UNKNOWN';
  /** Every input token of the call, the cached and cache-write ones included. */
  inputTokens?: Int64Input;
  /** Every output token, reasoning tokens included; at most the booking's maxOutputTokens. */
  outputTokens?: Int64Input;
  billedNanos?: Int64Input;
  httpStatus?: number;
  /** The part of inputTokens read from the provider's prompt cache. */
  cachedInputTokens?: Int64Input;
  /** The part of inputTokens written to the provider's prompt cache. */
  cacheWriteTokens?: Int64Input;
}

export type BookingState =
  | 'OPEN'
  | 'SETTLED'
  | 'SETTLED_UNKNOWN'
  | 'REFUNDED'
  | 'EXPIRED'
  | 'REJECTED'
  | 'RECONCILED'
  | 'CORRECTED';

export interface SettleResult {
  chargedNanos: bigint;
  state: BookingState;
  balance: Balance | null;
}

export interface RefundRequest extends TraceOptions {
  reservationId: string;
  /** The provider's 4xx, or 0 when the call was never sent (then reason is required). */
  httpStatus?: number;
  reason?: string;
}

export interface Booking {
  lane: string;
  reservationId: string;
  model: string;
  state: BookingState;
  requestBytes: bigint;
  maxOutputTokens: bigint;
  holdNanos: bigint;
  capNanos: bigint;
  amountNanos: bigint;
  reservedAt: Date | null;
  expiresAt: Date | null;
  agesOutAt: Date | null;
}

/** The trace context, when given, is the one of the Reserve and of the Settle or Refund alike. */
export interface CallRequest extends TraceOptions {
  model: string;
  requestBytes: Int64Input;
  maxOutputTokens: Int64Input;
  estimateNanos?: Int64Input;
  ttlMs?: number;
}

/**
 * What the provider reported. inputTokens counts EVERY input token; the cached
 * (read from the prompt cache) and cache-write ones are parts of it, so
 * cachedInputTokens + cacheWriteTokens <= inputTokens. outputTokens counts
 * every output token, reasoning tokens included. usageOf() reads a provider's
 * body this way.
 */
export interface Usage {
  inputTokens?: Int64Input;
  outputTokens?: Int64Input;
  billedNanos?: Int64Input;
  cachedInputTokens?: Int64Input;
  cacheWriteTokens?: Int64Input;
}

/** A provider's usage as usageOf() reads it: every count a BigInt, by the ledger's convention. */
export interface ProviderUsage {
  inputTokens: bigint;
  outputTokens: bigint;
  cachedInputTokens: bigint;
  cacheWriteTokens: bigint;
}

/**
 * The usage of a provider's parsed response body (or of its `usage` object),
 * OpenAI-style (`prompt_tokens`, which already counts the cached ones) or
 * Anthropic-style (`input_tokens`, which excludes the cache: the cache reads and
 * writes are added). null when the body reports no usage or no input token.
 * Throws TypeError or RangeError for a count that is not a non-negative integer.
 */
export function usageOf(body: unknown): ProviderUsage | null;

/** What the callback of call() says about its model call. */
export interface CallReport {
  /** The provider's HTTP status; 0 or left out when there was none. */
  httpStatus?: number;
  usage?: Usage;
  billedNanos?: Int64Input;
  timedOut?: boolean;
  connectionLost?: boolean;
  /** The call was never sent: refunded. */
  notSent?: boolean;
  /** For the audit (a refund's reason). */
  reason?: string;
  [extra: string]: unknown;
}

export type Ending = 'SUCCEEDED' | 'REFUND' | 'UNKNOWN';
export const Ending: Readonly<{ SUCCEEDED: 'SUCCEEDED'; REFUND: 'REFUND'; UNKNOWN: 'UNKNOWN' }>;

export interface OutcomeReport {
  httpStatus: number;
  usage: {
    inputTokens: Int64Input;
    outputTokens: Int64Input;
    billedNanos: Int64Input | null;
    cachedInputTokens: Int64Input;
    cacheWriteTokens: Int64Input;
  } | null;
  timedOut: boolean;
  connectionLost: boolean;
  notSent: boolean;
  thrown: boolean;
  reason: string;
}

export const OUTCOME_TABLE: ReadonlyArray<{ when: string; matches: (report: OutcomeReport) => boolean; ending: Ending }>;
/** The move for a report: the first matching row of OUTCOME_TABLE and what goes on the wire. */
export function endingOf(report: OutcomeReport): {
  ending: Ending;
  when: string;
  httpStatus: number;
  usage: OutcomeReport['usage'];
  reason: string;
};
/** Throw it from a call() callback when the request never left the lane: the booking is refunded. */
export class CallNotSent extends Error {
  constructor(reason: string);
  reason: string;
}
/** Marks an error thrown by a call() callback as "never sent", like CallNotSent. */
export function markNotSent<E extends Error>(error: E): E;

export class Denied {
  readonly admitted: false;
  reservationId: string;
  reason: DenialReason;
  message: string;
  retryAfter: Date | null;
  holdNanos: bigint;
  capNanos: bigint;
  balance: Balance | null;
}

export class Completed<R = CallReport> {
  readonly admitted: true;
  reservationId: string;
  ending: Ending;
  /** What the callback returned. */
  value: R;
  holdNanos: bigint;
  /** null when the ledger could not be told (see ledgerError). */
  chargedNanos: bigint | null;
  balance: Balance | null;
  ledgerError: LedgerError | null;
}

export const DEFAULT_DEADLINE_MS: number;
export const DEFAULT_END_ATTEMPTS: number;

export class LaneClient {
  constructor(address: string, lane: string, options?: LaneClientOptions);
  readonly address: string;
  readonly lane: string;
  readonly deadlineMs: number;
  readonly endAttempts: number;
  waitForReady(timeoutMs?: number): Promise<void>;
  close(): void;
  reserve(request: ReserveRequest): Promise<ReserveResult>;
  settle(request: SettleRequest): Promise<SettleResult>;
  refund(request: RefundRequest): Promise<{ balance: Balance | null }>;
  balance(options?: TraceOptions): Promise<Balance>;
  booking(reservationId: string, options?: TraceOptions): Promise<Booking>;
  call<R extends CallReport>(
    request: CallRequest,
    fn: (booking: ReserveResult) => Promise<R> | R,
  ): Promise<Denied | Completed<R>>;
}

export function ledgerPackage(): {
  Ledger: ServiceClientConstructor;
  LaneAdmin: ServiceClientConstructor;
  TestClock: ServiceClientConstructor;
  definition: PackageDefinition;
};

export class LedgerError extends Error {
  static readonly retryable: boolean;
  static readonly mayHaveApplied: boolean;
  readonly retryable: boolean;
  readonly mayHaveApplied: boolean;
  code: status | number;
  reason: string;
  field: string;
  errorId: string;
  metadata: Metadata | null;
}
export class Refusal extends LedgerError {}
export class InvalidArgument extends Refusal {}
export class TtlExceedsHoldTtl extends InvalidArgument {}
export class UnknownModel extends InvalidArgument {}
/** A SUCCEEDED settle with no input tokens and no billed amount (field input_tokens). */
export class SettleWithoutUsage extends InvalidArgument {}
/** More output tokens than the booking's maxOutputTokens (field output_tokens). */
export class OutputExceedsMaxTokens extends InvalidArgument {}
/** A SUCCEEDED charge above the lane's max_charge_multiple times the cap (field billed_nanos or input_tokens). */
export class ChargeExceedsCapMultiple extends InvalidArgument {}
/** The amount would take a window's sum past 2^62 nanos. */
export class SumOutOfRange extends InvalidArgument {}
export class NotFound extends Refusal {}
export class LaneNotFound extends NotFound {}
export class BookingNotFound extends NotFound {}
export class AlreadyExists extends Refusal {}
export class ReservationIdReused extends AlreadyExists {}
/** The correction id was used before with other content. */
export class CorrectionIdReused extends AlreadyExists {}
export class FailedPrecondition extends Refusal {}
export class BookingAlreadyEnded extends FailedPrecondition {}
export class BookingWasDenied extends FailedPrecondition {}
/** A correction of a booking that is still open. */
export class BookingStillOpen extends FailedPrecondition {}
export class ResourceExhausted extends Refusal {}
export class TooManyWatchers extends ResourceExhausted {}
export class Unauthenticated extends Refusal {}
export class PermissionDenied extends Refusal {}
export class Unimplemented extends Refusal {}
export class Unavailable extends LedgerError {}
export class StoreUnavailable extends Unavailable {}
export class DeadlineExceeded extends LedgerError {}
export class Cancelled extends LedgerError {}
export class InternalError extends LedgerError {}

export const ERROR_TABLE: ReadonlyArray<readonly [status, string | null, typeof LedgerError]>;
export function errorClassOf(code: number, reason: string): typeof LedgerError;
export function ledgerErrorOf(serviceError: import('@grpc/grpc-js').ServiceError): LedgerError;
