'use strict';
// The lane's history: its events, listed a page at a time or tailed as they
// are committed (ListEvents and WatchEvents, docs/semantics.md "Audit"). The
// Python client's ledger_client/events.py.
//
// A tail follows the server's sequence numbers: a stream that drops is opened
// again after the last event it gave, so the caller never sees an event twice
// and never misses one (the server's streams never skip a seq still committing).

const { checkRange, invalidArgument } = require('./arguments');
const grpc = require('@grpc/grpc-js');
const { DeadlineExceeded, LedgerError, ledgerErrorOf } = require('./errors');
const { eventOf } = require('./wire');

// A page of events: the server's default and most (its default_page_size and
// max_page_size, docs/semantics.md "Input limits"); a larger page is refused
// here, as the server would cut it short in silence. The Python client's
// DEFAULT_PAGE_SIZE and MAX_PAGE_SIZE.
const DEFAULT_PAGE_SIZE = 100;
const MAX_PAGE_SIZE = 1000;
const MAX_SEQ = 2n ** 63n - 1n;
// How long a tail whose stream dropped goes on opening another, without one
// that answers (the Python client's watch_resume_seconds); 0: never.
const DEFAULT_WATCH_RESUME_MS = 30_000;
const MAX_WATCH_RESUME_MS = 3_600_000;
// What streamEvents yields once the server has accepted the stream.
const ANSWERED = Symbol('answered');

/** A position in the log: a BigInt (from a BigInt, a safe integer or a decimal string). */
function checkAfterSeq(afterSeq) {
  return checkRange('after_seq', afterSeq, 0n, MAX_SEQ);
}

function checkPageSize(pageSize) {
  if (!Number.isSafeInteger(pageSize)) throw invalidArgument('page_size', `must be an integer between 1 and ${MAX_PAGE_SIZE}`);
  if (pageSize < 1 || pageSize > MAX_PAGE_SIZE) throw invalidArgument('page_size', `must be between 1 and ${MAX_PAGE_SIZE}`);
  return pageSize;
}

function checkWatchResumeMs(value) {
  if (typeof value !== 'number' || !(value >= 0 && value <= MAX_WATCH_RESUME_MS)) {
    throw new RangeError(`watchResumeMs must be a number of milliseconds in [0, ${MAX_WATCH_RESUME_MS}]`);
  }
  return value;
}

/** A page's events and the cursor for the next one (null: no more right now). */
function pageOf(response) {
  const events = response.events.map(eventOf);
  const more = Boolean(response.next_page_token) && events.length > 0;
  return { events, nextAfterSeq: more ? events[events.length - 1].seq : null };
}

/** Every event after `afterSeq`, page after page, to the log's end as it stands. */
async function* allPages(page, afterSeq) {
  let cursor = afterSeq;
  while (cursor !== null) {
    const listed = await page(cursor);
    yield* listed.events;
    cursor = listed.nextAfterSeq;
  }
}

/**
 * Event streams that are open: close() cancels them all and wakes a tail
 * waiting to resume. A client's holds one child per tail (tailOf), closed
 * with it or by that tail's return() alone.
 */
class Watches {
  constructor(parent = null) {
    this.closed = false;
    this._calls = new Set();
    this._sleepers = new Set();
    this._children = new Set();
    this._parent = parent;
  }

  /** The streams of one tail: closed with these, or alone. */
  child() {
    const child = new Watches(this);
    if (this.closed) child.close();
    else this._children.add(child);
    return child;
  }

  /** Counts an open stream in; false (and cancelled) once closed. */
  add(call) {
    if (this.closed) {
      call.cancel();
      return false;
    }
    this._calls.add(call);
    return true;
  }

  discard(call) {
    this._calls.delete(call);
    call.cancel();
  }

  close() {
    this.closed = true;
    for (const call of this._calls) call.cancel();
    this._calls.clear();
    for (const wake of this._sleepers) wake();
    for (const child of this._children) child.close();
    this._parent?._children.delete(this);
  }

