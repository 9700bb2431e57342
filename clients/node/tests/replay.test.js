'use strict';
// The journal replay against an in-memory ledger: bounded, resumable, once
// (clients/python/tests/test_client_replay.py). The real server's side of it
// is in outage-server.test.js.

const { afterEach, beforeEach, describe, test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { randomUUID } = require('node:crypto');
const { status: Status } = require('@grpc/grpc-js');
const {
  Journal,
  Source,
  ReplayResult,
  Settlement,
  Unavailable,
  InternalError,
  ReservationIdReused,
  BookingNotFound,
  BookingAlreadyEnded,
} = require('..');
const { newEntry } = require('../lib/journal');
const { Replayer, replaySettingsOf, ORPHAN_REASON } = require('../lib/replay');

const LANE = 'lane';
const SETTINGS = replaySettingsOf({ replayIntervalMs: null, maxReplayEntriesPerAttempt: 50 });
const SUCCESS = Object.freeze({
  settlement: Settlement.SETTLE_SUCCEEDED,
  httpStatus: 200,
  usage: Object.freeze({ inputTokens: 10n, outputTokens: 10n, billedNanos: null, cachedInputTokens: 0n, cacheWriteTokens: 0n }),
  reason: '',
});

/**
 * The ledger's idempotence, in memory: a repeated Reserve, Settle or Refund
 * gets the first answer; other arguments under an id are a conflict.
 */
class FakeLedger {
  constructor({ limitNanos = 10n ** 12n } = {}) {
    this.limitNanos = limitNanos;
    this.heldNanos = 0n;
    this.bookings = new Map();
    this.events = [];
    this.reachable = true;
    this.callsUntilOutage = null;
    this.failing = new Set();
    this.traces = [];
  }

  _arrive(reservationId) {
    if (this.callsUntilOutage !== null) {
      if (this.callsUntilOutage === 0) this.reachable = false;
      else this.callsUntilOutage -= 1;
    }
    if (!this.reachable) throw new Unavailable('unreachable', { code: Status.UNAVAILABLE });
    if (this.failing.has(reservationId)) throw new InternalError('internal error', { code: Status.INTERNAL, reason: 'INTERNAL' });
  }

  async reserve(args, traceId) {
    this._arrive(args.reservationId);
    this.traces.push(traceId);
    const known = this.bookings.get(args.reservationId);
    const key = JSON.stringify(args, (_key, value) => (typeof value === 'bigint' ? String(value) : value));
    if (known) {
      if (known.key !== key) throw new ReservationIdReused('other arguments', { code: Status.ALREADY_EXISTS, reason: 'RESERVATION_ID_REUSED' });
      return known.answer;
    }
    const hold = args.requestBytes + args.maxOutputTokens;
    const admitted = this.heldNanos + hold <= this.limitNanos;
    const answer = { admitted, denialReason: admitted ? null : 'BUDGET_EXHAUSTED', holdNanos: hold };
    if (admitted) this.heldNanos += hold;
    this.bookings.set(args.reservationId, { key, answer, ending: null, args });
    this.events.push([admitted ? 'reserved' : 'denied', args.reservationId]);
    return answer;
  }

  async end(reservationId, ending) {
    this._arrive(reservationId);
    const booking = this.bookings.get(reservationId);
    if (!booking) throw new BookingNotFound('no such booking', { code: Status.NOT_FOUND, reason: 'BOOKING_NOT_FOUND' });
    if (booking.ending !== null) {
      if (booking.ending.settlement !== ending.settlement) {
        throw new BookingAlreadyEnded('ended otherwise', { code: Status.FAILED_PRECONDITION, reason: 'BOOKING_ALREADY_ENDED' });
      }
      return {};
    }
    booking.ending = ending;
    this.events.push([ending.settlement === Settlement.REFUND ? 'refunded' : 'settled', reservationId]);
    return {};
  }

  eventCounts() {
    const counts = {};
    for (const [kind, id] of this.events) (counts[id] ??= []).push(kind);
    return counts;
  }
}

let directory;
let file;
const opened = [];

beforeEach(() => {
  directory = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-replay-'));
  file = path.join(directory, 'journal.jsonl');
});

afterEach(async () => {
  for (const journal of opened.splice(0)) await journal.close();
  fs.rmSync(directory, { recursive: true, force: true });
});

function open() {
  const journal = new Journal(file, LANE, { maxBytes: 1 << 20, rotateBytes: 1 << 19 });
  opened.push(journal);
  return journal;
}

async function journalCalls(journal, count, { ended = true, source = Source.ALLOWANCE } = {}) {
  const ids = [];
  for (let index = 0; index < count; index += 1) {
    const args = { reservationId: randomUUID(), model: 'model-a', requestBytes: 100n, maxOutputTokens: 10n };
    await journal.recordReserve(newEntry(LANE, args, source, 110n, { traceId: 'ab'.repeat(16) }));
    if (ended) await journal.recordEnd(args.reservationId, SUCCESS, 30n);
    ids.push(args.reservationId);
  }
  return ids;
}

const each = (ids, kinds) => Object.fromEntries(ids.map((id) => [id, kinds]));

describe('the replay', () => {
  test('lands each call with its original id and trace', async () => {
    const fake = new FakeLedger();
    const journal = open();
    const ids = await journalCalls(journal, 3);
    const report = await new Replayer(fake, journal, SETTINGS).replayOnce();
    assert.deepEqual([report.landed, report.remaining, report.stoppedEarly], [3, 0, false]);
    assert.deepEqual(fake.eventCounts(), each(ids, ['reserved', 'settled']));
    assert.deepEqual([...fake.bookings.keys()], ids);
    assert.deepEqual(fake.traces, Array(3).fill('ab'.repeat(16)));
  });

  test('replaying twice books nothing twice', async () => {
    // A crash after the ledger answered but before `replayed` was journaled.
    const fake = new FakeLedger();
    let journal = open();
    const ids = await journalCalls(journal, 3);
    await journal.close();
    const beforeReplay = fs.readFileSync(file);
    journal = open();
    assert.equal((await new Replayer(fake, journal, SETTINGS).replayOnce()).landed, 3);
    await journal.close();
    fs.writeFileSync(file, beforeReplay); // the markers were lost
    journal = open();
    assert.equal((await new Replayer(fake, journal, SETTINGS).replayOnce()).landed, 3);
    assert.deepEqual(journal.pending(), []);
    assert.deepEqual(fake.eventCounts(), each(ids, ['reserved', 'settled']));
  });

  test('an attempt is bounded and the next resumes, in journal order', async () => {
    const fake = new FakeLedger();
    const journal = open();
    const ids = await journalCalls(journal, 5);
    const replayer = new Replayer(fake, journal, SETTINGS);
    const first = await replayer.replayOnce(2);
    assert.deepEqual([first.landed, first.remaining, first.stoppedEarly], [2, 3, true]);
    const second = await replayer.replayOnce(2);
    assert.deepEqual([second.landed, second.remaining], [2, 1]);
    const third = await replayer.replayOnce();
    assert.deepEqual([third.landed, third.remaining, third.stoppedEarly], [1, 0, false]);
    assert.deepEqual(fake.events.filter((_, index) => index % 2 === 0).map(([, id]) => id), ids);
  });

  test('an attempt also stops after maxReplayMsPerAttempt', async () => {
    const fake = new FakeLedger();
    const slow = { reserve: async (...args) => { await new Promise((resolve) => setTimeout(resolve, 30)); return fake.reserve(...args); }, end: (...args) => fake.end(...args) };
    const journal = open();
    await journalCalls(journal, 10);
    const report = await new Replayer(slow, journal, replaySettingsOf({ replayIntervalMs: null, maxReplayMsPerAttempt: 50 })).replayOnce();
    assert.equal(report.stoppedEarly, true);
    assert.ok(report.landed >= 1 && report.landed < 10, `landed ${report.landed}`);
    assert.equal(report.remaining, 10 - report.landed);
  });

  test('an attempt stops when the ledger goes away, and the next resumes', async () => {
    const fake = new FakeLedger();
    const journal = open();
    const ids = await journalCalls(journal, 4);
    fake.callsUntilOutage = 3; // reserve+settle of the first, then the reserve of the second
    const replayer = new Replayer(fake, journal, SETTINGS);
    const report = await replayer.replayOnce();
    assert.deepEqual([report.landed, report.remaining, report.stoppedEarly], [1, 3, true]);
    fake.reachable = true;
    fake.callsUntilOutage = null;
    assert.equal((await replayer.replayOnce()).landed, 3);
    assert.deepEqual(fake.eventCounts(), each(ids, ['reserved', 'settled']));
  });

  test('a failure of the server on one entry is retried later; the others go on', async () => {
    const fake = new FakeLedger();
    const journal = open();
    const [bad, good] = await journalCalls(journal, 2);
    fake.failing.add(bad);
    const replayer = new Replayer(fake, journal, SETTINGS);
    const report = await replayer.replayOnce();
    assert.deepEqual([report.landed, report.failed, report.remaining], [1, 1, 1]);
    assert.equal(journal.entry(good).replay, ReplayResult.LANDED);
    fake.failing.clear();
    assert.equal((await replayer.replayOnce()).landed, 1);
  });

  test('an orphan of a dead process ends UNKNOWN', async () => {
    let journal = open();
    const [orphan] = await journalCalls(journal, 1, { ended: false }); // the lane died mid-call
    await journal.close();
    const fake = new FakeLedger();
    journal = open();
    assert.equal((await new Replayer(fake, journal, SETTINGS).replayOnce()).landed, 1);
    const ending = fake.bookings.get(orphan).ending;
    assert.equal(ending.settlement, Settlement.SETTLE_UNKNOWN);
    assert.equal(ending.reason, ORPHAN_REASON);
    assert.equal(journal.entry(orphan).localChargeNanos, 110n, 'charged at its hold');
  });

  test("an orphan whose own ending reached the ledger has landed", async () => {
    // The lane's Settle reached the ledger and the process died before it
    // journaled the ending: the replay's UNKNOWN meets that ending.
    const fake = new FakeLedger();
    let journal = open();
    const [orphan] = await journalCalls(journal, 1, { ended: false, source: Source.LEDGER });
    await fake.reserve(journal.entry(orphan).arguments);
    await fake.end(orphan, SUCCESS); // its answer never journaled
    await journal.close();
    journal = open();
    const report = await new Replayer(fake, journal, SETTINGS).replayOnce();
    assert.deepEqual([report.landed, report.rejected, report.remaining], [1, 0, 0]);
    assert.equal(journal.entry(orphan).replay, ReplayResult.LANDED);
    assert.deepEqual(fake.eventCounts(), { [orphan]: ['reserved', 'settled'] });
    assert.equal(fake.bookings.get(orphan).ending.settlement, Settlement.SETTLE_SUCCEEDED);
  });

  test('a call in flight in this process is left alone', async () => {
    const fake = new FakeLedger();
    const journal = open();
    const [running] = await journalCalls(journal, 1, { ended: false });
    const replayer = new Replayer(fake, journal, SETTINGS);
    replayer.hold(running);
    const report = await replayer.replayOnce();
    assert.deepEqual([report.landed, report.remaining], [0, 1]);
    assert.deepEqual(fake.events, []);
    await journal.recordEnd(running, SUCCESS, 30n);
    replayer.release(running);
    assert.equal((await replayer.replayOnce()).landed, 1);
  });

  test('a replayed Reserve the ledger denies is reported and resolved', async () => {
    const fake = new FakeLedger({ limitNanos: 150n }); // room for one hold of 110
    const journal = open();
    const [first, second] = await journalCalls(journal, 2);
    const warnings = [];
    const logger = { warn: (text) => warnings.push(text), error: (text) => warnings.push(text) };
    const report = await new Replayer(fake, journal, SETTINGS, logger).replayOnce();
    assert.deepEqual([report.landed, report.denied, report.remaining], [1, 1, 0]);
    assert.equal(journal.entry(second).replay, ReplayResult.DENIED);
    assert.equal(journal.entry(second).replayDetail, 'budget_exhausted');
    assert.deepEqual(fake.eventCounts(), { [first]: ['reserved', 'settled'], [second]: ['denied'] });
    assert.equal(warnings.length, 1);
    assert.match(warnings[0], /spent without a booking/);
  });

  test('an in-doubt Reserve that never arrived is absent; one that did is refunded', async () => {
    const fake = new FakeLedger();
    const journal = open();
    const [never, arrived] = await journalCalls(journal, 2, { ended: false, source: Source.IN_DOUBT });
    await fake.reserve(journal.entry(arrived).arguments, '');
    const report = await new Replayer(fake, journal, SETTINGS).replayOnce();
    assert.deepEqual([report.landed, report.absent, report.remaining], [1, 1, 0]);
    assert.equal(journal.entry(never).replay, ReplayResult.ABSENT);
    assert.deepEqual(fake.eventCounts(), { [arrived]: ['reserved', 'refunded'] });
  });

  test('a conflict is rejected for good, not retried for ever', async () => {
    const fake = new FakeLedger();
    const journal = open();
    const [id] = await journalCalls(journal, 1);
    // Someone booked this id with other arguments.
    await fake.reserve({ reservationId: id, model: 'model-a', requestBytes: 999n, maxOutputTokens: 10n }, '');
    const report = await new Replayer(fake, journal, SETTINGS, null).replayOnce();
    assert.deepEqual([report.rejected, report.remaining], [1, 0]);
    assert.equal(journal.entry(id).replayDetail, 'RESERVATION_ID_REUSED');
  });

  test('attempts run one at a time', async () => {
    const fake = new FakeLedger();
    const journal = open();
    const ids = await journalCalls(journal, 4);
    const replayer = new Replayer(fake, journal, SETTINGS);
    const [first, second] = await Promise.all([replayer.replayOnce(), replayer.replayOnce()]);
    assert.deepEqual([first.landed, second.landed, second.remaining], [4, 0, 0]);
    assert.deepEqual(fake.eventCounts(), each(ids, ['reserved', 'settled']));
  });

  test('the background replay runs, wakes, and stops', async () => {
    const fake = new FakeLedger();
    const journal = open();
    await journalCalls(journal, 2);
    const replayer = new Replayer(fake, journal, SETTINGS);
    replayer.start(60_000);
    try {
      replayer.wake();
      for (let waited = 0; journal.pending().length > 0 && waited < 2000; waited += 10) {
        await new Promise((resolve) => setTimeout(resolve, 10));
      }
      assert.deepEqual(journal.pending(), []);
    } finally {
      replayer.stop();
      await replayer.idle();
    }
    await journalCalls(journal, 1);
    replayer.wake(); // stopped: nothing runs
    await new Promise((resolve) => setTimeout(resolve, 50));
    assert.equal(journal.pending().length, 1);
  });

  test('the settings are bounded', () => {
    assert.deepEqual(replaySettingsOf(), {
      replayDeadlineMs: 2000,
      maxReplayEntriesPerAttempt: 100,
      maxReplayMsPerAttempt: 10_000,
      replayIntervalMs: 5000,
    });
    for (const bad of [
      { replayDeadlineMs: 0 },
      { replayDeadlineMs: 60_001 },
      { maxReplayEntriesPerAttempt: 0 },
      { maxReplayEntriesPerAttempt: 10_001 },
      { maxReplayEntriesPerAttempt: 1.5 },
      { maxReplayMsPerAttempt: 600_001 },
      { replayIntervalMs: 0 },
      { replayIntervalMs: 3_600_001 },
    ]) {
      assert.throws(() => replaySettingsOf(bad), RangeError, JSON.stringify(bad));
    }
  });
});
