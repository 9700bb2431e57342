'use strict';
// Replays the journal to the ledger, with the original reservation ids (the
// same rules as the Python client's clients/python/ledger_client/replay.py).
//
// The ledger answers a repeated Reserve, Settle or Refund with its first
// answer, so replaying an entry twice (a crash between the ledger's answer and
// the journal's `replayed` line) books nothing twice. Each attempt is bounded
// in entries and time and stops at the first sign that the ledger is
// unreachable; the next attempt resumes from the journal, which records every
// acknowledged entry.

const { status: Status } = require('@grpc/grpc-js');
const {
  LedgerError,
  InternalError,
  BookingAlreadyEnded,
  BookingNotFound,
  BookingWasDenied,
  Unauthenticated,
  PermissionDenied,
  isLedgerUnavailable,
} = require('./errors');
const { Source, ReplayResult, Settlement } = require('./journal');
const { GrantError } = require('./arguments');

const ORPHAN_REASON = 'the lane stopped before the call\'s outcome was known';

/** A call the ledger admitted whose lane process died before it journaled an ending. */
function isOrphan(entry) {
  const { ending } = entry;
  return (
    entry.source === Source.LEDGER &&
    ending !== null &&
    ending.settlement === Settlement.SETTLE_UNKNOWN &&
    ending.reason === ORPHAN_REASON
  );
}
const IN_DOUBT_REASON = 'the ledger did not answer the reserve; the call was not made';

// The defaults and bounds of the replay's settings (LaneClientOptions).
const REPLAY_DEFAULTS = Object.freeze({
  /** Deadline of each RPC of the replay, which runs off the call path. */
  replayDeadlineMs: 2000,
  /** One attempt handles at most this many entries... */
  maxReplayEntriesPerAttempt: 100,
  /** ...and stops after this long; the next attempt resumes where it stopped. */
  maxReplayMsPerAttempt: 10_000,
  /** How often the background replayer looks at the journal (null: never; call replayJournal()). */
  replayIntervalMs: 5000,
});
// A wake (the ledger admitted a Reserve while the journal has entries) starts
// an attempt at most this often.
const MIN_WAKE_GAP_MS = 1000;

/** The replay's settings from a client's options, checked. */
function replaySettingsOf(options = {}) {
  const settings = {};
  for (const [name, fallback] of Object.entries(REPLAY_DEFAULTS)) {
    settings[name] = options[name] === undefined ? fallback : options[name];
  }
  const within = (name, low, high, integer = false) => {
    const value = settings[name];
    const ok = typeof value === 'number' && value >= low && value <= high && (!integer || Number.isInteger(value));
    if (!ok) throw new RangeError(`${name} must be ${integer ? 'an integer ' : ''}in [${low}, ${high}]`);
  };
  within('replayDeadlineMs', 1, 60_000);
  within('maxReplayEntriesPerAttempt', 1, 10_000, true);
  within('maxReplayMsPerAttempt', 1, 600_000);
  if (settings.replayIntervalMs !== null) within('replayIntervalMs', 1, 3_600_000);
  return Object.freeze(settings);
}

const STATUS_NAMES = new Map(Object.entries(Status).map(([name, code]) => [code, name]));

/** Errors that say "not now" rather than "never": the attempt stops and a later one tries again. */
function stopsAttempt(error) {
  return isLedgerUnavailable(error) || error instanceof Unauthenticated || error instanceof PermissionDenied;
}

/** The server failed on this entry (or answered with a status this client does not know): retried later. */
function isFailure(error) {
  return error instanceof InternalError || (error instanceof LedgerError && error.constructor === LedgerError);
}

function emptyReport() {
  return Object.freeze({ landed: 0, denied: 0, absent: 0, rejected: 0, failed: 0, remaining: 0, stoppedEarly: false });
}

class Replayer {
  /**
   * @param {{reserve: Function, end: Function}} ledger the moves: reserve(arguments, traceId, deadlineMs)
   *   and end(reservationId, ending, traceId, deadlineMs), both rejecting with LedgerErrors
   * @param {import('./journal').Journal} journal
   * @param {ReturnType<typeof replaySettingsOf>} settings
   * @param {{warn: Function, error: Function}|null} logger
   */
  constructor(ledger, journal, settings, logger = null) {
    this._ledger = ledger;
    this._journal = journal;
    this._settings = settings;
    this._logger = logger;
    this._inFlight = new Set();
    this._replaying = null; // {reservationId, done}: the entry being sent now
    this._attempts = Promise.resolve();
    this._stopped = false;
    this._intervalMs = null;
    this._timer = null;
    this._running = null;
    this._woken = false;
    this._lastAttemptAt = 0;
  }

