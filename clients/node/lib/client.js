'use strict';

const { randomUUID } = require('node:crypto');
const grpc = require('@grpc/grpc-js');
const { ledgerPackage } = require('./proto');
const { ledgerErrorOf, LedgerError } = require('./errors');
const wire = require('./wire');
const { Ending, endingOf, reportOf, reportOfError } = require('./outcomes');
const { traceHeaders, freshTraceHeaders, setTraceHeaders } = require('./tracing');

// Why 250 ms: in the recall budget jam (shared/seeds/000_835af494282c4981.txt)
// a 2.0 s step lost 0.8 s to grant and key lookups and 1.0 s to a retry
// reserve, which left the model call itself about 0.3 s. Ledger calls sit on
// that same path, so each one gets a short deadline and fails fast; the lane
// then falls back instead of starving its model call.
const DEFAULT_DEADLINE_MS = 250;
// Settle and Refund are idempotent, so an unconfirmed one is sent again with
// the same content; without this an ended call would expire at its hold.
const DEFAULT_END_ATTEMPTS = 3;
const END_RETRY_PAUSE_MS = 20;

/** A Reserve the ledger denied: the call was not made. */
class Denied {
  constructor(answer) {
    this.admitted = false;
    this.reservationId = answer.reservationId;
    /** "BUDGET_EXHAUSTED" or "HOLD_EXCEEDS_LIMIT". */
    this.reason = answer.denialReason;
    /** The server's sentence for people. */
    this.message = answer.reason;
    /** When enough of the window ages out for this hold to fit; null when it never can. */
    this.retryAfter = answer.retryAfter;
    this.holdNanos = answer.holdNanos;
    this.capNanos = answer.capNanos;
    this.balance = answer.balance;
  }
}

/** An admitted call that ran; how its booking ended. */
class Completed {
  constructor(fields) {
    this.admitted = true;
    Object.assign(this, fields);
  }
}

function pause(milliseconds) {
  return new Promise((resolve) => setTimeout(resolve, milliseconds));
}

function channelCredentials(tls) {
  if (!tls) return grpc.credentials.createInsecure();
  const options = tls === true ? {} : tls;
  const pem = (value) => (value === undefined || value === null ? null : Buffer.from(value));
  return grpc.credentials.createSsl(pem(options.rootCerts), pem(options.clientKey), pem(options.clientCert));
}

function channelOptions(options) {
  const serverName = options.tls && options.tls !== true ? options.tls.serverName : undefined;
  const extra = serverName
    ? { 'grpc.ssl_target_name_override': serverName, 'grpc.default_authority': serverName }
    : {};
  return { ...extra, ...(options.channelOptions ?? {}) };
}

/**
 * One lane's view of the ledger. Holds one gRPC channel; reuse the instance.
 */
class LaneClient {
  /**
   * @param {string} address host:port of the ledger
   * @param {string} lane the lane's name
   * @param {import('../index').LaneClientOptions} [options]
   */
  constructor(address, lane, options = {}) {
    if (typeof lane !== 'string' || lane === '') throw new TypeError('lane must be a non-empty string');
    this.address = address;
    this.lane = lane;
    this.deadlineMs = options.deadlineMs ?? DEFAULT_DEADLINE_MS;
    this.endAttempts = options.endAttempts ?? DEFAULT_END_ATTEMPTS;
    if (!(this.deadlineMs > 0)) throw new RangeError('deadlineMs must be positive');
    if (!(Number.isInteger(this.endAttempts) && this.endAttempts >= 1)) {
      throw new RangeError('endAttempts must be an integer of at least 1');
    }
    this._grant = options.grant ?? null;
    const { Ledger } = ledgerPackage();
    this._stub = new Ledger(address, channelCredentials(options.tls), channelOptions(options));
  }

  /** Resolves once the channel is connected (call it at start-up, off the hot path). */
  waitForReady(timeoutMs = 5000) {
    return new Promise((resolve, reject) => {
      this._stub.waitForReady(Date.now() + timeoutMs, (error) => (error ? reject(error) : resolve()));
    });
  }

  /** Closes the channel. */
  close() {
    this._stub.close();
  }

  async _metadata(trace) {
    const metadata = new grpc.Metadata();
    if (this._grant !== null) {
      const grant = typeof this._grant === 'function' ? await this._grant() : this._grant;
      if (grant) metadata.set('authorization', `Bearer ${grant}`);
    }
    setTraceHeaders(metadata, trace);
    return metadata;
  }

  /** `trace`: the W3C headers to send ({traceparent, tracestate?}), or null for none. */
  async _unary(method, request, trace) {
    const metadata = await this._metadata(trace);
    return new Promise((resolve, reject) => {
      const deadline = Date.now() + this.deadlineMs;
      this._stub[method](request, metadata, { deadline }, (error, response) => {
        if (error) reject(ledgerErrorOf(error));
        else resolve(response);
      });
    });
  }

  /**
   * Books a hold for one planned call, or is denied (a denial is an answer,
   * not an error). A retry with the same reservationId returns the first answer.
   * @param {import('../index').ReserveRequest} request
   * @returns {Promise<import('../index').ReserveResult>}
   */
  async reserve(request) {
    return this._reserve(request, traceHeaders(request));
  }

