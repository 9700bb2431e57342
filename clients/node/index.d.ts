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
  /** Sent as `authorization: Bearer <grant>` on every call; a function is called per call. 1 to 4,096 visible ASCII characters without spaces (the longest grant the ledger takes), or a TypeError that never quotes it (from a function, a GrantError; one that throws or rejects: a GrantError whose `cause` is what it threw). */
  grant?: string | (() => string | Promise<string>);
  /** true: TLS with the system's roots. Left out: plaintext. */
  tls?: boolean | TlsOptions;
  /** Deadline of each ledger call; default 250 ms (see README, "Deadlines"). A unary call's own deadlineMs (DeadlineOptions) wins over it. */
  deadlineMs?: number;
  /** Attempts at an unconfirmed Settle or Refund in call(), and at its unanswered Reserve (all within one deadlineMs); default 3. */
  endAttempts?: number;
  /** Calls this client has at the ledger at once; one more waits for a slot until its deadline, then rejects with ResourceExhausted (the outage mode). Default 64, 1 to 10,000. */
  maxCallsInFlight?: number;
  /** Extra @grpc/grpc-js channel options. */
  channelOptions?: ChannelOptions;
  /** What call() does while the ledger cannot be reached; default OutagePolicy.deny() (see README, "When the ledger cannot be reached"). */
  outage?: OutagePolicy;
  /** How often the background replayer looks at the journal; default 5000 ms, at most 3,600,000; null: never (call replayJournal()). */
  replayIntervalMs?: number | null;
  /** Deadline of each RPC of the replay; default 2000 ms, at most 60,000. */
  replayDeadlineMs?: number;
  /** Entries one replay attempt handles at most; default 100, between 1 and 10,000. */
  maxReplayEntriesPerAttempt?: number;
  /** Time one replay attempt runs at most; default 10,000 ms, at most 600,000. */
  maxReplayMsPerAttempt?: number;
  /** The journal takes no new call past this size; default 16 MiB, at most 1 GiB. */
  maxJournalBytes?: number;
  /** A fully replayed journal at least this large is moved aside; default 1 MiB, at most maxJournalBytes. */
  rotateJournalBytes?: number;
  /** Where the outage mode's warnings go (a denied replay, a refused one, a journal that failed); default console, null: nowhere. */
  logger?: { warn(message: string): void; error(message: string): void } | null;
  /** How long a tail (watchEvents) whose stream dropped goes on opening another, without one that answers, before it throws the last error; default 30,000 ms, 0 (never) to 3,600,000. */
  watchResumeMs?: number;
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

/**
 * A ledger call's own deadline, in place of the client's `deadlineMs` (the
 * Python client's `deadline_seconds=`). Left out (or null): the client's. A
 * number of milliseconds in (0, 60,000], else InvalidArgument (field
 * `deadlineMs`) before any call.
 */
