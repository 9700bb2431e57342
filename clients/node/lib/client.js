'use strict';

const { randomBytes, X509Certificate } = require('node:crypto');
const net = require('node:net');
const nodeTls = require('node:tls');
const { AsyncLocalStorage } = require('node:async_hooks');
const grpc = require('@grpc/grpc-js');
const { ledgerPackage } = require('./proto');
const {
  ledgerErrorOf,
  ClientClosed,
  LedgerError,
  Unavailable,
  DeadlineExceeded,
  BookingNotFound,
  BookingWasDenied,
  BookingAlreadyEnded,
  ReservationIdReused,
  ResourceExhausted,
  isLedgerUnavailable,
  resendsReserve,
  settlesUnknownAfterRefusal,
  TlsMismatch,
} = require('./errors');
const wire = require('./wire');
const { checkGrant, checkLane, checkNames, kindOf, checkOutcome, checkReservationId, checkReserve, checkRefund, invalidArgument, newReservationId, GrantError } = require('./arguments');
const { Ending, endingOf, reportOf, reportOfError } = require('./outcomes');
const { traceHeaders, freshTraceHeaders, setTraceHeaders, traceIdOf } = require('./tracing');
const { Journal, Source, Settlement, ReplayResult, newEntry, checkJournalLimits, DEFAULT_MAX_JOURNAL_BYTES, DEFAULT_ROTATE_JOURNAL_BYTES } = require('./journal');
const { OutagePolicy, OutageMode, Allowance, DenialReason, CallSource, argumentsOf, isJournalTrouble } = require('./outage');
const { Replayer, replaySettingsOf, emptyReport, IN_DOUBT_REASON } = require('./replay');
const events = require('./events');

// Why 250 ms: in the recall budget jam (docs/semantics.md, "Why it exists")
// a 2.0 s step lost 0.8 s to grant and key lookups and 1.0 s to a retry
// reserve, which left the model call itself about 0.3 s. Ledger calls sit on
// that same path, so each one gets a short deadline and fails fast; the lane
// then falls back instead of starving its model call.
const DEFAULT_DEADLINE_MS = 250;
// Settle and Refund are idempotent, so an unconfirmed one is sent again with
// the same content; without this an ended call would expire at its hold.
const DEFAULT_END_ATTEMPTS = 3;
const END_RETRY_PAUSE_MS = 20;
// A call()'s Reserve whose answer was lost (a retryable error) is sent again by
// the same rule, but only with at least this much of its deadline left: less
// could not carry an answer back. The Python client's MIN_RESEND_SECONDS.
const MIN_RESEND_MS = 5;
// In-doubt Reserves journaled for a later refund, at most (beyond: refunded
// in the background, as without a journal).
const MAX_IN_DOUBT_ENTRIES = 1000;
// Refunds of unanswered Reserves sent in the background without a journal, at
// most this many at a time (beyond: the hold expires under expire_charge).
const MAX_BACKGROUND_REFUNDS = 100;
// More of them wait for a turn, at most this many (beyond: the hold expires):
// the flood that costs many Reserves their answers at once is when they come.
const MAX_PENDING_REFUNDS = 1000;
// Ids whose background refund ended (or may have ended) their booking, kept so
// that a Reserve under one is refused rather than admitted: the latest this many.
const MAX_ENDED_IDS = 1000;
// A background refund that got no answer (its deadline passed, the ledger
// overloaded by the very flood that cost the Reserve its answer) is sent again
// under the same id (idempotent), each time with a fresh deadline, up to this
// many attempts in all, pausing UNANSWERED_REFUND_PAUSE_MS times the attempt
// number between them, so the flood can pass; then the hold expires. The
// Python client's UNANSWERED_REFUND_ATTEMPTS and UNANSWERED_REFUND_PAUSE_SECONDS.
const UNANSWERED_REFUND_ATTEMPTS = 4;
const UNANSWERED_REFUND_PAUSE_MS = 250;
const UNANSWERED_REASON = 'not sent: the Reserve went unanswered';
// A reservation id's and a model name's most characters, as the ledger takes them.
const SUPERSEDED_DETAIL = 'reserved again under its id and admitted: the call that followed ends it';
const MAX_DEADLINE_MS = 60_000;
const DEADLINE_RULE = `must be a number of milliseconds in (0, ${MAX_DEADLINE_MS}]`;
const MAX_END_ATTEMPTS = 10;
// Calls a client has at the ledger at once; one more waits for a slot until its
// deadline, then fails as an overloaded ledger does (ResourceExhausted, the
// outage mode). The server's 256 calls at once are shared by every lane first
// come first served, and a lane looping on its calls would crowd the others
// out. A quarter of them: the Python client's DEFAULT_MAX_CALLS_IN_FLIGHT.
const DEFAULT_MAX_CALLS_IN_FLIGHT = 64;
const MAX_CALLS_IN_FLIGHT = 10_000;
// How long close() lets the calls under way (call()s with their Settles and
// Refunds, other ledger calls, refunds of unanswered Reserves) finish before it
// cancels them: one cut off may leave a hold booked until it expires. The
// Python client's DEFAULT_CLOSE_GRACE_SECONDS.
const DEFAULT_CLOSE_GRACE_MS = 5000;
// After the grace, close() keeps the journal open this long at most for the
// call()s it cut off to journal their endings: with the channel closed a
// cut-off Settle or Reserve fails and is journaled within milliseconds, but a
// callback still in its model call may never return, and close() must. A call
// ending later finds the journal closed; its hold expires. The Python client's
// CLOSE_JOURNAL_WAIT_SECONDS.
const CLOSE_JOURNAL_WAIT_MS = 1000;
const CLOSED_MESSAGE =
  'the lane client is closed: nothing was sent (a client is used until close(), not after; make a new one)';
// The call()s whose callbacks this code runs in (each {client, running}): a
// close() awaited inside a callback cannot wait for that call, which ends only
// after the callback returns.
const enclosingCalls = new AsyncLocalStorage();
// What a grant function's race with its call's deadline gives when it lost.
const GRANT_LATE = Symbol('grant late');
const JOURNAL_DEFAULTS = Object.freeze({ maxJournalBytes: DEFAULT_MAX_JOURNAL_BYTES, rotateJournalBytes: DEFAULT_ROTATE_JOURNAL_BYTES });

/** Resolves once every promise has settled, or after `milliseconds`, whichever is first. */
async function settledWithin(promises, milliseconds) {
  let timer;
  const late = new Promise((resolve) => {
    timer = setTimeout(resolve, milliseconds);
  });
  await Promise.race([Promise.allSettled(promises), late]);
  clearTimeout(timer);
}

/** At most `limit` slots in use; a taker past them waits, in order, until its deadline. */
class CallSlots {
  constructor(limit) {
    this.limit = limit;
    this.used = 0;
    this._waiting = [];
  }

  /** Resolves true with a slot, or false at `deadline` (epoch ms) without one. */
  take(deadline) {
    if (this.used < this.limit) {
      this.used += 1;
      return Promise.resolve(true);
    }
    return new Promise((resolve) => {
      const waiter = { resolve, timer: null };
      waiter.timer = setTimeout(() => {
        this._waiting.splice(this._waiting.indexOf(waiter), 1);
        resolve(false);
      }, Math.max(0, deadline - Date.now()));
      this._waiting.push(waiter);
    });
  }

  /** Hands the slot to the first waiter, or frees it. */
  give() {
    const next = this._waiting.shift();
    if (next === undefined) {
      this.used -= 1;
      return;
    }
    clearTimeout(next.timer);
    next.resolve(true);
  }
}

/**
 * Refunds of unanswered Reserves, sent in the background (at most `limit` at a
 * time, `pendingLimit` more waiting; each sent again while its answer is lost,
 * up to UNANSWERED_REFUND_ATTEMPTS; beyond that, the hold expires), and what
 * their answers mean for a later Reserve of the same id: the ledger would
 * answer it with its first answer (admitted) even for a booking the refund
 * has ended, and the paid call could then never be settled. So clear() stands
 * before every Reserve: it waits for the id's refund under way (at most the
 * deadline), asks again a refund whose answer was lost, and refuses an id
 * whose booking was ended (ReservationIdReused). It remembers the `remember`
 * latest ids whose refund did or may have ended a booking (the Python
 * client's BackgroundRefunds).
 */
class BackgroundRefunds {
  constructor(limit = MAX_BACKGROUND_REFUNDS, remember = MAX_ENDED_IDS, pendingLimit = MAX_PENDING_REFUNDS) {
    this._limit = limit;
    this._pendingLimit = pendingLimit;
    // Refunds being sent (at most `limit`), and the turns of those waiting, in order.
    this._sending = 0;
    this._waiting = [];
    /** reservation id -> the promise of its refund under way */
    this._inFlight = new Map();
    /** reservation id -> true: its refund ended the booking; false: it may have (its answer was lost) */
    this._ended = new RecentIds(remember);
  }

  get running() {
    return this._inFlight.size;
  }

  /**
   * Starts `refund()` (a promise) for this id, at once or once one of the
   * `limit` being sent ends; false when `limit` are sent and `pendingLimit` wait.
   */
  send(refund, reservationId) {
    if (this._inFlight.has(reservationId)) return true;
    if (this._inFlight.size >= this._limit + this._pendingLimit) return false;
    const sent = this._turn()
      .then(() => this._attemptRepeatedly(refund, reservationId).finally(() => this._endTurn()))
      .catch(() => undefined) // best effort: at worst the hold expires
      .finally(() => this._inFlight.delete(reservationId));
    this._inFlight.set(reservationId, sent);
    return true;
  }

  /** Resolves once none is under way. */
  async idle() {
    while (this._inFlight.size > 0) await Promise.allSettled([...this._inFlight.values()]);
  }