  // Calls in progress in this process are not orphans ------------------------

  /**
   * Marks a call's id as in flight: no entry of that id is replayed until it
   * is released (a retry under an id the journal holds in doubt owns its
   * booking). Resolves once an entry of that id being sent now has been.
   */
  hold(reservationId) {
    this._inFlight.add(reservationId);
    const now = this._replaying;
    return now !== null && now.reservationId === reservationId ? now.done : Promise.resolve();
  }

  release(reservationId) {
    this._inFlight.delete(reservationId);
  }

  // One attempt ---------------------------------------------------------------

  /**
   * One bounded attempt: at most maxEntries (capped by maxReplayEntriesPerAttempt).
   * Attempts run one at a time.
   * @returns {Promise<import('../index').ReplayReport>}
   */
  replayOnce(maxEntries) {
    let limit = this._settings.maxReplayEntriesPerAttempt;
    if (maxEntries !== undefined && maxEntries !== null) {
      if (!Number.isSafeInteger(maxEntries)) throw new TypeError('maxEntries must be an integer');
      limit = Math.max(1, Math.min(maxEntries, limit));
    }
    const run = this._attempts.then(() => this._attempt(limit));
    this._attempts = run.catch(() => undefined);
    return run;
  }

  async _attempt(limit) {
    const deadline = Date.now() + this._settings.maxReplayMsPerAttempt;
    const counts = { landed: 0, denied: 0, absent: 0, rejected: 0 };
    let failed = 0;
    let handled = 0;
    let stopped = false;
    try {
      for (const pending of this._journal.pending()) {
        if (handled + failed >= limit || Date.now() >= deadline || this._stopped) {
          stopped = true;
          break;
        }
        // A call of this id is in progress: it owns the booking.
        if (this._inFlight.has(pending.reservationId)) continue;
        // Read afresh: the list is as old as the attempt, and a call of this id
        // may since have ended it, superseded it or journaled it anew (an
        // in-doubt refund replaced by the retry's settle).
        const current = this._journal.entry(pending.reservationId);
        if (current === null || current.replay !== null) continue;
        let finish;
        const done = new Promise((resolve) => { finish = resolve; });
        this._replaying = { reservationId: pending.reservationId, done };
        let entry;
        let result;
        let detail;
        try {
          entry = await this._closed(current);
          [result, detail] = await this._replay(entry);
          await this._journal.recordReplay(entry.reservationId, result, detail);
        } catch (error) {
          if (stopsAttempt(error)) {
            stopped = true;
            break;
          }
          if (isFailure(error)) {
            this._logger?.warn(`ledger journal: the replay of ${pending.reservationId} failed (${error.message}); will retry`);
            failed += 1;
            continue;
          }
          throw error;
        } finally {
          this._replaying = null;
          finish();
        }
        this._logResult(entry, result, detail);
        counts[result] += 1;
        handled += 1;
      }
    } finally {
      this._lastAttemptAt = Date.now();
    }
    const remaining = this._journal.pending().length;
    if (remaining === 0) await this._journal.rotateIfReplayed();
    return Object.freeze({ ...counts, failed, remaining, stoppedEarly: stopped });
  }

  /**
   * An entry with its ending; an orphan (its lane process died during the
   * call) ends UNKNOWN, since the call may have been sent.
   */
  async _closed(entry) {
    if (entry.ending !== null) return entry;
    let ending;
    let charge = 0n;
    if (entry.source === Source.IN_DOUBT) {
      ending = { settlement: Settlement.REFUND, httpStatus: 0, usage: null, reason: IN_DOUBT_REASON };
    } else {
      ending = { settlement: Settlement.SETTLE_UNKNOWN, httpStatus: 0, usage: null, reason: ORPHAN_REASON };
      if (entry.source === Source.ALLOWANCE) charge = entry.localHoldNanos;
    }
    await this._journal.recordEnd(entry.reservationId, ending, charge);
    return this._journal.entry(entry.reservationId);
  }