export interface DeadlineOptions {
  deadlineMs?: number | null;
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

export interface ReserveRequest extends TraceOptions, DeadlineOptions {
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
  /**
   * When denied: the budget that said no, this lane or one of its parents (a
   * lane's name; a lane's parent is set by the operator). "" when admitted.
   */
  deniedBy: string;
  /**
   * True when an earlier Reserve under this id made the booking (or denial)
   * and this is its first answer repeated: this Reserve booked nothing.
   * call() refuses to run its model call under such an answer unless it sent
   * that earlier Reserve itself for no model call (ReservationIdReused).
   */
  alreadyReserved: boolean;
  reason: string;
  balance: Balance | null;
}

export interface SettleRequest extends TraceOptions, DeadlineOptions {
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

export interface RefundRequest extends TraceOptions, DeadlineOptions {
  reservationId: string;
  /** The provider's 4xx, or 0 when the call was never sent (then reason is required). */
  httpStatus?: number;
  /** Printable text of at most 1,000 characters, sent as written (InvalidArgument otherwise). */
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
  /** The booking's id, for a lane that tags its provider request with it first; left out, a fresh one (32 hex digits). */
  reservationId?: string;
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

/**
 * A model's price in nanos per million tokens. An unset (undefined or null)
 * cache rate costs the input rate, as on the ledger.
 */
export interface ModelPrice {
  inputNanosPerMillionTokens: bigint;
  outputNanosPerMillionTokens: bigint;
  /** Input tokens read from the provider's prompt cache. */
  cachedInputNanosPerMillionTokens?: bigint | null;
  /** Input tokens written to the provider's prompt cache. */
  cacheWriteNanosPerMillionTokens?: bigint | null;
}

/** 3.5 bytes per token, in thousandths: 3500n. */
export const DEFAULT_BYTES_PER_TOKEN_MILLI: bigint;

/**
 * Pessimistic tokens of a request: ceil(requestBytes * 1000 / bytesPerTokenMilli) + overheadTokens.
 * Throws TypeError for a non-bigint, RangeError for a negative value or bytesPerTokenMilli 0n.
 */
export function requestTokens(requestBytes: bigint, bytesPerTokenMilli: bigint, overheadTokens: bigint): bigint;

/**
 * The ledger's byte cap, computed locally with its formula and rounding (every
 * division rounds up): every request token at the dearest input rate (the
 * largest of input, cached and cache-write), plus maxOutputTokens at the output rate.
 */
export function capNanos(
  price: ModelPrice,
  requestBytes: bigint,
  maxOutputTokens: bigint,
  bytesPerTokenMilli: bigint,
  overheadTokens: bigint,
): bigint;

/**
 * The real cost of a usage as the ledger books it: each kind of token at its
 * own rate, each part rounded up. cachedInputTokens and cacheWriteTokens are
 * parts of inputTokens (missing ones count 0n); a RangeError when they exceed it.
 */
export function realCostNanos(
  price: ModelPrice,
  usage: { inputTokens: bigint; outputTokens: bigint; cachedInputTokens?: bigint; cacheWriteTokens?: bigint },
): bigint;

/**
 * Context budgeting (see README, "Context budgeting"): the same rules and answers
 * as the Python client's ledger_client.context. Token and byte counts are
 * integer Numbers, exact below 2^53; a count that would pass it is a RangeError.
 */
export interface ContextBudgetOptions {
  /** The served model's window (vLLM's --max-model-len); default 16384, at most 10**9. */
  maxContextTokens?: number;
  /** Withheld from the input for the reply; default 2048, less than maxContextTokens. */
  reserveOutputTokens?: number;
  /** Bytes per token in thousandths; default 3500 (3.5), between 100 and 64000. */
  bytesPerTokenMilli?: number;
  /** A result is never cut below this; default 1024, between 256 and 10**8. */
  minToolResultBytes?: number;
  /** Rounds of cutting at most; default 64, between 1 and 10000. */
  maxIterations?: number;
}

/** Frozen. Throws TypeError for an unknown option or a non-integer, RangeError out of bounds. */
export class ContextBudget {
  constructor(options?: ContextBudgetOptions);
  readonly maxContextTokens: number;
  readonly reserveOutputTokens: number;
  readonly bytesPerTokenMilli: number;
  readonly minToolResultBytes: number;
  readonly maxIterations: number;
  /** maxContextTokens - reserveOutputTokens. */
  readonly inputBudgetTokens: number;
  /** See estimateTokens. */
  tokens(payload: unknown): number;
}

export interface ContextFit {
  fits: boolean;
  /** The tool results to send, in their original order; trimmed ones carry a marker. */
  toolResults: readonly string[];
  /** Indexes of the trimmed results. */
  trimmed: readonly number[];
  /** Estimated input tokens: messages + tool schemas + results. */
  inputTokens: number;
  budgetTokens: number;
  /** Rounds of cutting done, at most the budget's maxIterations. */
  iterations: number;
}

/** ceil(byteCount / bytesPerToken), in integers; bytesPerTokenMilli defaults to 3500. */
export function tokensOfBytes(byteCount: number, bytesPerTokenMilli?: number): number;
/**
 * A pessimistic token count from UTF-8 bytes: a string's UTF-8, a Uint8Array's
 * bytes, and any other value (a message object, an array of them, a tool
 * schema, a number, a boolean, null) its JSON's, JSON.stringify(value) in
 * UTF-8 (the Python client measures its compact json.dumps alike). Text with a
 * lone surrogate, and a value JSON cannot carry (undefined, a function, a
 * BigInt, a cycle), is a TypeError.
 */
export function estimateTokens(payload: unknown, bytesPerTokenMilli?: number): number;
/** The marker a trimmed result ends with. */
export function truncationMarker(removedBytes: number, originalBytes: number): string;
/**
 * Fits tool results into what the window leaves after the messages, the tool
 * schemas and the output reserve: largest first, never below the floor, at
 * most maxIterations rounds. At most 1000 results (RangeError).
 */
export function fitToolResults(
  toolResults: readonly string[],
  options?: {
    budget?: ContextBudget | ContextBudgetOptions;
    /** Each measured as estimateTokens does: a string, bytes, or any value as its JSON. */
    messages?: ReadonlyArray<unknown>;
    toolSchemas?: ReadonlyArray<unknown>;
  },
): ContextFit;
/**
 * Whether a provider refused a request (HTTP 400 or 413) for not fitting its
 * context window, from the error's code, or its type and message. The body is
 * the parsed object, its text or its bytes (strict UTF-8 JSON, at most 64 KiB).
 */
export function isContextOverflow(
  httpStatus: number,
  body: object | string | Uint8Array | ArrayBuffer | null | undefined,
): boolean;
/** The constant sentence to answer an overflow with, instead of the provider's text. */
export const CONTEXT_OVERFLOW_REPLY: string;

/** What the callback of call() says about its model call. */
export interface CallReport {
  /** The provider's HTTP status; 0 or left out when there was none. */
  httpStatus?: number;
  /** null or left out: no usage (usageOf() gives null for a body without one). */
  usage?: Usage | null;
  billedNanos?: Int64Input | null;
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
  /** The callback resolved with undefined or null: nothing reported, settled UNKNOWN. */
  nothingReported?: boolean;
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
/**
 * Marks an error thrown by a call() callback as "never sent", like CallNotSent.
 * `reason`, when given, is the refund's reason (it goes to the ledger's audit:
 * no secrets, no provider text); the error's message is never read.
 */
export function markNotSent<E extends Error>(error: E, reason?: string): E;

/** The ledger's reasons, and the outage mode's: unreachable and failing closed, or the allowance spent. */
export type CallDenialReason = DenialReason | 'LEDGER_UNAVAILABLE' | 'ALLOWANCE_EXHAUSTED';

export class Denied {
  readonly admitted: false;
  reservationId: string;
  reason: CallDenialReason;
  /**
   * The budget that said no: this lane or one of its parents (a lane's name).
   * "" for LEDGER_UNAVAILABLE and ALLOWANCE_EXHAUSTED (no budget was asked).
   */
  deniedBy: string;
  message: string;
  retryAfter: Date | null;
  holdNanos: bigint;
  capNanos: bigint;
  balance: Balance | null;
  /** For LEDGER_UNAVAILABLE and ALLOWANCE_EXHAUSTED: the error that said the ledger is unreachable. */
  ledgerError: LedgerError | null;
}

/** Who admitted a call of call(): the ledger, or the outage allowance while the ledger was unreachable. */
export type CallSource = 'ledger' | 'allowance';
export const CallSource: Readonly<{ LEDGER: 'ledger'; ALLOWANCE: 'allowance' }>;

/**
 * What call() hands its callback. On the allowance: holdNanos and capNanos
 * are the local byte cap, and reservedAt, expiresAt and balance are null.
 */
export interface CallBooking extends ReserveResult {
  source: CallSource;
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
  /** Why the ledger was not told: its error, or on the allowance the one that made the ledger unreachable. */
  ledgerError: LedgerError | null;
  source: CallSource;
  /** Whether the call (or its ending) waits in the journal for the replay. */
  journaled: boolean;
}

/** After close()'s grace, the journal stays open this long at most for the call()s cut off to journal their endings: 1000 ms. */
export const CLOSE_JOURNAL_WAIT_MS: number;
/** How long close() waits for the calls under way by default: 5000 ms. */
export const DEFAULT_CLOSE_GRACE_MS: number;
export const DEFAULT_DEADLINE_MS: number;
export const DEFAULT_END_ATTEMPTS: number;
/** Attempts in all of the background refund of an unanswered Reserve: 4. */
export const UNANSWERED_REFUND_ATTEMPTS: number;
/** The pause before the background refund's attempt n+1 is n times this: 250 ms. */
export const UNANSWERED_REFUND_PAUSE_MS: number;
/** A page of events when none is asked for: 100 (the server's default_page_size). */
export const DEFAULT_PAGE_SIZE: number;
/** The most events a page holds: 1,000 (the server's max_page_size); a larger pageSize is InvalidArgument (field `page_size`) before any call. */
export const MAX_PAGE_SIZE: number;

/**
 * A lane's policy as a lane_configured event carries it (the proto's Lane),
 * with the defaults the ledger resolved. The optional settings are null when
 * the wire leaves them out, which the ledger never does.
 */
export interface LanePolicy {
  lane: string;
  limitNanos: bigint;
  windowSeconds: number | null;
  holdTtlSeconds: number | null;
  /** Bytes per token in thousandths (3.5 is 3500n), as the ledger keeps it. */
  bytesPerTokenMilli: bigint | null;
  overheadTokens: bigint | null;
  /** Per model; a cache rate the lane did not set is null (it costs the input rate). */
  prices: ReadonlyMap<string, ModelPrice>;
  /** What an expired booking is charged; '' when unset. */
  expireCharge: 'HOLD' | 'ZERO' | '';
  /** The seq of the lane_configured event that set this policy. */
  version: bigint;
  updatedAt: Date | null;
  /** The parent budget (another lane); '' when none. */
  parent: string;
  /** A SUCCEEDED charge above this multiple of the cap is refused; 0n: no bound. */
  maxChargeMultiple: bigint | null;
}

/**
 * One immutable fact of the lane's log (the proto's Event). Every int64 a
 * BigInt; instants Dates, null where the event has none.
 */
export interface LedgerEvent {
  /** The server's sequence number: unique and rising, possibly with holes. */
  seq: bigint;
  lane: string;
  /** One of the server's event kinds (ledger_service/domain/events.py EventKind), no other. */
  kind: 'reserved' | 'denied' | 'settled' | 'refunded' | 'expired' | 'lane_configured' | 'reconciled' | 'corrected';
  reservationId: string;
  /** What the booking counts in its window after this event, and before it. */
  amountNanos: bigint;
  previousAmountNanos: bigint;
  occurredAt: Date;
  /** For a settlement; '' otherwise. */
  outcome: 'SUCCEEDED' | 'UNKNOWN' | '';
  httpStatus: bigint;
  model: string;
  requestBytes: bigint;
  maxOutputTokens: bigint;
  inputTokens: bigint;
  outputTokens: bigint;
  cachedInputTokens: bigint;
  cacheWriteTokens: bigint;
  billedNanos: bigint | null;
  estimateNanos: bigint | null;
  holdNanos: bigint;
  capNanos: bigint;
  reservedAt: Date | null;
  expiresAt: Date | null;
  retryAfter: Date | null;
  /** For a denial; null otherwise. */
  denialReason: DenialReason | null;
  /** For a denial: the budget that said no (this lane or a parent). */
  deniedBy: string;
  reason: string;
  traceId: string;
  /** The lane's spent and limit right after this event. */
  spentAfterNanos: bigint;
  limitNanos: bigint;
  correctionId: string;
  grantId: string;
  /** Tamper evidence: this event's hash, chained to the lane's previous one. */
  hash: string;
  previousHash: string;
  /** For lane_configured: the lane's new policy; null for the other kinds. */
  policy: LanePolicy | null;
}

export interface EventPageOptions extends DeadlineOptions {
  /** Only events after this seq; default 0 (the start of the log). */
  afterSeq?: Int64Input;
  /** 1 to MAX_PAGE_SIZE; default DEFAULT_PAGE_SIZE. */
  pageSize?: number;
}

/** deadlineMs: the time each of the tail's streams has to be accepted (default: the client's). */
export interface WatchOptions extends DeadlineOptions {
  /** Only events after this seq; default 0 (the start of the log). */
  afterSeq?: Int64Input;
}

export interface EventPage {
  /** Oldest first. */
  events: LedgerEvent[];
  /** The afterSeq of the next page; null when the log has no more events right now. */
  nextAfterSeq: bigint | null;
}

export class LaneClient {
  /** Throws InvalidArgument (field `lane`) for a lane name the ledger refuses: 1 to 200 characters of ASCII, a letter or digit first, then letters, digits and `._:/@+-`. */
  constructor(address: string, lane: string, options?: LaneClientOptions);
  readonly address: string;
  readonly lane: string;
  readonly deadlineMs: number;
  readonly endAttempts: number;
  readonly maxCallsInFlight: number;
  readonly watchResumeMs: number;
  readonly outage: OutagePolicy;
  /** The outage journal, or null without one. */
  readonly journal: Journal | null;
  /** Where the client's warnings go (the `logger` option; null: nowhere). */
  readonly logger: { warn(message: string): void; error(message: string): void } | null;
  /** Resolves once connected; rejects with Unavailable when the ledger is not reached within timeoutMs (default 5000). */
  waitForReady(timeoutMs?: number): Promise<void>;
  /** Refuses new calls at once (every method then rejects with ClientClosed), stops the replayer, waits up to graceMs (DEFAULT_CLOSE_GRACE_MS) for the calls under way (call()s with their endings, other ledger calls, background refunds), then closes the channel, cancelling what is left (ClientClosed, mayHaveApplied true), then the journal (its lock released) once the calls cut off have journaled their endings, at most CLOSE_JOURNAL_WAIT_MS later. Awaited inside a call() callback, it does not wait for that call: the channel closes once that call has ended its booking. Never rejects; throws RangeError for a graceMs outside [0, 60000]. */
  close(options?: { graceMs?: number }): Promise<void>;
  /** What is spent of the outage allowance; null without an allowance. */
  allowanceUsed(): { nanos: bigint; calls: number } | null;
  /** One bounded replay attempt of the journal, now. */
  replayJournal(options?: { maxEntries?: number }): Promise<ReplayReport>;
  /** Rejects with InvalidArgument, before any call, for an argument the ledger would refuse (README, "Amounts"). */
  reserve(request: ReserveRequest): Promise<ReserveResult>;
  settle(request: SettleRequest): Promise<SettleResult>;
  refund(request: RefundRequest): Promise<{ balance: Balance | null }>;
  balance(options?: TraceOptions & DeadlineOptions): Promise<Balance>;
  booking(reservationId: string, options?: TraceOptions & DeadlineOptions): Promise<Booking>;
  /** One page of the lane's events (needs a grant with `read` on the lane). InvalidArgument (field `page_size`, `after_seq` or `deadlineMs`) before any call for a pageSize outside 1 to MAX_PAGE_SIZE, a negative afterSeq or a bad deadlineMs. */
  listEvents(options?: EventPageOptions): Promise<EventPage>;
  /** Every event after afterSeq, a listEvents page at a time as the caller iterates, to the log's end as it stands then; each page has its own deadlineMs. Throws InvalidArgument as listEvents, at once. */
  allEvents(options?: EventPageOptions): AsyncGenerator<LedgerEvent, void, undefined>;
  /** The lane's events after afterSeq, then each new one as it is committed; a dropped stream is opened again after the last event seen (for up to watchResumeMs), so none is skipped or repeated. Leave the loop (or call return()) to stop it; close() ends it too (done, no error). */
  watchEvents(options?: WatchOptions): AsyncGenerator<LedgerEvent, void, undefined>;
  /**
   * A callback that resolves with nothing (undefined or null) reports no
   * outcome: its booking is settled UNKNOWN, at its hold, with a warning.
   */
  call<R extends CallReport | undefined | null | void>(
    request: CallRequest,
    fn: (booking: CallBooking) => Promise<R> | R,
  ): Promise<Denied | Completed<R>>;
}

// The outage mode --------------------------------------------------------------

export type OutageMode = 'deny' | 'allowance';
export const OutageMode: Readonly<{ DENY: 'deny'; ALLOWANCE: 'allowance' }>;
/** maxCalls of an allowance is at most this: 100,000. */
export const MAX_ALLOWANCE_CALLS: number;

export interface AllowanceOptions {
  /** At most this much, in nanos, of calls the ledger has not booked: 1 to 2^62. */
  maxNanos: Int64Input;
  /** At most this many such calls: 1 to MAX_ALLOWANCE_CALLS. */
  maxCalls: number;
  /** The journal (JSON lines, fsync'd); its directory is created. */
  journalPath: string;
  /** The lane's prices, copied: model -> price, an object or a Map (a lane_configured event's `policy.prices` as it is). Rates from 0 to 10^15 nanos per million tokens; a model name the ledger refuses is InvalidArgument (field `model`). */
  prices: Record<string, ModelPrice> | ReadonlyMap<string, ModelPrice>;
  /** Default 3500n (3.5 bytes per token), between 100n and 64000n: the lane's own setting. */
  bytesPerTokenMilli?: Int64Input;
  /** Default 0n, at most 10,000,000n: the lane's own setting. */
  overheadTokens?: Int64Input;
}

/** Frozen. Throws RangeError or TypeError for a limit out of bounds: there is no unbounded allowance. */
export class OutagePolicy {
  /** Fail closed. With a journal, unsent endings and unanswered Reserves still reach the ledger later. */
  static deny(journalPath?: string | null): OutagePolicy;
  static allowance(options: AllowanceOptions): OutagePolicy;
  readonly mode: OutageMode;
  readonly journalPath: string | null;
  readonly maxNanos: bigint;
  readonly maxCalls: number;
  readonly prices: ReadonlyMap<string, Readonly<ModelPrice>>;
  readonly bytesPerTokenMilli: bigint;
  readonly overheadTokens: bigint;
}

export interface ReplayReport {
  /** The ledger has the booking and its ending. */
  landed: number;
  /** Made on the allowance, then denied by the ledger: spent without a booking (logged). */
  denied: number;
  /** In-doubt Reserves the ledger never recorded. */
  absent: number;
  /** Refused for good; an operator must look at them (logged). */
  rejected: number;
  /** The ledger failed on them this time; left for the next attempt. */
  failed: number;
  /** Still in the journal after this attempt. */
  remaining: number;
  /** The ledger went away, or a limit of the attempt was hit. */
  stoppedEarly: boolean;
}

export type Source = 'allowance' | 'ledger' | 'in_doubt';
export const Source: Readonly<{ ALLOWANCE: 'allowance'; LEDGER: 'ledger'; IN_DOUBT: 'in_doubt' }>;
export type ReplayResult = 'landed' | 'denied' | 'absent' | 'rejected' | 'superseded';
export const ReplayResult: Readonly<{ LANDED: 'landed'; DENIED: 'denied'; ABSENT: 'absent'; REJECTED: 'rejected'; SUPERSEDED: 'superseded' }>;
export type Settlement = 'settle_succeeded' | 'settle_unknown' | 'refund';
export const Settlement: Readonly<{ SETTLE_SUCCEEDED: 'settle_succeeded'; SETTLE_UNKNOWN: 'settle_unknown'; REFUND: 'refund' }>;

/** A journaled call's Reserve arguments, as the replay sends them again. */
export interface JournaledArguments {
  reservationId: string;
  model: string;
  requestBytes: bigint;
  maxOutputTokens: bigint;
  estimateNanos: bigint | null;
  ttlUs: bigint | null;
}

export interface JournaledEnding {
  settlement: Settlement;
  httpStatus: number;
  usage: {
    inputTokens: bigint;
    outputTokens: bigint;
    billedNanos: bigint | null;
    cachedInputTokens: bigint;
    cacheWriteTokens: bigint;
  } | null;
  reason: string;
}

/** One call in the journal: the fold of its lines. */
export interface JournalEntry {
  readonly lane: string;
  readonly reservationId: string;
  readonly arguments: JournaledArguments;
  readonly source: Source;
  /** What the ledger would hold for it (allowance), or held (ledger); 0n in doubt. */
  readonly localHoldNanos: bigint;
  readonly writtenAt: string;
  readonly ending: JournaledEnding | null;
  /** What the lane thinks its ending costs (allowance entries). */
  readonly localChargeNanos: bigint;
  readonly replay: ReplayResult | null;
  readonly replayDetail: string;
  /** The W3C trace id of the model call; its replay joins the same trace. */
  readonly traceId: string;
}

/** The append-only, fsync'd journal of what the ledger has not heard yet (see README). */
export class Journal {
  /** Opens or creates it and takes its lock file; JournalLocked when another client (of this process or another) holds it. */
  constructor(path: string, lane: string, limits?: { maxBytes?: number; rotateBytes?: number });
  readonly path: string;
  readonly lane: string;
  readonly isOpen: boolean;
  /** Lines not read at start-up (a torn last line counts). */
  readonly skippedLines: number;
  /** Whether the file ended in a torn line at start-up (counted in skippedLines). */
  readonly tornLastLine: boolean;
  readonly sizeBytes: number;
  /** Entries the ledger has not acknowledged yet, oldest first. */
  pending(): JournalEntry[];
  entry(reservationId: string): JournalEntry | null;
  entries(): JournalEntry[];
  recordReserve(entry: JournalEntry): Promise<void>;
  recordEnd(reservationId: string, ending: JournaledEnding, localChargeNanos: bigint): Promise<void>;
  /** An unanswered Reserve and its refund, unless `limit` such entries are pending; whether journaled. */
  recordInDoubt(entry: JournalEntry, ending: JournaledEnding, limit: number): Promise<boolean>;
  recordReplay(reservationId: string, result: ReplayResult, detail?: string): Promise<void>;
  /** Moves a fully replayed journal of at least rotateBytes aside (<journal>.<stamp>.done); resolves with its path or null. */
  rotateIfReplayed(): Promise<string | null>;
  close(): Promise<void>;
}
/** The lane's grant function gave no grant (empty, null, a line break) or threw (`cause`: what it threw): the call was not sent. Its message never quotes a grant. */
export class GrantError extends TypeError {}
/** The journal cannot be used; a lane in outage then fails closed. */
export class JournalError extends Error {}
/** Past maxJournalBytes: no new call is journaled (endings still are). */
export class JournalFull extends JournalError {}
/** Another process, or another Journal of this one, holds the journal's lock. */
export class JournalLocked extends JournalError {}

/**
 * Whether an error says the ledger cannot be reached or answer now (UNAVAILABLE,
 * INTERNAL without the reason INTERNAL (the transport's: a stream reset),
 * DEADLINE_EXCEEDED, CANCELLED as a server shutdown gives, RESOURCE_EXHAUSTED
 * without a known reason): what switches call() to the outage mode.
 */
export function isLedgerUnavailable(error: unknown): boolean;

/**
 * Whether call() sends its Reserve again after this error while its deadline
 * has time left: a retryable error but DEADLINE_EXCEEDED, whose time is spent.
 */
export function resendsReserve(error: unknown): boolean;

/**
 * Whether call() settles a Settle SUCCEEDED refused this way UNKNOWN at once
 * (the ledger refused its usage: an InvalidArgument), rather than leave the
 * booking open to expire.
 */
export function settlesUnknownAfterRefusal(error: unknown): boolean;

/**
 * The wire's gRPC clients, for what LaneClient does not call (ListEvents,
 * WatchEvents, the test clock). Their messages keep the proto's snake_case
 * field names (`page_size`, not `pageSize`) and carry int64s as decimal
 * strings; send the grant yourself (`authorization: Bearer <grant>` metadata)
 * and turn an error into this package's classes with ledgerErrorOf().
 */
export function ledgerPackage(): {
  Ledger: ServiceClientConstructor;
  LaneAdmin: ServiceClientConstructor;
  TestClock: ServiceClientConstructor;
  definition: PackageDefinition;
};

/** A call on a client after close(), or one close() cancelled after its grace: the lane's own doing, not an outage. Not a LedgerError. */
export class ClientClosed extends Error {
  readonly mayHaveApplied: boolean;
}
export class LedgerError extends Error {
  static readonly retryable: boolean;
  static readonly mayHaveApplied: boolean;
  readonly retryable: boolean;
  readonly mayHaveApplied: boolean;
  /** The gRPC status code, a number (compare with `status` of @grpc/grpc-js). */
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
/** The ledger refused the request for its size (gRPC's bare RESOURCE_EXHAUSTED, "message larger than max"); field 'request'. */
export class RequestTooLarge extends InvalidArgument {}
/**
 * The `tls` option does not match the ledger: set for a ledger serving
 * plaintext, left out for one serving TLS, rootCerts or a name its certificate
 * does not carry, or a clientCert (or none) a mutual-TLS ledger refuses (see
 * README, "Errors"). Every retry meets it again: no retry, no outage.
 */
export class TlsMismatch extends Refusal {}
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
export class TooManyReconciles extends ResourceExhausted {}
/** This grant had its share of the server's calls running (max_calls_per_grant), or the server's calls were nearly all taken and it ran more than a few: slow down, send it again later. Not an outage. */
export class TooManyCalls extends ResourceExhausted {}
export class Unauthenticated extends Refusal {}
export class PermissionDenied extends Refusal {}
export class Unimplemented extends Refusal {}
/** UNAVAILABLE, or INTERNAL without the reason INTERNAL (the transport's, not the ledger's). */
export class Unavailable extends LedgerError {}
export class StoreUnavailable extends Unavailable {}
export class StoreDamaged extends Unavailable {}
export class DeadlineExceeded extends LedgerError {}
export class Cancelled extends LedgerError {}
/** The ledger's own INTERNAL (reason INTERNAL); `errorId` matches the server's log. */
export class InternalError extends LedgerError {}

export const ERROR_TABLE: ReadonlyArray<readonly [status, string | null, typeof LedgerError]>;
export function errorClassOf(code: number, reason: string): typeof LedgerError;
export function ledgerErrorOf(serviceError: import('@grpc/grpc-js').ServiceError): LedgerError;
/** The ledger's ErrorInfo in a call's trailers, by trailer name (`ledger-reason`, `ledger-field`, ...); `{}` when there is none. */
export function richErrorInfo(metadata: import('@grpc/grpc-js').Metadata | null | undefined): Record<string, string>;

/**
 * A fetch for the `openai` package (`new OpenAI({ fetch: ledgerFetch(lane) })`)
 * and `@anthropic-ai/sdk` (`new Anthropic({ fetch: ledgerFetch(lane) })`):
 * every create call (chat completions, responses, Anthropic's messages) is reserved from its body's
 * bytes and max tokens and ended by the outcome table; streams end their
 * booking when they end. A body that is not a JSON object is booked as it is
 * (its bytes, the model "unknown", the default bound). A usage the ledger
 * refuses is settled UNKNOWN at once, as call() settles it, with a warning to
 * the lane client's `logger`. A denial is a 402 APIError the SDK does not retry, its code
 * the denial reason. See README.md, "The openai package".
 */
export interface LedgerFetchOptions {
  fetch?: typeof fetch;
  maxOutputTokens?: number;
}

export function ledgerFetch(ledger: LaneClient, options?: LedgerFetchOptions): typeof fetch;