  async _turn() {
    if (this._sending < this._limit) {
      this._sending += 1;
      return;
    }
    await new Promise((resolve) => this._waiting.push(resolve)); // handed the turn of one that ended
  }

  _endTurn() {
    const next = this._waiting.shift();
    if (next === undefined) this._sending -= 1;
    else next();
  }

  /** The refund, sent again while its answer is lost and may come (a retryable error). */
  async _attemptRepeatedly(refund, reservationId) {
    for (let attempt = 1; ; attempt += 1) {
      try {
        return await this._attempt(refund, reservationId);
      } catch (error) {
        // ClientClosed (not a LedgerError) stops it: the channel is closed.
        if (!(error instanceof LedgerError && error.retryable) || attempt >= UNANSWERED_REFUND_ATTEMPTS) throw error;
        await pause(UNANSWERED_REFUND_PAUSE_MS * attempt);
      }
    }
  }

  /** Sends the refund once and remembers what its answer means; rejects when it is not known. */
  async _attempt(refund, reservationId) {
    try {
      await refund();
    } catch (error) {
      if (error instanceof BookingNotFound || error instanceof BookingWasDenied) {
        this._note(reservationId, null); // nothing booked, or a denial a repeat gets
        return;
      }
      if (error instanceof BookingAlreadyEnded) {
        this._note(reservationId, true); // ended otherwise: the id is used up
        return;
      }
      this._note(reservationId, error instanceof LedgerError && error.mayHaveApplied ? false : null);
      throw error;
    }
    this._note(reservationId, true);
  }

  _note(reservationId, ended) {
    if (ended === null) this._ended.delete(reservationId);
    else this._ended.add(reservationId, ended);
  }

  /**
   * Before a Reserve of this id: resolves when it may be sent. Rejects with
   * ReservationIdReused when a refund of it ended its booking, and with an
   * outage error when that cannot be known now (a refund still under way
   * after `deadlineMs`, or one asked again that got no answer).
   */
  async clear(refund, reservationId, deadlineMs) {
    const running = this._inFlight.get(reservationId);
    if (running !== undefined) {
      let timer;
      const late = new Promise((resolve) => {
        timer = setTimeout(() => resolve(true), deadlineMs);
      });
      const timedOut = await Promise.race([running.then(() => false), late]);
      clearTimeout(timer);
      if (timedOut) {
        throw new DeadlineExceeded(`a refund of reservation ${reservationId} is still under way`, { code: grpc.status.DEADLINE_EXCEEDED });
      }
    }
    // Its answer was lost: ask again (a repeat gets the first answer).
    if (this._ended.get(reservationId) === false) await this._attempt(refund, reservationId);
    if (this._ended.get(reservationId) === true) throw refundedAfterUnanswered(reservationId);
  }
}

/** A retry under the id of an unanswered Reserve whose refund has ended its booking. */
function refundedAfterUnanswered(reservationId) {
  return new ReservationIdReused(
    `reservation ${reservationId} was refunded after its Reserve went unanswered; the ledger would ` +
      'answer a Reserve under it with its first answer for a booking that has ended: send the call under a new reservation id',
    { code: grpc.status.ALREADY_EXISTS, reason: 'RESERVATION_ID_REUSED' },
  );
}

/**
 * A call() under the id of one this client's call() was admitted under: the
 * ledger would answer its Reserve with that first answer, admitted, and the
 * model call made again could never be settled (the booking is, or will be,
 * ended by the first call).
 */
function usedByCall(reservationId) {
  return new ReservationIdReused(
    `reservation ${reservationId} was already admitted to a call() of this client; the ledger would answer a Reserve ` +
      'under it with its first answer, and this model call could never be booked: send the call under a new reservation id',
    { code: grpc.status.ALREADY_EXISTS, reason: 'RESERVATION_ID_REUSED' },
  );
}

/**
 * An admitted answer that an earlier Reserve under this id made, one this
 * call() did not send (another process, a lane restarted under the same id):
 * that call may have made the model call, and one made again under its
 * booking could never be booked, or would share its hold.
 */
function reservedByAnotherCall(reservationId) {
  return new ReservationIdReused(
    `reservation ${reservationId} was already reserved by a Reserve this call did not send; the ledger answered with ` +
      'that first answer, and this model call could never be booked: send the call under a new reservation id',
    { code: grpc.status.ALREADY_EXISTS, reason: 'RESERVATION_ID_REUSED' },
  );
}

/** The latest `limit` ids, each with a value, oldest forgotten first: the ids of call(), and the background refunds' ended ones. */
class RecentIds {
  constructor(limit) {
    this._limit = limit;
    this._ids = new Map();
  }

  add(id, value = true) {
    this._ids.delete(id);
    this._ids.set(id, value);
    while (this._ids.size > this._limit) this._ids.delete(this._ids.keys().next().value);
  }

  delete(id) {
    this._ids.delete(id);
  }

  get(id) {
    return this._ids.get(id);
  }

  has(id) {
    return this._ids.has(id);
  }
}

/** A Reserve the ledger denied, or the outage mode did: the call was not made. */
class Denied {
  constructor(answer, ledgerError = null) {
    this.admitted = false;
    this.reservationId = answer.reservationId;
    /**
     * "BUDGET_EXHAUSTED" or "HOLD_EXCEEDS_LIMIT" (the ledger said no), or, with
     * the ledger unreachable, "LEDGER_UNAVAILABLE" (the lane fails closed) or
     * "ALLOWANCE_EXHAUSTED" (its outage allowance is spent).
     */
    this.reason = answer.denialReason;
    /**
     * The budget that said no: this lane, or one of its parents (a lane's
     * name). "" for an outage denial (no budget was asked).
     */
    this.deniedBy = answer.deniedBy ?? '';
    /** The server's sentence for people. */
    this.message = answer.reason;
    /** When enough of the window ages out for this hold to fit; null when it never can. */
    this.retryAfter = answer.retryAfter;
    this.holdNanos = answer.holdNanos;
    this.capNanos = answer.capNanos;
    this.balance = answer.balance;
    /** For an outage denial: the error that said the ledger is unreachable; else null. */
    this.ledgerError = ledgerError;
  }
}

function outageDenial(reservationId, denialReason, message, ledgerError) {
  const answer = { reservationId, denialReason, deniedBy: '', reason: message, retryAfter: null, holdNanos: 0n, capNanos: 0n, balance: null };
  return new Denied(answer, ledgerError);
}

/** The booking call() hands its callback when the outage allowance admitted the call. */
function allowanceBooking(reservationId, { holdNanos, capNanos }) {
  return {
    reservationId,
    admitted: true,
    decision: 'ADMITTED',
    holdNanos,
    capNanos,
    reservedAt: null,
    expiresAt: null,
    retryAfter: null,
    denialReason: null,
    deniedBy: '',
    reason: '',
    balance: null,
    source: CallSource.ALLOWANCE,
  };
}

const SETTLEMENT_OF_ENDING = Object.freeze({
  [Ending.SUCCEEDED]: Settlement.SETTLE_SUCCEEDED,
  [Ending.UNKNOWN]: Settlement.SETTLE_UNKNOWN,
  [Ending.REFUND]: Settlement.REFUND,
});
const ENDING_OF_SETTLEMENT = Object.freeze(Object.fromEntries(Object.entries(SETTLEMENT_OF_ENDING).map(([ending, settlement]) => [settlement, ending])));

/** A move of endingOf() as the journal keeps it: every count a BigInt. */
function journalEndingOf(move) {
  const integer = (value, name) => BigInt(wire.int64(value ?? 0, name));
  const usage = move.usage;
  return {
    settlement: SETTLEMENT_OF_ENDING[move.ending],
    httpStatus: move.httpStatus,
    usage:
      usage === null || usage === undefined
        ? null
        : {
            inputTokens: integer(usage.inputTokens, 'inputTokens'),
            outputTokens: integer(usage.outputTokens, 'outputTokens'),
            billedNanos: usage.billedNanos === null || usage.billedNanos === undefined ? null : integer(usage.billedNanos, 'billedNanos'),
            cachedInputTokens: integer(usage.cachedInputTokens, 'cachedInputTokens'),
            cacheWriteTokens: integer(usage.cacheWriteTokens, 'cacheWriteTokens'),
          },
    reason: move.reason ?? '',
  };
}

/** A journaled ending as the move _endOnce sends. */
function moveOfJournalEnding(ending) {
  return { ending: ENDING_OF_SETTLEMENT[ending.settlement], httpStatus: ending.httpStatus, usage: ending.usage, reason: ending.reason };
}

/** The headers a replay sends: the original call's trace id under a new span. */
function replayTrace(traceId) {
  if (!traceId) return null;
  return { traceparent: `00-${traceId}-${randomBytes(8).toString('hex')}-01` };
}

function checkLogger(logger) {
  if (logger === null) return null;
  if (typeof logger?.warn !== 'function' || typeof logger?.error !== 'function') {
    throw new TypeError('logger must have warn() and error() methods, or be null');
  }
  return logger;
}

/** An admitted call that ran; how its booking ended. */
class Completed {
  constructor(fields) {
    this.admitted = true;
    Object.assign(this, fields);
  }
}

/** A request must be an object of named fields: else a TypeError naming the method, not the engine's. */
function checkRequest(request, method, type) {
  if (request === null || typeof request !== 'object' || Array.isArray(request)) {
    throw new TypeError(`${method}() needs its request as an object of named fields (see index.d.ts), not ${kindOf(request)}`);
  }
  checkNames(request, type, `${method}()'s request`);
}

function isDeadlineMs(value) {
  return typeof value === 'number' && value > 0 && value <= MAX_DEADLINE_MS;
}

function pause(milliseconds) {
  return new Promise((resolve) => setTimeout(resolve, milliseconds));
}

const LOOPBACK = new net.BlockList();
LOOPBACK.addSubnet('127.0.0.0', 8, 'ipv4');
LOOPBACK.addAddress('::1', 'ipv6');