  /** Sends one entry: [result, detail]; rejects for errors that stop or skip the attempt. */
  async _replay(entry) {
    const deadlineMs = this._settings.replayDeadlineMs;
    const { traceId } = entry;
    try {
      if (entry.source === Source.ALLOWANCE) {
        const reservation = await this._ledger.reserve(entry.arguments, traceId, deadlineMs);
        if (!reservation.admitted) {
          return [ReplayResult.DENIED, String(reservation.denialReason ?? '').toLowerCase()];
        }
      } else if (entry.source === Source.IN_DOUBT) {
        // Only a refund, which needs no more than the lane's charge scope: the
        // ledger says whether there was anything to refund.
        try {
          await this._ledger.end(entry.reservationId, entry.ending, traceId, deadlineMs);
        } catch (error) {
          if (error instanceof BookingNotFound || error instanceof BookingWasDenied) {
            return [ReplayResult.ABSENT, 'the ledger holds nothing for it'];
          }
          throw error;
        }
        return [ReplayResult.LANDED, ''];
      }
      try {
        await this._ledger.end(entry.reservationId, entry.ending, traceId, deadlineMs);
      } catch (error) {
        // The lane's own ending reached the ledger before the process died,
        // unjournaled: the booking has ended as the lane reported.
        if (error instanceof BookingAlreadyEnded && isOrphan(entry)) {
          return [ReplayResult.LANDED, "the ledger holds the lane's own ending"];
        }
        throw error;
      }
    } catch (error) {
      // The lane's grant function gave no grant: nothing is wrong with the entry.
      if (stopsAttempt(error) || isFailure(error) || error instanceof GrantError) throw error;
      if (error instanceof LedgerError) return [ReplayResult.REJECTED, error.reason || STATUS_NAMES.get(error.code) || 'UNKNOWN'];
      // The client cannot even send it (a value the wire refuses): it never will.
      if (error instanceof TypeError || error instanceof RangeError) {
        return [ReplayResult.REJECTED, `the client cannot send it: ${String(error.message).slice(0, 200)}`];
      }
      throw error;
    }
    return [ReplayResult.LANDED, ''];
  }

  _logResult(entry, result, detail) {
    if (result === ReplayResult.DENIED) {
      this._logger?.warn(
        `ledger journal: call ${entry.reservationId} was made on the outage allowance (about ${entry.localChargeNanos} nanos) ` +
          `but the ledger denied its replayed reserve (${detail}): it is spent without a booking`,
      );
    } else if (result === ReplayResult.REJECTED) {
      this._logger?.error(`ledger journal: the ledger refused the replay of ${entry.reservationId} for good: ${detail}`);
    }
  }

  // In the background ---------------------------------------------------------

  /** Looks at the journal every intervalMs (the timer does not keep the process alive). */
  start(intervalMs) {
    if (this._intervalMs !== null) throw new Error('the replayer runs once per client');
    this._intervalMs = intervalMs;
    this._schedule(intervalMs);
  }

  _schedule(delayMs) {
    if (this._timer !== null) clearTimeout(this._timer);
    this._timer = null;
    if (this._stopped) return;
    this._timer = setTimeout(() => this._tick(), delayMs);
    this._timer.unref();
  }

  async _tick() {
    this._timer = null;
    this._woken = false;
    this._running = (async () => {
      try {
        if (this._journal.isOpen && this._journal.pending().length > 0) await this.replayOnce();
      } catch (error) {
        // The replayer must outlive any one bad attempt; the journal keeps
        // everything for the next one.
        this._logger?.error(`ledger journal: a replay attempt failed: ${error?.message ?? error}`);
      }
    })();
    await this._running;
    this._running = null;
    this._schedule(this._woken ? this._wakeDelay() : this._intervalMs);
  }

  _wakeDelay() {
    return Math.max(0, this._lastAttemptAt + MIN_WAKE_GAP_MS - Date.now());
  }

  /** Asks the background replayer to look soon (cheap; never waits). */
  wake() {
    if (this._stopped || this._intervalMs === null) return;
    if (this._running !== null) {
      this._woken = true;
      return;
    }
    this._schedule(this._wakeDelay());
  }

  /** Stops the background replayer; an attempt under way stops at its next entry. */
  stop() {
    this._stopped = true;
    if (this._timer !== null) clearTimeout(this._timer);
    this._timer = null;
  }

  /** Resolves once no attempt is under way. */
  async idle() {
    await this._running;
    await this._attempts;
  }
}

module.exports = {
  Replayer,
  replaySettingsOf,
  emptyReport,
  stopsAttempt,
  REPLAY_DEFAULTS,
  MIN_WAKE_GAP_MS,
  ORPHAN_REASON,
  IN_DOUBT_REASON,
};