  async _reserve({ reservationId, model, requestBytes, maxOutputTokens, estimateNanos, ttlMs }, trace) {
    const message = {
      lane: this.lane,
      reservation_id: reservationId,
      model,
      request_bytes: wire.int64(requestBytes, 'requestBytes'),
      max_output_tokens: wire.int64(maxOutputTokens, 'maxOutputTokens'),
      estimate_nanos: wire.optionalInt64(estimateNanos, 'estimateNanos'),
      ttl: ttlMs === undefined || ttlMs === null ? undefined : wire.durationOfMs(ttlMs, 'ttlMs'),
    };
    return wire.reserveResultOf(await this._unary('Reserve', message, trace), reservationId);
  }

  /**
   * Ends a booking with the call's outcome: SUCCEEDED with usage (the real
   * cost) or UNKNOWN (the hold, or a lower billedNanos).
   * @param {import('../index').SettleRequest} request
   * @returns {Promise<import('../index').SettleResult>}
   */
  async settle(request) {
    return this._settle(request, traceHeaders(request));
  }

  async _settle(request, trace) {
    const { reservationId, outcome, inputTokens = 0, outputTokens = 0, billedNanos, httpStatus = 0 } = request;
    const { cachedInputTokens = 0, cacheWriteTokens = 0 } = request;
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
    return wire.settleResultOf(await this._unary('Settle', message, trace));
  }

  /**
   * Ends a booking whose call was refused (httpStatus 4xx) or never sent
   * (httpStatus 0 and a reason). It costs zero.
   * @param {import('../index').RefundRequest} request
   * @returns {Promise<{balance: import('../index').Balance}>}
   */
  async refund(request) {
    return this._refund(request, traceHeaders(request));
  }

  async _refund({ reservationId, httpStatus = 0, reason = '' }, trace) {
    const message = {
      lane: this.lane,
      reservation_id: reservationId,
      http_status: wire.int64(httpStatus, 'httpStatus'),
      reason,
    };
    const response = await this._unary('Refund', message, trace);
    return { balance: wire.balanceOf(response.balance) };
  }

  /**
   * @param {import('../index').TraceOptions} [options]
   * @returns {Promise<import('../index').Balance>}
   */
  async balance(options) {
    return wire.balanceOf(await this._unary('GetBalance', { lane: this.lane }, traceHeaders(options)));
  }

  /**
   * @param {string} reservationId
   * @param {import('../index').TraceOptions} [options]
   * @returns {Promise<import('../index').Booking>}
   */
  async booking(reservationId, options) {
    const message = { lane: this.lane, reservation_id: reservationId };
    return wire.bookingOf(await this._unary('GetBooking', message, traceHeaders(options)));
  }

  /**
   * One model call, booked: reserves with a fresh reservation id, runs `fn`
   * only when admitted, then settles or refunds by the outcome table
   * (outcomes.js). Resolves with a Denied (fn not run) or a Completed; when
   * `fn` throws, the booking is ended first and the error is rethrown.
   * Its Reserve and its Settle or Refund carry one trace context, taken when
   * call() starts: `request.traceparent` when valid, else the active
   * OpenTelemetry context (see tracing.js), else a new trace of its own.
   * @param {import('../index').CallRequest} request
   * @param {(booking: import('../index').ReserveResult) => Promise<import('../index').CallReport>} fn
   * @returns {Promise<Denied|Completed>}
   */
  async call(request, fn) {
    if (typeof fn !== 'function') throw new TypeError('call() needs a function that makes the model call');
    // Taken now, before any await: the caller's context, shared by every ledger call of this one.
    const trace = traceHeaders(request) ?? freshTraceHeaders();
    const reservationId = randomUUID();
    const answer = await this._reserveOrForget({ ...request, reservationId }, trace);
    if (!answer.admitted) return new Denied(answer);

    let report;
    let value;
    let thrown = null;
    try {
      value = await fn(answer);
      report = reportOf(value);
    } catch (error) {
      thrown = error;
      report = reportOfError(error);
    }
    const move = endingOf(report);
    let ended = null;
    let ledgerError = null;
    try {
      ended = await this._end(reservationId, move, trace);
    } catch (error) {
      ledgerError = error;
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
      holdNanos: answer.holdNanos,
      chargedNanos: ended === null ? null : ended.chargedNanos,
      balance: ended === null ? null : ended.balance,
      ledgerError,
    });
  }

  async _reserveOrForget(request, trace) {
    try {
      return await this._reserve(request, trace);
    } catch (error) {
      // The hold may have been booked although no answer came back: refund
      // it, since the call will not be made. Without this it would expire
      // and could be charged at the hold for a call that never happened.
      if (error instanceof LedgerError && error.mayHaveApplied) {
        const forget = { reservationId: request.reservationId, reason: 'not sent: the Reserve went unanswered' };
        await this._refund(forget, trace).catch(() => undefined);
      }
      throw error;
    }
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

  async _endOnce(reservationId, move, trace) {
    if (move.ending === Ending.REFUND) {
      const refund = { reservationId, httpStatus: move.httpStatus, reason: move.reason };
      const { balance } = await this._refund(refund, trace);
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
    return this._settle(settle, trace);
  }
}

module.exports = { LaneClient, Denied, Completed, DEFAULT_DEADLINE_MS, DEFAULT_END_ATTEMPTS };