function isLocalHost(hostPort) {
  let host;
  if (hostPort.startsWith('[')) host = hostPort.slice(1).split(']')[0];
  else if (hostPort.split(':').length === 2) host = hostPort.split(':')[0];
  else host = hostPort; // no port, or a bare IPv6 address
  if (host.toLowerCase() === 'localhost') return true;
  const family = net.isIP(host);
  return family !== 0 && LOOPBACK.check(host, family === 4 ? 'ipv4' : 'ipv6');
}

/**
 * Whether a gRPC target is this machine: a unix socket, localhost,
 * 127.0.0.0/8 or ::1 (the cases are clients/cases/plaintext.json). A grant
 * sent anywhere else without TLS travels unencrypted.
 */
function isLocalAddress(address) {
  if (address.startsWith('unix:') || address.startsWith('unix-abstract:')) return true;
  let target = address;
  for (const scheme of ['dns:', 'ipv4:', 'ipv6:']) {
    if (target.startsWith(scheme)) {
      target = target.slice(scheme.length);
      // dns://[authority]/host:port
      if (target.startsWith('//')) target = target.slice(2).split('/').slice(1).join('/');
      break;
    }
  }
  return target.split(',').every(isLocalHost);
}

// grpc-js's whole text for a plaintext channel a TLS ledger hung up on, as
// for a server going away: only a handshake of the client's own tells them apart.
const FAILED_TO_CONNECT = 'Failed to connect';
// grpc-js's handshake texts for a TLS channel that refused the ledger's
// certificate: it does not carry the name checked (Node's own error code), or
// its chain does not reach rootCerts (OpenSSL's words, which all name the
// certificate: "unable to verify the first certificate", "self-signed
// certificate", "certificate has expired"; an alert from the ledger is not this).
const NAME_NOT_IN_CERTIFICATE = 'ERR_TLS_CERT_ALTNAME_INVALID';
const CERTIFICATE_UNTRUSTED = /Error: ([^.]*certificate[^.]*)/;

/**
 * The host and port a TLS probe connects to; null for a gRPC target scheme, a
 * replica list or anything else that is not a plain HOST:PORT.
 */
function probeTarget(address) {
  const at = address.lastIndexOf(':');
  const host = address.slice(0, at).replace(/^\[|\]$/g, '');
  const port = Number(address.slice(at + 1));
  if (at <= 0 || !Number.isInteger(port) || /^(unix|dns:|ipv)/.test(host) || host.includes(',')) {
    return null;
  }
  return { host, port };
}

/**
 * Whether the ledger at a plain HOST:PORT answers a TLS handshake: true, false
 * (a listener that is not TLS), or null (nobody answered: ask another time).
 * No certificate is checked and nothing is sent after it; an alert from the
 * server (a client certificate demanded) is TLS too.
 */
function servesTls(address, timeoutMs) {
  const target = probeTarget(address);
  if (target === null) return Promise.resolve(false);
  const { host, port } = target;
  return new Promise((resolve) => {
    const socket = nodeTls.connect({ host, port, rejectUnauthorized: false, ALPNProtocols: ['h2'] });
    // One timer for the connect and the handshake together (a socket's own
    // timeout is for idleness, and restarts with every byte).
    const timer = setTimeout(() => done(null), timeoutMs);
    const done = (answer) => {
      clearTimeout(timer);
      socket.destroy();
      resolve(answer);
    };
    socket.once('secureConnect', () => done(true));
    socket.once('error', (error) => {
      const code = String(error.code ?? '');
      if (code.includes('ALERT')) done(true);
      else if (code.startsWith('ERR_SSL') || code === 'ECONNRESET') done(false);
      else done(null);
    });
  });
}

// The TLS alerts that refuse a client's certificate: missing (TLS 1.3's
// certificate_required), signed by a CA the server does not know, or refused.
const CERTIFICATE_REFUSALS = /ALERT_(CERTIFICATE_REQUIRED|UNKNOWN_CA|BAD_CERTIFICATE|CERTIFICATE_UNKNOWN)/;

/**
 * Whether the ledger at a plain HOST:PORT refuses a TLS client offering the
 * client certificate of `tls` (none when it has none): grpc-js reports either
 * only as "Failed to connect", as for a server going away. gRPC's server
 * completes the TLS 1.3 handshake and then hangs up without a byte (no alert),
 * where a ledger that takes the client sends its HTTP/2 settings at once; a
 * TLS alert refusing the certificate (another TLS stack in front) says it too.
 * Only an answer in TLS counts: a listener or a plain TCP proxy that hangs up
 * before the handshake is done is an outage. Nothing is sent; the ledger's
 * certificate is not checked; false unless it is sure.
 */
function refusesClientCertificate(address, timeoutMs, tls) {
  const target = probeTarget(address);
  if (target === null) return Promise.resolve(false);
  const { host, port } = target;
  return new Promise((resolve) => {
    let socket;
    try {
      socket = nodeTls.connect({
        host,
        port,
        rejectUnauthorized: false,
        minVersion: 'TLSv1.3',
        ALPNProtocols: ['h2'], // without it gRPC hangs up on anyone
        cert: tls.clientCert,
        key: tls.clientKey,
      });
    } catch {
      resolve(false); // a certificate or key Node cannot read: not the ledger's answer
      return;
    }
    let handshaken = false;
    const timer = setTimeout(() => done(false), timeoutMs);
    const done = (answer) => {
      clearTimeout(timer);
      socket.destroy();
      resolve(answer);
    };
    socket.once('secureConnect', () => {
      handshaken = true;
    });
    socket.once('data', () => done(false));
    socket.once('close', () => done(handshaken));
    socket.once('error', (error) => {
      if (CERTIFICATE_REFUSALS.test(String(error.code ?? ''))) done(true);
      else done(handshaken && error.code === 'ECONNRESET');
    });
  });
}

const PEM_CERTIFICATE = /-----BEGIN CERTIFICATE-----[^-]*-----END CERTIFICATE-----/g;

/**
 * The tls and channelOptions options, at construction: grpc-js took a string
 * for tls as TLS with the system's roots, and OpenSSL drops rootCerts that
 * are no PEM in silence (the system's roots again), so every call met a
 * certificate it could not verify instead of the lane its own mistake.
 */
function checkChannelOptions(options) {
  const { tls, channelOptions } = options;
  if (channelOptions !== undefined && (channelOptions === null || typeof channelOptions !== 'object' || Array.isArray(channelOptions))) {
    throw new TypeError(`channelOptions must be an object of grpc-js channel options, not ${kindOf(channelOptions)}`);
  }
  if (tls === undefined || tls === null || typeof tls === 'boolean') return;
  if (typeof tls !== 'object' || Array.isArray(tls)) {
    throw new TypeError(`tls must be true, false or an object of TlsOptions, not ${kindOf(tls)}`);
  }
  checkNames(tls, 'TlsOptions', 'tls');
  for (const name of ['rootCerts', 'clientCert', 'clientKey']) {
    const value = tls[name];
    if (value !== undefined && value !== null && typeof value !== 'string' && !Buffer.isBuffer(value)) {
      throw new TypeError(`tls.${name} must be PEM as a string or a Buffer, not ${kindOf(value)}`);
    }
  }
  if (tls.serverName !== undefined && (typeof tls.serverName !== 'string' || !tls.serverName)) {
    throw new TypeError(`tls.serverName must be a non-empty string, not ${typeof tls.serverName === 'string' ? 'empty' : kindOf(tls.serverName)}`);
  }
  if (tls.rootCerts === undefined || tls.rootCerts === null) return;
  const blocks = Buffer.from(tls.rootCerts).toString('latin1').match(PEM_CERTIFICATE) ?? [];
  if (blocks.length === 0) throw new TypeError('tls.rootCerts holds no PEM certificate (-----BEGIN CERTIFICATE-----)');
  for (const block of blocks) {
    try {
      new X509Certificate(block);
    } catch (error) {
      throw new TypeError(`tls.rootCerts does not load (${error.message}): give PEM certificates`, { cause: error });
    }
  }
}

function channelCredentials(tls) {
  if (!tls) return grpc.credentials.createInsecure();
  const options = tls === true ? {} : tls;
  const pem = (value) => (value === undefined || value === null ? null : Buffer.from(value));
  try {
    return grpc.credentials.createSsl(pem(options.rootCerts), pem(options.clientKey), pem(options.clientCert));
  } catch (error) {
    // OpenSSL's words alone ("key values mismatch") name no option; every call would fail the same way.
    const which = options.clientKey || options.clientCert ? 'tls.clientCert and tls.clientKey do not load as a pair, or tls.rootCerts does not load' : 'tls.rootCerts does not load';
    throw new TypeError(`${which} (${error.message}): give PEM certificates and the client certificate's own unencrypted key`, { cause: error });
  }
}

// A lost connection is retried within 100 ms, then at most every 2 s (the
// Python client's settings), so a ledger that comes back is noticed within
// seconds, not grpc-js's default two minutes: an outage mode ends when it can.
const RECONNECT_OPTIONS = Object.freeze({
  'grpc.initial_reconnect_backoff_ms': 100,
  'grpc.max_reconnect_backoff_ms': 2000,
  // An address of several replicas (`ipv4:A,B`, a DNS name with one record
  // each): calls go to each ready one in turn. gRPC's default, pick_first,
  // sent every call to the first, and a drain there met all of them.
  'grpc.service_config': JSON.stringify({ loadBalancingConfig: [{ round_robin: {} }] }),
  // A replica that froze (SIGSTOP, a paused VM, a host gone silent) keeps its
  // connection open, and round robin kept sending it every other call. A ping
  // every 5 s, unanswered for 5 s, closes that connection: within 10 s its
  // calls go to the other replicas. The server admits a ping every 4 s at the
  // most (client_ping_min_interval_seconds). The Python client's
  // KEEPALIVE_INTERVAL_MS and KEEPALIVE_TIMEOUT_MS (ledger_client/channels.py).
  'grpc.keepalive_time_ms': 5000,
  'grpc.keepalive_timeout_ms': 5000,
  'grpc.keepalive_permit_without_calls': 1,
});
// The reason a draining server refuses a call with before doing any work.
const SHUTTING_DOWN = 'SHUTTING_DOWN';