  /** Waits `ms`; resolves true when the client closed meanwhile. */
  pause(ms) {
    if (this.closed) return Promise.resolve(true);
    return new Promise((resolve) => {
      const wake = () => {
        clearTimeout(timer);
        this._sleepers.delete(wake);
        resolve(true);
      };
      const timer = setTimeout(() => {
        this._sleepers.delete(wake);
        resolve(false);
      }, ms);
      this._sleepers.add(wake);
    });
  }
}

/**
 * The events after `afterSeq`, then each one as it is committed, for as long
 * as the caller iterates. `openStream(after)` opens one stream; a retryable
 * failure (the error table's) opens another after the last event seen,
 * pausing `firstPauseMs`, doubling up to `mostPauseMs`, until `forMs` passed
 * since the drop with no stream answering; any other failure is thrown. Ends
 * when the client closes.
 */
async function* tail(openStream, watches, afterSeq, { forMs, firstPauseMs, mostPauseMs }) {
  let last = afterSeq;
  let pauseMs = firstPauseMs;
  let failingSince = null;
  while (!watches.closed) {
    try {
      for await (const event of openStream(last)) {
        pauseMs = firstPauseMs;
        failingSince = null;
        if (event === ANSWERED) continue;
        last = event.seq;
        yield event;
      }
    } catch (error) {
      if (watches.closed) return;
      failingSince ??= Date.now();
      if (!(error instanceof LedgerError && error.retryable) || Date.now() - failingSince >= forMs) throw error;
    }
    if (await watches.pause(pauseMs)) return;
    pauseMs = Math.min(pauseMs * 2, mostPauseMs);
  }
}

/**
 * A tail over `watches` (a child of the client's, its own), whose return()
 * stops it at once: a generator's own return() waits for a next() under way,
 * which on a quiet lane is the next event, its stream held open until then.
 * Closing its streams ends that next() (done), and the return() after it.
 */
function tailOf(openStream, watches, afterSeq, resumption) {
  const generator = (async function* owned() {
    try {
      yield* tail(openStream, watches, afterSeq, resumption);
    } finally {
      watches.close(); // ended however it did: the client holds it no more
    }
  })();
  const ownReturn = generator.return.bind(generator);
  generator.return = (value) => {
    watches.close();
    return ownReturn(value);
  };
  return generator;
}

/**
 * One open WatchEvents stream (a grpc-js readable, read as the caller asks:
 * bounded by its buffer): ANSWERED once the server accepts it (it sends its
 * headers at once), then its events. A stream not answered within
 * `deadlineMs` is cancelled, taken for an outage. Cancelled too when the
 * caller stops.
 */
async function* streamEvents(call, watches, deadlineMs) {
  let failure = null;
  call.on('error', (error) => {
    failure = error;
  });
  if (!watches.add(call)) return;
  // Cancelled by this client, not the lane: said as the deadline it is.
  let late = false;
  const timer = setTimeout(() => {
    late = true;
    call.cancel();
  }, deadlineMs);
  try {
    const answered = await new Promise((resolve) => {
      call.once('metadata', () => resolve(true));
      call.once('close', () => resolve(false));
      call.once('error', () => resolve(false));
    });
    clearTimeout(timer);
    if (answered) yield ANSWERED;
    for await (const message of call) yield eventOf(message);
    if (failure !== null) throw failure;
  } catch (error) {
    if (late) {
      throw new DeadlineExceeded(`the ledger did not accept the event stream within its deadlineMs (${deadlineMs} ms)`, {
        code: grpc.status.DEADLINE_EXCEEDED,
        cause: error,
      });
    }
    throw typeof error?.code === 'number' ? ledgerErrorOf(error) : error;
  } finally {
    clearTimeout(timer);
    watches.discard(call);
  }
}

module.exports = {
  ANSWERED,
  DEFAULT_PAGE_SIZE,
  DEFAULT_WATCH_RESUME_MS,
  MAX_PAGE_SIZE,
  Watches,
  allPages,
  checkAfterSeq,
  checkPageSize,
  checkWatchResumeMs,
  pageOf,
  streamEvents,
  tail,
  tailOf,
};