function channelOptions(options) {
  const serverName = options.tls && options.tls !== true ? options.tls.serverName : undefined;
  const extra = serverName
    ? { 'grpc.ssl_target_name_override': serverName, 'grpc.default_authority': serverName }
    : {};
  return { ...RECONNECT_OPTIONS, ...extra, ...(options.channelOptions ?? {}) };
}

// Targets gRPC resolves itself: `dns:///host:port`, `unix:///path`, `ipv4:a,b`, ...
const GRPC_URI_SCHEMES = ['dns', 'unix', 'xds', 'google-c2p'];
const GRPC_SCHEMES = ['dns:', 'unix:', 'unix-abstract:', 'ipv4:', 'ipv6:', 'vsock:', 'xds:', 'google-c2p:'];

/** The ledger's HOST:PORT, before a channel is made (the Python client's check_address). */
function checkAddress(address) {
  // An unset variable (process.env.LEDGER_ADDRESS) failed inside the address check, naming nothing.
  if (typeof address !== 'string') {
    throw new TypeError(`address: must be the ledger's HOST:PORT as a string, not ${address === null ? 'null' : typeof address}`);
  }
  if (!address.trim()) throw new TypeError("address: is empty; give the ledger's HOST:PORT");
  // What follows grpc-js takes and then fails on every call as UNAVAILABLE, or
  // reaches another port: a lane would run on its outage mode for good.
  // Its own schemes (dns:, ipv4:, unix:, ...) pass.
  if (address !== address.trim()) throw new TypeError("address: starts or ends with a space; give the ledger's HOST:PORT");
  const separator = address.indexOf('://');
  if (separator !== -1 && !GRPC_URI_SCHEMES.includes(address.slice(0, separator))) {
    throw new TypeError(`address: ${address.slice(0, Math.min(separator, 20))}:// is no gRPC target; give the ledger's HOST:PORT`);
  }
  if (GRPC_SCHEMES.some((scheme) => address.startsWith(scheme))) return;
  const at = address.lastIndexOf(':');
  const host = address.slice(0, at);
  if (at === -1 || (host.includes(':') && !host.endsWith(']'))) return; // no port (gRPC's default, 443), or a bare IPv6 address
  const port = address.slice(at + 1);
  if (!(/^[0-9]{1,5}$/.test(port) && Number(port) >= 1 && Number(port) <= 65535)) {
    throw new TypeError(`address: the port must be a number from 1 to 65535, not '${port.slice(0, 20)}'`);
  }
}

/**
 * One lane's view of the ledger. Holds one gRPC channel; reuse the instance.
 */
class LaneClient {
  // Private: a bearer credential must not show in util.inspect or console.log of a client.
  #grant = null;

  /**
   * @param {string} address host:port of the ledger
   * @param {string} lane the lane's name
   * @param {import('../index').LaneClientOptions} [options]
   */
  constructor(address, lane, options = {}) {
    checkAddress(address);
    checkLane(lane);
    checkNames(options, 'LaneClientOptions', 'LaneClient options');
    checkChannelOptions(options);
    this.address = address;
    this.lane = lane;
    this.deadlineMs = options.deadlineMs ?? DEFAULT_DEADLINE_MS;
    this.endAttempts = options.endAttempts ?? DEFAULT_END_ATTEMPTS;
    // Bounded as the Python client's deadline_seconds (0, 60] and end_attempts
    // [1, 10]: past them the ledger could eat the model call's time (Infinity
    // is no deadline at all; a string makes every call an outage).
    if (!isDeadlineMs(this.deadlineMs)) throw new RangeError(`deadlineMs ${DEADLINE_RULE}`);
    if (!(Number.isInteger(this.endAttempts) && this.endAttempts >= 1 && this.endAttempts <= MAX_END_ATTEMPTS)) {
      throw new RangeError(`endAttempts must be an integer from 1 to ${MAX_END_ATTEMPTS}`);
    }
    this.maxCallsInFlight = options.maxCallsInFlight ?? DEFAULT_MAX_CALLS_IN_FLIGHT;
    if (!(Number.isInteger(this.maxCallsInFlight) && this.maxCallsInFlight >= 1 && this.maxCallsInFlight <= MAX_CALLS_IN_FLIGHT)) {
      throw new RangeError(`maxCallsInFlight must be an integer from 1 to ${MAX_CALLS_IN_FLIGHT}`);
    }
    this._slots = new CallSlots(this.maxCallsInFlight);
    this.#grant = options.grant ?? null;
    if (this.#grant !== null && typeof this.#grant !== 'function') checkGrant(this.#grant);
    if (this.#grant !== null && !options.tls && !isLocalAddress(address)) {
      // Once per client: a grant is a bearer credential, readable on the wire.
      process.emitWarning(
        `the grant for lane ${lane} goes to ${address} without TLS: it travels unencrypted (pass the tls option)`,
        { type: 'LedgerPlaintextWarning', code: 'LEDGER_PLAINTEXT_GRANT' },
      );
    }
    /** The lane's outage mode; deny (fail closed) unless set. */
    this.outage = options.outage ?? OutagePolicy.deny();
    if (!(this.outage instanceof OutagePolicy)) throw new TypeError('outage must be an OutagePolicy');
    this._replaySettings = replaySettingsOf(options);
    this._journalLimits = {
      maxBytes: options.maxJournalBytes ?? JOURNAL_DEFAULTS.maxJournalBytes,
      rotateBytes: options.rotateJournalBytes ?? JOURNAL_DEFAULTS.rotateJournalBytes,
    };
    checkJournalLimits(this._journalLimits.maxBytes, this._journalLimits.rotateBytes);
    this._logger = checkLogger(options.logger === undefined ? console : options.logger);
    this._journal = null;
    this._allowance = null;
    this._replayer = null;
    this._refunds = new BackgroundRefunds();
    // The ids of this client's call()s: true once the ledger admitted one (a
    // call() under it again is refused), false while its Reserve went
    // unanswered and no model call was made (a call() under it again may take
    // over what that Reserve booked).
    this._callIds = new RecentIds(MAX_ENDED_IDS);
    // The Settles and Refunds of calls whose model call has returned.
    this._endings = new Set();
    // The call()s under way, from their Reserve to their ending: close() waits for them.
    this._calls = new Set();
    // The lane's event streams open now (watchEvents): close() ends them.
    this._watches = new events.Watches();
    this.watchResumeMs = events.checkWatchResumeMs(options.watchResumeMs ?? events.DEFAULT_WATCH_RESUME_MS);
    this._closed = null;
    // Every ledger call under way: its promise, and its grpc-js call to cancel.
    this._rpcs = new Map();
    // Set once close()'s grace is over: the channel is closed, what was left cancelled.
    this._channelClosed = false;
    const { Ledger } = ledgerPackage();
    this._stub = new Ledger(address, channelCredentials(options.tls), channelOptions(options));
    // The lane's TLS settings ({} for the system's roots alone), or null for plaintext.
    this._tls = options.tls ? { ...(options.tls === true ? {} : options.tls) } : null;
    try {
      this._openJournal();
    } catch (error) {
      this._stub.close();
      throw error;
    }
  }

  _openJournal() {
    if (this.outage.journalPath === null) return;
    this._journal = new Journal(this.outage.journalPath, this.lane, this._journalLimits);
    this._warnSkipped(this._journal);
    const moves = {
      reserve: (args, traceId, deadlineMs) => this._reserve(args, replayTrace(traceId), deadlineMs),
      end: (reservationId, ending, traceId, deadlineMs) =>
        this._endOnce(reservationId, moveOfJournalEnding(ending), replayTrace(traceId), deadlineMs),
    };
    this._replayer = new Replayer(moves, this._journal, this._replaySettings, this._logger);
    if (this.outage.mode === OutageMode.ALLOWANCE) this._allowance = new Allowance(this.outage, this._journal);
    if (this._replaySettings.replayIntervalMs !== null) this._replayer.start(this._replaySettings.replayIntervalMs);
  }

  /**
   * Never silent: a line the journal could not read may be the Reserve of a
   * call made on the allowance, which is then neither replayed nor counted
   * against it. Said at every start, as the Python client does.
   */
  _warnSkipped(journal) {
    const torn = journal.tornLastLine;
    const skipped = journal.skippedLines - (torn ? 1 : 0);
    if (skipped === 0 && !torn) return;
    const parts = [];
    if (skipped > 0) {
      parts.push(
        `${skipped} unreadable line${skipped === 1 ? '' : 's'} skipped (a call they record is neither replayed ` +
          'to the ledger nor counted against the allowance: look at the file)',
      );
    }
    if (torn) parts.push('a torn last line skipped and sealed (a write the lane did not finish)');
    this._logger?.warn(`ledger journal: journal ${journal.path}: ${parts.join('; ')}`);
  }

  /** Where the client's warnings go (the `logger` option; null: nowhere). */
  get logger() {
    return this._logger;
  }

  /** The outage journal, or null without one. */
  get journal() {
    return this._journal;
  }

  /** What is spent of the outage allowance, {nanos, calls}; null without an allowance. */
  allowanceUsed() {
    return this._allowance === null ? null : this._allowance.used();
  }

  /**
   * One bounded replay attempt of the journal, now: at most `maxEntries`
   * entries (and maxReplayEntriesPerAttempt). Resolves with its report.
   * @param {{maxEntries?: number}} [options]
   * @returns {Promise<import('../index').ReplayReport>}
   */
  async replayJournal({ maxEntries } = {}) {
    this._refuseClosed();
    if (this._replayer === null) return emptyReport();
    return this._replayer.replayOnce(maxEntries);
  }

  /**
   * Resolves once the channel is connected (call it at start-up, off the hot
   * path). A ledger not reached within timeoutMs is an Unavailable, as a call
   * would meet it, so that the lane can start in its outage mode.
   */
  async waitForReady(timeoutMs = 5000) {
    this._refuseClosed();
    if (typeof timeoutMs !== 'number' || !(timeoutMs > 0) || !Number.isFinite(timeoutMs)) {
      throw new RangeError('timeoutMs: must be a positive number of milliseconds');
    }
    await new Promise((resolve, reject) => {
      this._stub.waitForReady(Date.now() + timeoutMs, (error) => {
        if (!error) return resolve();
        const message = `the ledger could not be reached within ${timeoutMs} ms`;
        return reject(new Unavailable(message, { code: grpc.status.UNAVAILABLE, cause: error }));
      });
    });
  }

  /**
   * Refuses new calls at once (ClientClosed), stops the background replayer,
   * waits up to `graceMs` (5 s by default) for the calls under way to finish
   * (call()s: their callbacks, Settles and Refunds; other ledger calls; the
   * background refunds of unanswered Reserves), then closes the channel,
   * cancelling what is left (ClientClosed), then the journal (once its writes
   * under way are on disk) and releases its lock. Idempotent; the promise it
   * returns never rejects.
   * @param {{graceMs?: number}} [options]
   */
  close({ graceMs = DEFAULT_CLOSE_GRACE_MS } = {}) {
    if (this._closed !== null) return this._closed;
    if (typeof graceMs !== 'number' || !(graceMs >= 0 && graceMs <= MAX_DEADLINE_MS)) {
      throw new RangeError(`graceMs must be a number of milliseconds in [0, ${MAX_DEADLINE_MS}]`);
    }
    // A tail never ends by itself: it ends now, not at the grace.
    this._watches.close();
    this._replayer?.stop();
    const replayer = this._replayer;
    const journal = this._journal;
    const refunds = this._refunds;
    // Called inside call()s of this client: those are not waited for; the
    // channel and the journal close once they have ended their bookings.
    const own = (enclosingCalls.getStore() ?? []).filter((call) => call.client === this).map((call) => call.running);
    const others = () => [...this._calls].filter((running) => !own.includes(running));
    this._closed = (async () => {
      let timer;
      const late = new Promise((resolve) => {
        timer = setTimeout(resolve, graceMs);
      });
      const settled = async () => {
        // A call under way may start more (its Settle, a refund): until none is left.
        while (others().length + this._endings.size + this._rpcs.size + refunds.running > 0) {
          await Promise.allSettled([...others(), ...this._endings, ...this._rpcs.keys(), refunds.idle()]);
        }
      };
      await Promise.race([settled(), late]);
      clearTimeout(timer);
      const shut = async () => {
        this._channelClosed = true;
        for (const call of this._rpcs.values()) call?.cancel();
        this._stub.close();
        // The calls cut off journal what ends their bookings (an ending, a
        // Reserve in doubt) before the journal closes: at most CLOSE_JOURNAL_WAIT_MS.
        if (journal !== null) await settledWithin([...others(), ...this._endings], CLOSE_JOURNAL_WAIT_MS);
        await replayer?.idle().catch(() => undefined);
        await journal?.close().catch(() => undefined);
      };
      if (own.length > 0) {
        Promise.allSettled(own).then(shut);
        return;
      }
      await shut();
    })();
    return this._closed;
  }

  /** ClientClosed once close() was called: for the lane's own calls, not those under way. */
  _refuseClosed() {
    if (this._closed !== null) throw new ClientClosed(CLOSED_MESSAGE);
  }

  async _metadata(trace, deadlineMs) {
    const metadata = new grpc.Metadata();
    if (this.#grant !== null) metadata.set('authorization', `Bearer ${await this._grant(deadlineMs)}`);
    setTraceHeaders(metadata, trace);
    return metadata;
  }

  /**
   * The grant to send. From a function, every value is checked: one that gave
   * '' or null once must fail the call, not send it without a grant. One that
   * throws fails it with a GrantError too, its failure the cause: the call was
   * never sent, and a replay leaves its entries for a later attempt. One
   * that gives nothing within the call's `deadlineMs` fails it the same way:
   * the call's deadline bounds everything before the ledger is asked.
   */
  async _grant(deadlineMs) {
    if (typeof this.#grant !== 'function') return this.#grant;
    let timer;
    const late = new Promise((resolve) => {
      timer = setTimeout(() => resolve(GRANT_LATE), deadlineMs);
    });
    let given;
    try {
      given = await Promise.race([this.#grant(), late]);
    } catch (error) {
      throw new GrantError('the grant function failed (see cause): the call was not sent', { cause: error });
    } finally {
      clearTimeout(timer);
    }
    if (given === GRANT_LATE) {
      throw new GrantError(`the grant function gave no grant within the call's deadline (${deadlineMs} ms): the call was not sent`);
    }
    return checkGrant(given, GrantError);
  }

  /**
   * A call's own deadline, `deadlineMs` among its options, or the client's
   * when left out (undefined or null), as the Python client's
   * deadline_seconds. A bad one is the caller's mistake, refused before any
   * call as the Python client refuses it (InvalidArgument, the shared cases
   * in clients/cases/arguments.json), not replaced by the client's.
   */
  _callDeadlineMs(deadlineMs) {
    if (deadlineMs === undefined || deadlineMs === null) return this.deadlineMs;
    if (!isDeadlineMs(deadlineMs)) throw invalidArgument('deadlineMs', DEADLINE_RULE);
    return deadlineMs;
  }

  /** `trace`: the W3C headers to send ({traceparent, tracestate?}), or null for none. */
  async _unary(method, request, trace, deadlineMs = this.deadlineMs) {
    const deadline = Date.now() + deadlineMs;
    const metadata = await this._metadata(trace, deadlineMs);
    if (!(await this._slots.take(deadline))) {
      throw new ResourceExhausted(
        `this client already has ${this.maxCallsInFlight} calls at the ledger (maxCallsInFlight), none of which ended within the deadline`,
        { code: grpc.status.RESOURCE_EXHAUSTED },
      );
    }
    try {
      try {
        return await this._send(method, request, metadata, deadline);
      } catch (error) {
        // A draining replica did no work (SHUTTING_DOWN): once more, in the
        // time left, where the channel reaches another replica.
        if (error.reason !== SHUTTING_DOWN || Date.now() >= deadline) throw error;
        return await this._send(method, request, metadata, deadline);
      }
    } finally {
      this._slots.give();
    }
  }

  /**
   * A bare Unavailable that is this client's TLS option, not an outage:
   * TlsMismatch naming what to fix (see _tlsRefused for a TLS channel). A
   * plaintext channel's "Failed to connect" is TlsMismatch when the ledger
   * answers a TLS handshake, asked in the call's time left. Asked anew each
   * time, never remembered: the server behind the address can change (a TLS
   * ledger restarted as plaintext, a proxy), and a remembered answer would then
   * turn a real outage into TlsMismatch and stop the lane's allowance.
   */
  async _mistakenForOutage(error, deadline) {
    if (!(error instanceof Unavailable) || error.reason) return error;
    if (this._tls !== null) return this._tlsRefused(error, deadline);
    if (!(await this._probed(error, deadline, servesTls))) return error;
    return this._mismatch(
      error,
      'serves TLS and this client speaks plaintext: pass the tls option ' +
        '(rootCerts, and clientCert and clientKey if it demands a client certificate)',
    );
  }

  /**
   * A TLS channel's failure that is its own settings. grpc-js's handshake text
   * says when this client refused the ledger's certificate (its names, its
   * CA); a "Failed to connect" is the ledger refusing this client's
   * certificate (or its lack of one) when a TLS 1.3 handshake with it, in the
   * call's time left, is refused too (refusesClientCertificate).
   */
  async _tlsRefused(error, deadline) {
    const tls = this._tls;
    if (error.message.includes(NAME_NOT_IN_CERTIFICATE)) {
      const name = tls.serverName || probeTarget(this.address)?.host || this.address;
      return this._mismatch(
        error,
        `has a certificate that does not carry the name '${name}' (${tls.serverName ? 'serverName' : 'the address'}): ` +
          'set serverName in the tls option to a name the certificate carries, or reach the ledger by one',
      );
    }
    const untrusted = CERTIFICATE_UNTRUSTED.exec(error.message);
    if (untrusted !== null && !/alert/i.test(untrusted[1])) {
      return this._mismatch(
        error,
        `has a certificate that ${tls.rootCerts ? 'rootCerts' : "the system's roots"} do not trust ("${untrusted[1]}"): ` +
          "give rootCerts in the tls option the CA that signed the ledger's certificate",
      );
    }
    const refused = (address, timeoutMs) => refusesClientCertificate(address, timeoutMs, tls);
    if (!(await this._probed(error, deadline, refused))) return error;
    if (!tls.clientCert) {
      return this._mismatch(
        error,
        'asks for a client certificate (mutual TLS) and this client has none: give clientCert and clientKey in the tls option',
      );
    }
    return this._mismatch(
      error,
      "does not trust this client's certificate (clientCert in the tls option): give one signed by a CA the ledger " +
        'takes client certificates from (its --tls-client-ca), with its clientKey',
    );
  }

  /**
   * Whether a "Failed to connect" is the mistake `probe` asks the ledger
   * about, answered yes in the call's time left.
   */
  async _probed(error, deadline, probe) {
    const leftMs = deadline - Date.now();
    return error.message.includes(FAILED_TO_CONNECT) && leftMs > 0 && Boolean(await probe(this.address, leftMs));
  }

  _mismatch(error, what) {
    return new TlsMismatch(`the ledger at ${this.address} ${what}`, { code: error.code, metadata: error.metadata, cause: error });
  }

  async _send(method, request, metadata, deadline) {
    let sent;
    let started = null;
    try {
      sent = new Promise((resolve, reject) => {
        if (this._channelClosed) {
          // It waited for a slot past close()'s grace: the lane's own doing, not an outage.
          reject(new ClientClosed('the lane client closed: the call was not sent'));
          return;
        }
        try {
          started = this._stub[method](request, metadata, { deadline }, (error, response) => {
            if (error && this._channelClosed) {
              // close() cancelled it once its grace was over.
              const message = 'the lane client closed while the call was under way: the ledger may have applied it';
              reject(new ClientClosed(message, { mayHaveApplied: true, cause: error }));
            } else if (error) reject(ledgerErrorOf(error));
            else resolve(response);
          });
        } catch (error) {
          // The call did not start: the ledger is not reachable from here.
          reject(new Unavailable('the ledger call did not start', { code: grpc.status.UNAVAILABLE, cause: error }));
        }
      });
      // close() waits for it, and cancels it once its grace is over.
      this._rpcs.set(sent, started);
      return await sent;
    } catch (error) {
      throw await this._mistakenForOutage(error, deadline);
    } finally {
      this._rpcs.delete(sent);
    }
  }

  /**
   * Books a hold for one planned call, or is denied (a denial is an answer,
   * not an error). A retry with the same reservationId returns the first answer.
   * @param {import('../index').ReserveRequest} request
   * @returns {Promise<import('../index').ReserveResult>}
   */
  async reserve(request) {
    this._refuseClosed();
    checkRequest(request, 'reserve', 'ReserveRequest');
    const deadlineMs = this._callDeadlineMs(request.deadlineMs);
    const trace = traceHeaders(request);
    // A refund of an unanswered Reserve of this id may have ended the booking
    // this Reserve would be admitted to (BackgroundRefunds).
    await this._refunds.clear(() => this._refundUnanswered(request.reservationId, trace), request.reservationId, deadlineMs);
    return this._reserve(request, trace, deadlineMs);
  }

  async _reserve({ reservationId, model, requestBytes, maxOutputTokens, estimateNanos, ttlMs, ttlUs }, trace, deadlineMs) {
    // The ledger's rules (domain/moves.py), checked before any call: refused
    // with the InvalidArgument the ledger would send (see arguments.js). Past
    // its bounds a message may also outgrow what the server takes, which would
    // read as an outage, not a mistake.
    const checked = checkReserve({ reservationId, model, requestBytes, maxOutputTokens, estimateNanos, ttlMs, ttlUs });
    // A journaled call's ttl is in microseconds (BigInt); a caller's in milliseconds.
    const micros = checked.ttlUs;
    const ttl = micros === null ? undefined : { seconds: String(micros / 1_000_000n), nanos: Number(micros % 1_000_000n) * 1000 };
    const message = {
      lane: this.lane,
      reservation_id: reservationId,
      model,
      request_bytes: checked.requestBytes.toString(),
      max_output_tokens: checked.maxOutputTokens.toString(),
      estimate_nanos: checked.estimateNanos === null ? undefined : checked.estimateNanos.toString(),
      ttl,
    };
    return wire.reserveResultOf(await this._unary('Reserve', message, trace, deadlineMs), reservationId);
  }

  /**
   * Ends a booking with the call's outcome: SUCCEEDED with usage (the real
   * cost) or UNKNOWN (the hold, or a lower billedNanos).
   * @param {import('../index').SettleRequest} request
   * @returns {Promise<import('../index').SettleResult>}
   */
  async settle(request) {
    this._refuseClosed();
    checkRequest(request, 'settle', 'SettleRequest');
    return this._settle(request, traceHeaders(request), this._callDeadlineMs(request.deadlineMs));
  }

  async _settle(request, trace, deadlineMs) {
    const { reservationId, outcome, inputTokens = 0, outputTokens = 0, billedNanos, httpStatus = 0 } = request;
    const { cachedInputTokens = 0, cacheWriteTokens = 0 } = request;
    checkReservationId(reservationId);
    checkOutcome(outcome);
    const message = {
      lane: this.lane,
      reservation_id: reservationId,
      outcome,
      // Every input token, the cached and cache-write ones (parts of it) included.
      input_tokens: wire.int64(inputTokens, 'inputTokens'),
      output_tokens: wire.int64(outputTokens, 'outputTokens'),
      billed_nanos: wire.optionalInt64(billedNanos, 'billedNanos'),
      http_status: wire.int64(httpStatus, 'httpStatus'),
      cached_input_tokens: wire.int64(cachedInputTokens, 'cachedInputTokens'),
      cache_write_tokens: wire.int64(cacheWriteTokens, 'cacheWriteTokens'),
    };
    return wire.settleResultOf(await this._unary('Settle', message, trace, deadlineMs));
  }

  /**
   * Ends a booking whose call was refused (httpStatus 4xx) or never sent
   * (httpStatus 0 and a reason). It costs zero.
   * @param {import('../index').RefundRequest} request
   * @returns {Promise<{balance: import('../index').Balance}>}
   */
  async refund(request) {
    this._refuseClosed();
    checkRequest(request, 'refund', 'RefundRequest');
    return this._refund(request, traceHeaders(request), this._callDeadlineMs(request.deadlineMs));
  }

  async _refund({ reservationId, httpStatus = 0, reason = '' }, trace, deadlineMs) {
    checkReservationId(reservationId);
    checkRefund({ httpStatus, reason });
    const message = {
      lane: this.lane,
      reservation_id: reservationId,
      http_status: wire.int64(httpStatus, 'httpStatus'),
      reason,
    };
    const response = await this._unary('Refund', message, trace, deadlineMs);
    return { balance: wire.balanceOf(response.balance) };
  }

  /**
   * @param {import('../index').TraceOptions} [options]
   * @returns {Promise<import('../index').Balance>}
   */
  async balance(options) {
    this._refuseClosed();
    if (options !== undefined) checkNames(options, 'TraceOptions', 'balance() options');
    const deadlineMs = this._callDeadlineMs(options?.deadlineMs);
    return wire.balanceOf(await this._unary('GetBalance', { lane: this.lane }, traceHeaders(options), deadlineMs));
  }

  /**
   * @param {string} reservationId
   * @param {import('../index').TraceOptions} [options]
   * @returns {Promise<import('../index').Booking>}
   */
  async booking(reservationId, options) {
    this._refuseClosed();
    if (options !== undefined) checkNames(options, 'TraceOptions', 'booking() options');
    checkReservationId(reservationId);
    const deadlineMs = this._callDeadlineMs(options?.deadlineMs);
    const message = { lane: this.lane, reservation_id: reservationId };
    return wire.bookingOf(await this._unary('GetBooking', message, traceHeaders(options), deadlineMs));
  }

  /**
   * One page of the lane's events after `afterSeq`, oldest first: at most
   * `pageSize` (1 to MAX_PAGE_SIZE), fewer where the server's message limit
   * ends it early. Needs a grant with the `read` scope on the lane.
   * @param {import('../index').EventPageOptions} [options]
   * @returns {Promise<import('../index').EventPage>}
   */
  async listEvents(options = {}) {
    this._refuseClosed();
    checkNames(options, 'EventPageOptions', 'listEvents() options');
    const { afterSeq = 0n, pageSize = events.DEFAULT_PAGE_SIZE, deadlineMs } = options;
    const after = events.checkAfterSeq(afterSeq);
    events.checkPageSize(pageSize);
    const pageDeadlineMs = this._callDeadlineMs(deadlineMs);
    const message = { lane: this.lane, after_seq: after.toString(), page_size: pageSize };
    return events.pageOf(await this._unary('ListEvents', message, null, pageDeadlineMs));
  }

  /**
   * Every event of the lane after `afterSeq`, page by page (one listEvents
   * each, as the caller iterates), to the log's end as it stands then. Each
   * page has its own `deadlineMs`.
   * @param {import('../index').EventPageOptions} [options]
   * @returns {AsyncGenerator<import('../index').LedgerEvent, void, undefined>}
   */
  allEvents(options = {}) {
    this._refuseClosed();
    checkNames(options, 'EventPageOptions', 'allEvents() options');
    const { afterSeq = 0n, pageSize = events.DEFAULT_PAGE_SIZE, deadlineMs } = options;
    const after = events.checkAfterSeq(afterSeq);
    events.checkPageSize(pageSize);
    // Refused at once, as a bad pageSize is, not at the first page.
    const pageDeadlineMs = this._callDeadlineMs(deadlineMs);
    return events.allPages((cursor) => this.listEvents({ afterSeq: cursor, pageSize, deadlineMs: pageDeadlineMs }), after);
  }

  /**
   * An async iterator of the lane's events after `afterSeq`, then of each new
   * one as it is committed. A stream that drops (an outage, a server
   * restarting) is opened again after the last event it gave, for up to
   * `watchResumeMs`; each stream must be accepted within `deadlineMs` (its
   * own, else the client's). Stop it by leaving the loop (or its `return()`);
   * close() ends it too.
   * @param {import('../index').WatchOptions} [options]
   * @returns {AsyncGenerator<import('../index').LedgerEvent, void, undefined>}
   */
  watchEvents(options = {}) {
    this._refuseClosed();
    checkNames(options, 'WatchOptions', 'watchEvents() options');
    const { afterSeq = 0n, deadlineMs } = options;
    const after = events.checkAfterSeq(afterSeq);
    const streamDeadlineMs = this._callDeadlineMs(deadlineMs);
    const resumption = {
      forMs: this.watchResumeMs,
      firstPauseMs: RECONNECT_OPTIONS['grpc.initial_reconnect_backoff_ms'],
      mostPauseMs: RECONNECT_OPTIONS['grpc.max_reconnect_backoff_ms'],
    };
    const watches = this._watches.child();
    return events.tailOf((last) => this._stream(last, streamDeadlineMs, watches), watches, after, resumption);
  }

  /** One WatchEvents stream of the lane (events.streamEvents), among a tail's `watches`. */
  async *_stream(afterSeq, deadlineMs, watches) {
    const metadata = await this._metadata(null, deadlineMs);
    if (watches.closed) return;
    const call = this._stub.WatchEvents({ lane: this.lane, after_seq: afterSeq.toString() }, metadata);
    yield* events.streamEvents(call, watches, deadlineMs);
  }

  /**
   * One model call, booked: reserves with a fresh reservation id, runs `fn`
   * only when admitted, then settles or refunds by the outcome table
   * (outcomes.js). Resolves with a Denied (fn not run) or a Completed; when
   * `fn` throws, the booking is ended first and the error is rethrown. When
   * `fn` reports nothing (resolves with undefined or null), the booking is
   * settled UNKNOWN, at its hold, with a warning to the logger, and call()
   * resolves with the Completed as usual (the Python client's model_call does
   * the same for a block that reports no outcome).
   * Its Reserve and its Settle or Refund carry one trace context, taken when
   * call() starts: `request.traceparent` when valid, else the active
   * OpenTelemetry context (see tracing.js), else a new trace of its own.
   *
   * When the ledger cannot be reached (isLedgerUnavailable), the lane's outage
   * mode answers instead: a Denied with reason LEDGER_UNAVAILABLE (deny), or a
   * call admitted on the allowance and journaled before `fn` runs (its
   * booking's `source` is "allowance"), or a Denied with ALLOWANCE_EXHAUSTED.
   * @param {import('../index').CallRequest} request
   * @param {(booking: import('../index').CallBooking) => Promise<import('../index').CallReport>} fn
   * @returns {Promise<Denied|Completed>}
   */
  async call(request, fn) {
    checkRequest(request, 'call', 'CallRequest');
    if (typeof fn !== 'function') throw new TypeError('call() needs a function that makes the model call');
    // Taken now, before any await: the caller's context, shared by every ledger call of this one.
    const trace = traceHeaders(request) ?? freshTraceHeaders();
    // A caller that must tag its provider request with the id first passes one.
    const reservationId = request.reservationId ?? newReservationId();
    // Every argument the ledger would refuse, refused before anything is
    // booked or journaled, with the InvalidArgument it would send.
    checkReserve({ ...request, reservationId });
    const replayer = this._replayer;
    // Before anything is journaled, so the replayer never takes this call for
    // the orphan of a dead process.
    // A closed client sends nothing, and it is the lane's mistake, not an
    // outage: no outage mode answers it.
    this._refuseClosed();
    const held = replayer?.hold(reservationId);
    const enclosing = { client: this, running: null };
    const running = enclosingCalls.run([...(enclosingCalls.getStore() ?? []), enclosing], async () => {
      try {
        await held;
        return await this._call({ ...request, reservationId }, fn, trace);
      } finally {
        replayer?.release(reservationId);
      }
    });
    enclosing.running = running;
    // close() waits for it: a call under way when the lane closes is ended, not cut off.
    this._calls.add(running);
    try {
      return await running;
    } finally {
      this._calls.delete(running);
    }
  }

  async _call(request, fn, trace) {
    const { reservationId } = request;
    if (this._callIds.get(reservationId) === true) throw usedByCall(reservationId);
    this._refuseRefundedInDoubt(reservationId);
    const unclear = await this._clearRefund(reservationId, trace);
    if (unclear !== null) return unclear;
    let booking;
    let outageError = null;
    const sent = { inDoubt: false };
    try {
      const answer = await this._reserveResending(request, trace, sent);
      if (answer instanceof Denied) return answer; // the id's refund has no answer yet
      if (!answer.admitted) return new Denied(answer);
      // The booking is another call's, left to it (nothing is ended here).
      if (answer.alreadyReserved && !this._takesOverEarlierReserve(reservationId, sent)) throw reservedByAnotherCall(reservationId);
      this._callIds.add(reservationId);
      await this._supersedeInDoubt(reservationId);
      this._wakeReplayer();
      booking = { ...answer, source: CallSource.LEDGER };
    } catch (error) {
      if (!isLedgerUnavailable(error)) {
        await this._forgetUnanswered(request, trace, error, sent.inDoubt);
        throw error;
      }
      const admitted = await this._reserveInOutage(request, trace, error, sent.inDoubt);
      if (admitted instanceof Denied) return admitted;
      booking = admitted;
      outageError = error;
    }

    let report;
    let value;
    let thrown = null;
    try {
      value = await fn(booking);
      report = reportOf(value);
      if (report.nothingReported) {
        this._logger?.warn(`ledger: the callback of call ${reservationId} reported no outcome: settled UNKNOWN, at its hold`);
      }
    } catch (error) {
      thrown = error;
      report = reportOfError(error);
    }
    let move = endingOf(report);
    let ended = null;
    let ledgerError = outageError;
    let journaled = false;
    const ending = (async () => {
      if (booking.source === CallSource.ALLOWANCE) {
        journaled = await this._endOnAllowance(reservationId, move);
        return;
      }
      const result = await this._endAtLedger(request, booking.holdNanos, move, trace);
      ({ move, ended, journaled } = result);
      ledgerError = result.ledgerError;
    })();
    // close() waits for it: a call that has returned is ended, not cut off.
    this._endings.add(ending);
    try {
      await ending;
    } finally {
      this._endings.delete(ending);
    }
    if (thrown !== null) {
      // The caller needs its own error; the ledger's failure rides along on it.
      if (ledgerError !== null && typeof thrown === 'object' && Object.isExtensible(thrown)) {
        thrown.ledgerError = ledgerError;
      }
      throw thrown;
    }
    return new Completed({
      reservationId,
      ending: move.ending,
      value,
      holdNanos: booking.holdNanos,
      chargedNanos: ended === null ? null : ended.chargedNanos,
      balance: ended === null ? null : ended.balance,
      ledgerError,
      source: booking.source,
      journaled,
    });
  }

  /**
   * Ends an admitted call's booking at the ledger with `move`: journaled when
   * the ledger cannot be reached or stays too busy (a retryable error after the
   * last attempt), or the ending could not be sent; logged when refused. Resolves with the move made, the ledger's answer (or null),
   * its error (or null) and whether the ending was journaled; never rejects
   * for the ledger's trouble.
   */
  async _endAtLedger(request, holdNanos, move, trace) {
    const { reservationId } = request;
    try {
      return { move, ended: await this._end(reservationId, move, trace), ledgerError: null, journaled: false };
    } catch (error) {
      if (move.ending === Ending.SUCCEEDED && settlesUnknownAfterRefusal(error)) {
        return this._settleRefusedUsage(request, holdNanos, move, trace, error);
      }
      let journaled = false;
      // Unanswered after the last attempt: the ledger unreachable, or too busy (TOO_MANY_CALLS).
      if (error instanceof LedgerError && error.retryable) journaled = await this._journalEnding(request, holdNanos, move, trace);
      else if (error instanceof ClientClosed) {
        // close() cut the ending off once its grace was over: journaled while the journal is open.
        this._logger?.warn(`ledger: the client closed before booking ${reservationId} was ended`);
        if (this._journal?.isOpen) journaled = await this._journalEnding(request, holdNanos, move, trace);
      } else if (!(error instanceof LedgerError)) {
        // Never sent: the lane's grant function failed. The ledger saw nothing, so replay it later.
        this._logger?.warn(`ledger: the ending of booking ${reservationId} could not be sent (${error?.message ?? error})`);
        journaled = await this._journalEnding(request, holdNanos, move, trace);
      }
      // A refusal leaves the booking open to expire at its hold: say so, as the Python client does.
      else this._logger?.error(`ledger: the ledger refused to end booking ${reservationId} (${error.reason || error.message})`);
      return { move, ended: null, ledgerError: error, journaled };
    }
  }

  /**
   * The paid call happened, but the ledger refused its usage (more output than
   * the max, no input tokens, ...), so its real cost cannot be booked from it:
   * settled UNKNOWN at once, at most the cap, rather than left open to expire
   * (at the lane's expireCharge, which may be zero). call() and ledgerFetch
   * both end here (the Python client's ModelCall._settle_refused_usage). The
   * refusal is the Completed's ledgerError; an UNKNOWN that gets no answer is
   * journaled as any ending.
   */
  async _settleRefusedUsage(request, holdNanos, move, trace, refusal) {
    const why = refusal.reason || refusal.name;
    this._logger?.warn(`ledger: the ledger refused the usage of booking ${request.reservationId} (${why}): settled UNKNOWN, at most its cap`);
    const unknown = { ...move, ending: Ending.UNKNOWN, usage: null };
    return { ...(await this._endAtLedger(request, holdNanos, unknown, trace)), ledgerError: refusal };
  }

  /**
   * The call's Reserve, sent again (the same request: the ledger answers a
   * repeat with its first answer) after a retryable error, as an ending is,
   * but all within one deadlineMs from the first send, so a lost answer costs
   * no refund when the ledger answers in time. DEADLINE_EXCEEDED means that
   * time is spent. Before each resend the id is cleared again: a refund of it
   * (another call's, under the same id) may have ended its booking since; its
   * outage Denied is then the answer. `sent.inDoubt` says whether an attempt
   * may have booked it (a later refusal does not undo that).
   */
  async _reserveResending(request, trace, sent) {
    const deadline = Date.now() + this.deadlineMs;
    for (let attempt = 1; ; attempt += 1) {
      try {
        return await this._reserve(request, trace, Math.max(deadline - Date.now(), MIN_RESEND_MS));
      } catch (error) {
        if (!(error instanceof LedgerError)) throw error;
        sent.inDoubt = sent.inDoubt || error.mayHaveApplied;
        const pauseMs = END_RETRY_PAUSE_MS * attempt;
        if (
          !resendsReserve(error) ||
          attempt >= this.endAttempts ||
          deadline - Date.now() - pauseMs < MIN_RESEND_MS
        ) {
          throw error;
        }
        await pause(pauseMs);
      }
      try {
        this._refuseRefundedInDoubt(request.reservationId);
        const unclear = await this._clearRefund(request.reservationId, trace, Math.max(deadline - Date.now(), MIN_RESEND_MS));
        if (unclear !== null) return unclear;
      } catch (error) {
        // That refund (under way, or done) ends what the Reserves booked.
        sent.inDoubt = false;
        throw error;
      }
    }
  }

  /**
   * A refund of an unanswered Reserve of this id may have ended the booking a
   * Reserve would now be admitted to (BackgroundRefunds.clear): rejects with
   * ReservationIdReused when it did. When that cannot be known, the lane falls
   * back (a LEDGER_UNAVAILABLE Denied), whatever its outage mode: a call on
   * the allowance under this id could not be settled either. Else null.
   */
  async _clearRefund(reservationId, trace, deadlineMs = this.deadlineMs) {
    try {
      await this._refunds.clear(() => this._refundUnanswered(reservationId, trace), reservationId, deadlineMs);
      return null;
    } catch (error) {
      if (!isLedgerUnavailable(error)) throw error;
      const message =
        `a refund of reservation ${reservationId} has no answer yet (${error.message}): ` +
        'send the call again later, or under a new reservation id';
      return outageDenial(reservationId, DenialReason.LEDGER_UNAVAILABLE, message, error);
    }
  }

  _refundUnanswered(reservationId, trace) {
    return this._refund({ reservationId, reason: UNANSWERED_REASON }, trace);
  }

  // The outage mode ------------------------------------------------------------

  /** The allowance's booking for this call, or the Denied of the outage mode. */
  async _reserveInOutage(request, trace, error, inDoubt = false) {
    const { reservationId } = request;
    let reason = DenialReason.LEDGER_UNAVAILABLE;
    let message = 'the ledger is unreachable and this lane fails closed';
    if (this._allowance !== null) {
      const verdict = await this._allowance.take(this.lane, request, traceIdOf(trace?.traceparent) ?? '');
      if (verdict.admitted) return allowanceBooking(reservationId, verdict);
      reason = verdict.denialReason;
      message = verdict.message;
    }
    // The Reserve may have reached the ledger without its answer reaching us.
    await this._forgetUnanswered(request, trace, error, inDoubt);
    return outageDenial(reservationId, reason, message, error);
  }

  /**
   * The Reserve got no answer and the call will not be made, but the ledger
   * may hold a booking for it: refund it, so that it costs nothing instead of
   * expiring at its hold. With a journal the refund is journaled (in doubt)
   * and replayed; without one it is sent in the background, off the
   * call's path. `inDoubt`: an earlier attempt of the Reserve may have booked it.
   */
  async _forgetUnanswered(request, trace, error, inDoubt = false) {
    if (error instanceof ClientClosed && (error.mayHaveApplied || inDoubt)) {
      // close() cut the Reserve off: the channel is closed, so its refund can
      // only be journaled in doubt, for the next start.
      await this._journalInDoubt(request, trace);
      return;
    }
    if (!((error instanceof LedgerError && error.mayHaveApplied) || inDoubt)) return;
    const { reservationId } = request;
    this._callIds.add(reservationId, false);
    if (await this._journalInDoubt(request, trace)) return;
    this._refunds.send(() => this._refundUnanswered(reservationId, trace), reservationId);
  }

  async _journalInDoubt(request, trace) {
    const journal = this._journal;
    if (journal === null || !journal.isOpen) return false;
    try {
      const entry = newEntry(this.lane, argumentsOf(request), Source.IN_DOUBT, 0n, { traceId: traceIdOf(trace?.traceparent) ?? '' });
      const refund = { settlement: Settlement.REFUND, httpStatus: 0, usage: null, reason: IN_DOUBT_REASON };
      return await journal.recordInDoubt(entry, refund, MAX_IN_DOUBT_ENTRIES);
    } catch (failure) {
      if (!(isJournalTrouble(failure) || failure instanceof TypeError)) throw failure;
      this._logger?.warn(`ledger journal: could not journal an unanswered reserve: ${failure.message}`);
      return false;
    }
  }

  /**
   * The journal's in-doubt refund of this id has reached the ledger: a Reserve
   * under it would get its first answer, admitted, for a booking that has
   * ended, and the call could never be settled.
   */
  _refuseRefundedInDoubt(reservationId) {
    const entry = this._journal?.isOpen ? this._journal.entry(reservationId) : null;
    if (entry?.source === Source.IN_DOUBT && entry.replay === ReplayResult.LANDED) {
      throw refundedAfterUnanswered(reservationId);
    }
  }

  /**
   * Whether the earlier Reserve a repeated answer comes from is one this
   * client sent for no model call: this call's own attempt whose answer was
   * lost (`sent.inDoubt`), or an earlier call's that went unanswered
   * (remembered, or journaled in doubt by this process or one before it).
   */
  _takesOverEarlierReserve(reservationId, sent) {
    return sent.inDoubt || this._callIds.get(reservationId) === false || this._inDoubtEntry(reservationId);
  }

  /** Whether an unanswered Reserve of this id, for a call never made, is journaled in doubt, its refund not yet sent. */
  _inDoubtEntry(reservationId) {
    const journal = this._journal;
    if (journal === null || !journal.isOpen) return false;
    const entry = journal.pending().find((pending) => pending.reservationId === reservationId);
    return entry !== undefined && entry.source === Source.IN_DOUBT;
  }

  /**
   * An earlier Reserve of this id went unanswered and was journaled in doubt,
   * to be refunded. Admitted now, the booking is this call's to end: the
   * refund would end it behind the call's back.
   */
  async _supersedeInDoubt(reservationId) {
    if (!this._inDoubtEntry(reservationId)) return;
    const journal = this._journal;
    try {
      await journal.recordReplay(reservationId, ReplayResult.SUPERSEDED, SUPERSEDED_DETAIL);
    } catch (failure) {
      if (!isJournalTrouble(failure)) throw failure;
      this._logger?.warn(`ledger journal: could not mark ${reservationId} superseded: ${failure.message}`);
    }
  }

  /** Journals the ending of a call the ledger admitted but could not be told about. */
  async _journalEnding(request, holdNanos, move, trace) {
    const journal = this._journal;
    if (journal === null) {
      this._logger?.warn(`ledger: could not end booking ${request.reservationId} and there is no journal: it will expire`);
      return false;
    }
    try {
      const entry = newEntry(this.lane, argumentsOf(request), Source.LEDGER, holdNanos, { traceId: traceIdOf(trace?.traceparent) ?? '' });
      await journal.recordReserve(entry);
      await journal.recordEnd(entry.reservationId, journalEndingOf(move), 0n);
      return true;
    } catch (failure) {
      if (!(isJournalTrouble(failure) || failure instanceof TypeError)) throw failure;
      this._logger?.error(`ledger journal: could not journal the ending of ${request.reservationId}: ${failure.message}`);
      return false;
    }
  }

  async _endOnAllowance(reservationId, move) {
    try {
      await this._allowance.recordEnd(reservationId, journalEndingOf(move));
      return true;
    } catch (failure) {
      // The replay ends it UNKNOWN (an orphan), charged at the hold: never under-booked.
      if (!(isJournalTrouble(failure) || failure instanceof TypeError)) throw failure;
      this._logger?.error(`ledger journal: could not journal the ending of ${reservationId}: ${failure.message}`);
      return false;
    }
  }

  _wakeReplayer() {
    if (this._replayer !== null && this._journal.isOpen && this._journal.pending().length > 0) this._replayer.wake();
  }

  async _end(reservationId, move, trace) {
    for (let attempt = 1; ; attempt += 1) {
      try {
        return await this._endOnce(reservationId, move, trace);
      } catch (error) {
        if (!(error instanceof LedgerError && error.retryable) || attempt >= this.endAttempts) throw error;
        await pause(END_RETRY_PAUSE_MS * attempt);
      }
    }
  }

  async _endOnce(reservationId, move, trace, deadlineMs) {
    if (move.ending === Ending.REFUND) {
      const refund = { reservationId, httpStatus: move.httpStatus, reason: move.reason };
      const { balance } = await this._refund(refund, trace, deadlineMs);
      return { chargedNanos: 0n, balance };
    }
    const usage = move.usage ?? {};
    const settle = {
      reservationId,
      outcome: move.ending,
      inputTokens: usage.inputTokens ?? 0,
      outputTokens: usage.outputTokens ?? 0,
      billedNanos: usage.billedNanos ?? undefined,
      cachedInputTokens: usage.cachedInputTokens ?? 0,
      cacheWriteTokens: usage.cacheWriteTokens ?? 0,
      httpStatus: move.httpStatus,
    };
    return this._settle(settle, trace, deadlineMs);
  }
}

module.exports = {
  LaneClient,
  Denied,
  Completed,
  DEFAULT_DEADLINE_MS,
  DEFAULT_END_ATTEMPTS,
  DEFAULT_MAX_CALLS_IN_FLIGHT,
  CLOSE_JOURNAL_WAIT_MS,
  DEFAULT_CLOSE_GRACE_MS,
  refusesClientCertificate,
  isLocalAddress,
  MAX_IN_DOUBT_ENTRIES,
  MAX_BACKGROUND_REFUNDS,
  MAX_PENDING_REFUNDS,
  MAX_ENDED_IDS,
  UNANSWERED_REFUND_ATTEMPTS,
  UNANSWERED_REFUND_PAUSE_MS,
};
