'use strict';
// The local journal: an append-only file of JSON lines, fsync'd line by line,
// in the same format as the Python client's (clients/python/ledger_client/journal.py).
//
// It holds what the ledger has not heard yet: calls made on the outage
// allowance (written BEFORE the model call, with the full Reserve arguments and
// the reservation_id), endings that could not reach the ledger, and Reserves
// that got no answer. Later lines record each call's ending and, once the
// ledger has acknowledged it, that it was replayed. Lines are never rewritten:
// the state of an entry is the fold of its lines, so a crash at any point
// leaves a journal that reads back to a consistent state. A torn last line (a
// crash in the middle of a write) is ignored, and the next write starts on a
// fresh line.
//
// One journal belongs to one lane and one process at a time: a lock file next
// to it (`<journal>.lock`, created exclusively, holding the owner's pid and
// host) enforces it. A lock left by a process that died on this host is taken
// over, and so is one naming this process's own pid that no Journal of this
// process holds (an earlier process with the same pid: a container
// restarted); one from another host is not (remove it by hand once that
// host's lane is gone). Node has no flock(2), so this lock and the Python client's
// advisory lock do not see each other: never point both clients at one file.
//
// Every integer of a line (nanos, tokens, bytes) is written and read exactly,
// as a BigInt: JSON.parse would round those above 2^53.

const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { randomBytes } = require('node:crypto');
const {
  nameRefusal,
  reservationIdRefusal,
  MAX_REQUEST_BYTES,
  MAX_TOKENS,
  MAX_AMOUNT_NANOS,
  MAX_TTL_US,
} = require('./arguments');

const FORMAT_VERSION = 1;
// A journal is read whole at start-up; past this multiple of maxBytes it is not
// read at all (an operator must look at it) rather than read without bound.
const READ_LIMIT_FACTOR = 4;
const DEFAULT_MAX_JOURNAL_BYTES = 16 * 1024 * 1024;
const DEFAULT_ROTATE_JOURNAL_BYTES = 1024 * 1024;
const MAX_JOURNAL_BYTES = 1024 ** 3;
// A lock file that cannot be read (its owner died between creating and writing
// it) is taken over once it is this old.
const UNREADABLE_LOCK_GRACE_MS = 10_000;
// Nesting a journal line never needs; deeper is not read (bounds the parser's stack).
const MAX_JSON_DEPTH = 8;

/** The journal cannot be used; a lane in outage then fails closed. */
class JournalError extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = new.target.name;
  }
}
/** The journal reached maxJournalBytes: it takes no new call (endings still go in). */
class JournalFull extends JournalError {}
/** Another process (or another Journal of this process) holds the journal. */
class JournalLocked extends JournalError {}

const Source = Object.freeze({
  /** Made on the outage allowance: the ledger has not seen its Reserve. */
  ALLOWANCE: 'allowance',
  /** Admitted by the ledger; only its ending did not reach the ledger. */
  LEDGER: 'ledger',
  /**
   * The Reserve got no answer, so the call was not made; the ledger may or may
   * not hold a booking for it, which the replay refunds if it does.
   */
  IN_DOUBT: 'in_doubt',
});

const ReplayResult = Object.freeze({
  /** The ledger has the booking and its ending. */
  LANDED: 'landed',
  /** The ledger denied the replayed Reserve: spent without a booking. */
  DENIED: 'denied',
  /** An in-doubt Reserve never reached the ledger: nothing to undo. */
  ABSENT: 'absent',
  /** Refused for good (see replayDetail); an operator must look. */
  REJECTED: 'rejected',
  /**
   * An in-doubt Reserve sent again under its id and admitted: the call that
   * followed owns the booking and ends it, so there is nothing to refund.
   */
  SUPERSEDED: 'superseded',
});

/** How an entry ends, as the journal spells it (the Python client's Settlement). */
const Settlement = Object.freeze({
  SETTLE_SUCCEEDED: 'settle_succeeded',
  SETTLE_UNKNOWN: 'settle_unknown',
  REFUND: 'refund',
});

const SOURCES = new Set(Object.values(Source));
const RESULTS = new Set(Object.values(ReplayResult));
const SETTLEMENTS = new Set(Object.values(Settlement));

function pad(number, width) {
  return String(number).padStart(width, '0');
}

/** UTC now as Python's datetime.isoformat(timespec="microseconds"): 2026-01-02T03:04:05.678000+00:00. */
function nowText(date = new Date()) {
  return `${date.toISOString().slice(0, 23)}000+00:00`;
}

// Archives a rotation may find already named by one clock reading.
const MAX_ARCHIVES_PER_STAMP = 1_000;

function stampOf(date) {
  const iso = date.toISOString(); // 2026-01-02T03:04:05.678Z
  return `${iso.slice(0, 4)}${iso.slice(5, 7)}${iso.slice(8, 10)}T${iso.slice(11, 13)}${iso.slice(14, 16)}${iso.slice(17, 19)}${iso.slice(20, 23)}000Z`;
}

// JSON with exact integers -------------------------------------------------------

/**
 * One value as Python's json.dumps(sort_keys=True, separators=(",", ":"),
 * ensure_ascii=True) writes it. BigInts are written as integers.
 */
function encode(value) {
  if (value === null || value === undefined) return 'null';
  if (typeof value === 'bigint') return value.toString();
  if (typeof value === 'number') {
    if (!Number.isSafeInteger(value)) throw new TypeError('a journal number must be an integer');
    return String(value);
  }
  if (typeof value === 'boolean') return value ? 'true' : 'false';
  if (typeof value === 'string') {
    return JSON.stringify(value).replace(/[\u0080-\uffff]/g, (char) => `\\u${pad(char.charCodeAt(0).toString(16), 4)}`);
  }
  if (Array.isArray(value)) return `[${value.map(encode).join(',')}]`;
  const keys = Object.keys(value).sort();
  return `{${keys.map((key) => `${encode(key)}:${encode(value[key])}`).join(',')}}`;
}

const WHITESPACE = /[ \t\n\r]*/y;
const NUMBER = /-?(?:0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?/y;
const STRING = /"(?:[^"\\\u0000-\u001f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"/y;

/**
 * Parses one JSON text; integers (no fraction, no exponent) become BigInts,
 * other numbers Numbers. Objects have no prototype, so no key is special.
 * Throws SyntaxError.
 */
function decode(text) {
  let at = 0;
  const skip = () => {
    WHITESPACE.lastIndex = at;
    WHITESPACE.exec(text);
    at = WHITESPACE.lastIndex;
  };
  const fail = (what) => {
    throw new SyntaxError(`${what} at ${at}`);
  };
  const token = (pattern) => {
    pattern.lastIndex = at;
    const match = pattern.exec(text);
    if (match === null) return null;
    at = pattern.lastIndex;
    return match;
  };
  function value(depth) {
    if (depth > MAX_JSON_DEPTH) fail('nested too deep');
    skip();
    const char = text[at];
    if (char === '{') {
      at += 1;
      const object = Object.create(null);
      skip();
      if (text[at] === '}') {
        at += 1;
        return object;
      }
      for (;;) {
        skip();
        const key = token(STRING);
        if (key === null) fail('expected a key');
        skip();
        if (text[at] !== ':') fail('expected ":"');
        at += 1;
        object[JSON.parse(key[0])] = value(depth + 1);
        skip();
        if (text[at] === ',') {
          at += 1;
        } else if (text[at] === '}') {
          at += 1;
          return object;
        } else {
          fail('expected "," or "}"');
        }
      }
    }
    if (char === '[') {
      at += 1;
      const array = [];
      skip();
      if (text[at] === ']') {
        at += 1;
        return array;
      }
      for (;;) {
        array.push(value(depth + 1));
        skip();
        if (text[at] === ',') {
          at += 1;
        } else if (text[at] === ']') {
          at += 1;
          return array;
        } else {
          fail('expected "," or "]"');
        }
      }
    }
    if (char === '"') return JSON.parse(token(STRING)?.[0] ?? fail('bad string'));
    for (const [word, result] of [['true', true], ['false', false], ['null', null]]) {
      if (text.startsWith(word, at)) {
        at += word.length;
        return result;
      }
    }
    const number = token(NUMBER);
    if (number === null) fail('unexpected character');
    return number[1] === undefined && number[2] === undefined ? BigInt(number[0]) : Number(number[0]);
  }
  const result = value(0);
  skip();
  if (at !== text.length) fail('trailing characters');
  return result;
}

// Records ------------------------------------------------------------------------

class LineError extends Error {}

function integerOf(record, key) {
  const value = record[key];
  if (typeof value !== 'bigint') throw new LineError(`${key} is not an integer`);
  return value;
}

function optionalIntegerOf(record, key) {
  return record[key] === undefined || record[key] === null ? null : integerOf(record, key);
}

/** For keys added after the format's first lines: a line without one reads as 0. */
function integerOrZeroOf(record, key) {
  return record[key] === undefined ? 0n : integerOf(record, key);
}

function textOf(record, key) {
  const value = record[key];
  if (typeof value !== 'string') throw new LineError(`${key} is not text`);
  return value;
}

function inRange(name, value, low, high) {
  if (typeof value !== 'bigint' || value < low || value > high) {
    throw new RangeError(`${name} must be an integer between ${low} and ${high}`);
  }
  return value;
}

/**
 * Checks Reserve arguments as the Python client's ReserveArguments does;
 * returns them frozen. Throws RangeError.
 * @returns {import('../index').JournaledArguments}
 */
function checkArguments({ reservationId, model, requestBytes, maxOutputTokens, estimateNanos = null, ttlUs = null }) {
  const idRefused = reservationIdRefusal(reservationId);
  if (idRefused !== null) throw new RangeError(`reservation_id: ${idRefused}`);
  const modelRefused = nameRefusal(model);
  if (modelRefused !== null) throw new RangeError(`model: ${modelRefused}`);
  inRange('requestBytes', requestBytes, 0n, MAX_REQUEST_BYTES);
  inRange('maxOutputTokens', maxOutputTokens, 0n, MAX_TOKENS);
  if (estimateNanos !== null) inRange('estimateNanos', estimateNanos, 0n, MAX_AMOUNT_NANOS);
  if (ttlUs !== null) inRange('ttlUs', ttlUs, 1n, MAX_TTL_US);
  return Object.freeze({ reservationId, model, requestBytes, maxOutputTokens, estimateNanos, ttlUs });
}

/** Checks a usage as the Python client's Usage does. Throws RangeError. */
function checkUsage(usage) {
  for (const name of ['inputTokens', 'outputTokens', 'cachedInputTokens', 'cacheWriteTokens']) {
    inRange(name, usage[name], 0n, MAX_TOKENS);
  }
  if (usage.cachedInputTokens + usage.cacheWriteTokens > usage.inputTokens) {
    throw new RangeError('cachedInputTokens + cacheWriteTokens must be at most inputTokens');
  }
  if (usage.billedNanos !== null) inRange('billedNanos', usage.billedNanos, 0n, MAX_AMOUNT_NANOS);
  return Object.freeze({ ...usage });
}

/** Checks an ending as the Python client's Ending does. Throws RangeError. */
function checkEnding({ settlement, httpStatus = 0, usage = null, reason = '' }) {
  if (!SETTLEMENTS.has(settlement)) throw new RangeError(`unknown settlement ${String(settlement).slice(0, 40)}`);
  if (!(Number.isInteger(httpStatus) && (httpStatus === 0 || (httpStatus >= 100 && httpStatus <= 599)))) {
    throw new RangeError('httpStatus must be 0 (no answer) or between 100 and 599');
  }
  if (typeof reason !== 'string') throw new RangeError('reason must be text');
  const checkedUsage = usage === null ? null : checkUsage(usage);
  if (settlement === Settlement.SETTLE_SUCCEEDED && checkedUsage === null) {
    throw new RangeError('a SUCCEEDED settlement needs the usage');
  }
  if (settlement === Settlement.REFUND && httpStatus === 0 && reason === '') {
    throw new RangeError('a refund of a call never sent needs a reason');
  }
  return Object.freeze({ settlement, httpStatus, usage: checkedUsage, reason });
}

/**
 * A new entry, not yet journaled.
 * @returns {import('../index').JournalEntry}
 */
function newEntry(lane, args, source, localHoldNanos, { traceId = '', writtenAt = nowText() } = {}) {
  if (!SOURCES.has(source)) throw new RangeError(`unknown source ${source}`);
  if (typeof localHoldNanos !== 'bigint') throw new TypeError('localHoldNanos must be a BigInt');
  const checked = checkArguments(args);
  return Object.freeze({
    lane,
    reservationId: checked.reservationId,
    arguments: checked,
    source,
    localHoldNanos,
    writtenAt,
    ending: null,
    localChargeNanos: 0n,
    replay: null,
    replayDetail: '',
    traceId,
  });
}

function line(record) {
  return Buffer.from(`${encode({ v: FORMAT_VERSION, at: nowText(), ...record })}\n`, 'ascii');
}

function reserveRecord(entry) {
  const args = entry.arguments;
  return {
    kind: 'reserve',
    at: entry.writtenAt,
    lane: entry.lane,
    source: entry.source,
    reservation_id: args.reservationId,
    model: args.model,
    request_bytes: args.requestBytes,
    max_output_tokens: args.maxOutputTokens,
    estimate_nanos: args.estimateNanos,
    ttl_us: args.ttlUs,
    local_hold_nanos: entry.localHoldNanos,
    trace_id: entry.traceId,
  };
}

function endRecord(reservationId, ending, localChargeNanos) {
  const usage = ending.usage;
  return {
    kind: 'end',
    reservation_id: reservationId,
    settlement: ending.settlement,
    http_status: ending.httpStatus,
    usage:
      usage === null
        ? null
        : {
            input_tokens: usage.inputTokens,
            output_tokens: usage.outputTokens,
            billed_nanos: usage.billedNanos,
            cached_input_tokens: usage.cachedInputTokens,
            cache_write_tokens: usage.cacheWriteTokens,
          },
    reason: ending.reason,
    local_charge_nanos: localChargeNanos,
  };
}

function entryOf(record) {
  const source = textOf(record, 'source');
  if (!SOURCES.has(source)) throw new LineError('unknown source');
  return newEntry(
    textOf(record, 'lane'),
    {
      reservationId: textOf(record, 'reservation_id'),
      model: textOf(record, 'model'),
      requestBytes: integerOf(record, 'request_bytes'),
      maxOutputTokens: integerOf(record, 'max_output_tokens'),
      estimateNanos: optionalIntegerOf(record, 'estimate_nanos'),
      ttlUs: optionalIntegerOf(record, 'ttl_us'),
    },
    source,
    integerOf(record, 'local_hold_nanos'),
    {
      writtenAt: textOf(record, 'at'),
      traceId: record.trace_id === undefined ? '' : textOf(record, 'trace_id'),
    },
  );
}

function endingOfRecord(record) {
  const usageRecord = record.usage ?? null;
  let usage = null;
  if (usageRecord !== null) {
    if (typeof usageRecord !== 'object' || Array.isArray(usageRecord)) throw new LineError('usage is not an object');
    usage = {
      inputTokens: integerOf(usageRecord, 'input_tokens'),
      outputTokens: integerOf(usageRecord, 'output_tokens'),
      billedNanos: optionalIntegerOf(usageRecord, 'billed_nanos'),
      cachedInputTokens: integerOrZeroOf(usageRecord, 'cached_input_tokens'),
      cacheWriteTokens: integerOrZeroOf(usageRecord, 'cache_write_tokens'),
    };
  }
  const status = integerOf(record, 'http_status');
  if (status < 0n || status > 599n) throw new LineError('http_status is out of range');
  return checkEnding({
    settlement: textOf(record, 'settlement'),
    httpStatus: Number(status),
    usage,
    reason: textOf(record, 'reason'),
  });
}

function isVersion(value) {
  // Python compares with ==: 1, 1.0 and true all pass.
  return value === 1n || value === 1 || value === true;
}

/**
 * Folds one line into the entries; throws for a line that does not belong
 * (unknown kind, unknown id, an ending twice).
 */
function apply(entries, record) {
  if (!isVersion(record.v)) throw new LineError('unknown journal format version');
  const kind = record.kind;
  if (kind === 'reserve') {
    const entry = entryOf(record);
    const earlier = entries.get(entry.reservationId);
    if (earlier !== undefined && earlier.replay === null) throw new LineError('reservation_id journaled twice');
    entries.set(entry.reservationId, entry);
    return;
  }
  const current = entries.get(textOf(record, 'reservation_id'));
  if (current === undefined) throw new LineError('an unknown reservation_id');
  if (kind === 'end' && current.ending === null) {
    entries.set(
      current.reservationId,
      Object.freeze({ ...current, ending: endingOfRecord(record), localChargeNanos: integerOf(record, 'local_charge_nanos') }),
    );
  } else if (kind === 'replayed' && current.replay === null) {
    const result = textOf(record, 'result');
    if (!RESULTS.has(result)) throw new LineError('unknown replay result');
    entries.set(current.reservationId, Object.freeze({ ...current, replay: result, replayDetail: textOf(record, 'detail') }));
  } else {
    throw new LineError(`unexpected ${JSON.stringify(String(kind).slice(0, 40))} line`);
  }
}

const ASCII_WHITESPACE = new Set([0x20, 0x09, 0x0a, 0x0d, 0x0b, 0x0c]);

function isBlank(bytes) {
  for (const byte of bytes) if (!ASCII_WHITESPACE.has(byte)) return false;
  return true;
}

/**
 * The entries of a journal's bytes (a Map by reservation id, in journal
 * order), how many lines were skipped, and whether the last line is torn (no
 * newline at its end). A torn last line is not read, as in Python.
 * @param {Buffer} data
 */
function readEntries(data) {
  const entries = new Map();
  const decoder = new TextDecoder('utf-8', { fatal: true });
  let skipped = 0;
  let start = 0;
  for (;;) {
    const end = data.indexOf(0x0a, start);
    if (end < 0) break;
    const raw = data.subarray(start, end);
    start = end + 1;
    if (isBlank(raw)) continue;
    try {
      const record = decode(decoder.decode(raw));
      if (record === null || typeof record !== 'object' || Array.isArray(record)) throw new LineError('not an object');
      apply(entries, record);
    } catch (error) {
      if (!(error instanceof SyntaxError || error instanceof LineError || error instanceof RangeError || error instanceof TypeError)) {
        throw error;
      }
      skipped += 1;
    }
  }
  return { entries, skipped, torn: start < data.length };
}

// The file and its lock --------------------------------------------------------------

function syncDirectory(directory) {
  let descriptor;
  try {
    descriptor = fs.openSync(directory, 'r');
    fs.fsyncSync(descriptor);
  } catch (error) {
    // Some platforms cannot fsync a directory; the file's own fsync still holds.
    if (!['EISDIR', 'EPERM', 'EINVAL', 'EBADF'].includes(error.code)) throw error;
  } finally {
    if (descriptor !== undefined) fs.closeSync(descriptor);
  }
}

function isAlive(pid) {
  try {
    process.kill(pid, 0);
  } catch (error) {
    return error.code === 'EPERM';
  }
  // A holder that died but is not yet reaped (a zombie: its parent has not
  // waited for it) still answers kill(pid, 0); on Linux, /proc says it is dead.
  try {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2)[0] !== 'Z';
  } catch {
    return true; // no /proc (not Linux) or it went meanwhile: kill(pid, 0) decides
  }
}

// The lock files the Journals of this process hold. A lock naming this
// process's own pid that is not among them was left by an earlier process
// that had the same pid (a container's lane restarted as pid 1 again).
const HELD_LOCKS = new Set();

/** Whether the lock's holder is known to be gone. */
function isStale(text, lockPath) {
  let holder = null;
  try {
    holder = JSON.parse(text);
  } catch {
    holder = null;
  }
  if (holder === null || typeof holder !== 'object' || !Number.isSafeInteger(holder.pid) || typeof holder.host !== 'string') {
    try {
      return Date.now() - fs.statSync(lockPath).mtimeMs > UNREADABLE_LOCK_GRACE_MS;
    } catch {
      return false;
    }
  }
  if (holder.host !== os.hostname()) return false;
  if (holder.pid === process.pid) return !HELD_LOCKS.has(lockPath);
  return !isAlive(holder.pid);
}

function readText(file) {
  try {
    return fs.readFileSync(file, 'utf8');
  } catch (error) {
    if (error.code === 'ENOENT') return null;
    throw error;
  }
}

/**
 * mkdir -p, one folder at a time. Node's mkdirSync(..., {recursive: true})
 * spins for ever where mkdir(2) answers ENOENT under a parent that exists
 * (under /proc): here that ENOENT is thrown, as Python's os.makedirs does.
 */
function makeFolders(folder) {
  const missing = [];
  for (let current = path.resolve(folder); !fs.existsSync(current); current = path.dirname(current)) {
    missing.push(current);
    if (path.dirname(current) === current) break;
  }
  for (const one of missing.reverse()) {
    try {
      fs.mkdirSync(one);
    } catch (error) {
      if (error.code !== 'EEXIST') throw error;
    }
  }
}

/** Creates the lock file exclusively; takes over a dead holder's lock. Returns its text. */
function acquireLock(lockPath, journalPath) {
  const mine = `${JSON.stringify({ pid: process.pid, host: os.hostname(), at: nowText() })}\n`;
  for (let attempt = 0; attempt < 3; attempt += 1) {
    let descriptor;
    try {
      descriptor = fs.openSync(lockPath, fs.constants.O_WRONLY | fs.constants.O_CREAT | fs.constants.O_EXCL, 0o600);
    } catch (error) {
      if (error.code !== 'EEXIST') throw error;
    }
    if (descriptor !== undefined) {
      try {
        fs.writeSync(descriptor, mine);
        fs.fsyncSync(descriptor);
      } finally {
        fs.closeSync(descriptor);
      }
      HELD_LOCKS.add(lockPath);
      return mine;
    }
    const held = readText(lockPath);
    if (held === null) continue; // released meanwhile
    if (!isStale(held, lockPath)) {
      throw lockedError(journalPath, lockPath);
    }
    // Move the dead holder's lock aside, and make sure it was that one and not
    // a fresh lock another process made meanwhile.
    const aside = `${lockPath}.stale-${process.pid}-${randomBytes(4).toString('hex')}`;
    try {
      fs.renameSync(lockPath, aside);
    } catch (error) {
      if (error.code === 'ENOENT') continue;
      throw error;
    }
    const moved = readText(aside);
    if (moved !== held) {
      try {
        fs.linkSync(aside, lockPath);
      } catch {
        // Someone else holds the name now; either way it is not ours.
      }
      fs.rmSync(aside, { force: true });
      throw lockedError(journalPath, lockPath);
    }
    fs.rmSync(aside, { force: true });
  }
  throw new JournalLocked(`journal ${journalPath} is contended; try again`);
}

// The holder may be another client of this very process (its pid is alive
// too), so the message does not say "another process".
function lockedError(journalPath, lockPath) {
  return new JournalLocked(`journal ${journalPath} is in use by another client (this process or another): see ${lockPath}`);
}

function releaseLock(lockPath, mine) {
  HELD_LOCKS.delete(lockPath);
  try {
    if (readText(lockPath) === mine) fs.unlinkSync(lockPath);
  } catch {
    // Best effort: a lock left behind is taken over once this process is gone.
  }
}

const write = (descriptor, buffer) =>
  new Promise((resolve, reject) => fs.write(descriptor, buffer, 0, buffer.length, null, (error, written) => (error ? reject(error) : resolve(written))));
const fsync = (descriptor) => new Promise((resolve, reject) => fs.fsync(descriptor, (error) => (error ? reject(error) : resolve())));

/** A file system's refusal (a directory, under a file, unwritable, ...) as a JournalError naming the setting. */
function unusable(file, error) {
  if (error instanceof JournalError || typeof error?.code !== 'string') return error;
  return new JournalError(`journalPath ${file}: cannot open the journal (${error.code})`, { cause: error });
}

/** The durable, append-only record of what the ledger has not heard yet. */
/**
 * The journal's size limits, checked whether or not a journal is in use (as
 * the Python client's ClientSettings): a RangeError out of bounds.
 */
function checkJournalLimits(maxBytes, rotateBytes) {
  if (!(Number.isSafeInteger(rotateBytes) && Number.isSafeInteger(maxBytes) && rotateBytes > 0 && rotateBytes <= maxBytes && maxBytes <= MAX_JOURNAL_BYTES)) {
    throw new RangeError('need 0 < rotateJournalBytes <= maxJournalBytes <= 1 GiB');
  }
}

class Journal {
  /**
   * Opens (or creates) the journal and takes its lock; throws JournalLocked
   * when another process holds it, JournalError when it belongs to another
   * lane or is larger than READ_LIMIT_FACTOR * maxBytes.
   * @param {string} file
   * @param {string} lane
   * @param {{maxBytes?: number, rotateBytes?: number}} [limits]
   */
  constructor(file, lane, { maxBytes = DEFAULT_MAX_JOURNAL_BYTES, rotateBytes = DEFAULT_ROTATE_JOURNAL_BYTES } = {}) {
    if (typeof file !== 'string' || file === '') throw new TypeError('the journal needs a path');
    checkJournalLimits(maxBytes, rotateBytes);
    this.path = path.resolve(file);
    this.lane = lane;
    this._maxBytes = maxBytes;
    this._rotateBytes = rotateBytes;
    this._lockPath = `${this.path}.lock`;
    this._descriptor = -1;
    this._entries = new Map();
    this._needsNewline = false;
    this._tail = Promise.resolve();
    this._closing = false;
    /** Lines that could not be read at start-up (a torn last line counts). */
    this.skippedLines = 0;
    this.tornLastLine = false;
    this.sizeBytes = 0;
    try {
      makeFolders(path.dirname(this.path));
      this._lock = acquireLock(this._lockPath, this.path);
    } catch (error) {
      throw unusable(this.path, error);
    }
    this._onExit = () => releaseLock(this._lockPath, this._lock);
    process.once('exit', this._onExit);
    try {
      this._open();
    } catch (error) {
      this._release();
      throw unusable(this.path, error);
    }
  }

  _open() {
    const created = !fs.existsSync(this.path);
    const descriptor = fs.openSync(this.path, fs.constants.O_RDWR | fs.constants.O_CREAT | fs.constants.O_APPEND, 0o600);
    try {
      this._load(descriptor);
      if (created) syncDirectory(path.dirname(this.path));
    } catch (error) {
      fs.closeSync(descriptor);
      throw error;
    }
    this._descriptor = descriptor;
  }

  _load(descriptor) {
    const size = fs.fstatSync(descriptor).size;
    if (size > this._maxBytes * READ_LIMIT_FACTOR) {
      throw new JournalError(`journal ${this.path} is larger than it may grow; look at it`);
    }
    const data = Buffer.alloc(size);
    let offset = 0;
    while (offset < size) {
      const read = fs.readSync(descriptor, data, offset, size - offset, offset);
      if (read === 0) break;
      offset += read;
    }
    const { entries, skipped, torn } = readEntries(data.subarray(0, offset));
    for (const entry of entries.values()) {
      if (entry.lane !== this.lane) throw new JournalError(`journal ${this.path} belongs to another lane`);
    }
    this._entries = entries;
    this.skippedLines = skipped + (torn ? 1 : 0);
    /** Whether the file ended in a torn line at start-up (counted in skippedLines). */
    this.tornLastLine = torn;
    this._needsNewline = torn;
    this.sizeBytes = size;
  }

  _release() {
    process.removeListener('exit', this._onExit);
    releaseLock(this._lockPath, this._lock);
  }

  /** Whether the journal is open. */
  get isOpen() {
    return this._descriptor >= 0 && !this._closing;
  }

  /** Waits for the writes already asked for, closes the file and releases the lock. Idempotent. */
  async close() {
    if (this._closing) return this._closed;
    this._closing = true;
    this._closed = this._serially(async () => {
      if (this._descriptor >= 0) {
        fs.closeSync(this._descriptor);
        this._descriptor = -1;
      }
      this._release();
    }, { whileClosing: true });
    return this._closed;
  }

  // Reads ---------------------------------------------------------------------

  /** Entries the ledger has not acknowledged yet, oldest first. */
  pending() {
    const pending = [];
    for (const entry of this._entries.values()) if (entry.replay === null) pending.push(entry);
    return pending;
  }

  entry(reservationId) {
    return this._entries.get(reservationId) ?? null;
  }

  entries() {
    return [...this._entries.values()];
  }

  // Writes --------------------------------------------------------------------

  /** Runs `task` after every write asked for before it, one at a time. */
  _serially(task, { whileClosing = false } = {}) {
    // Refused when asked for after close(); what was asked for before still runs.
    const refused = this._closing && !whileClosing;
    const run = this._tail.then(() => {
      if (refused) throw new JournalError('the journal is closed');
      return task();
    });
    this._tail = run.catch(() => undefined);
    return run;
  }

  /** Journals a new entry. Refused when the journal is full (fail closed). */
  recordReserve(entry) {
    return this._serially(() => this._reserve(entry));
  }

  async _reserve(entry) {
    if (entry.lane !== this.lane) throw new JournalError('an entry for another lane');
    // An id may come back once its earlier entry was replayed (a retry).
    const earlier = this._entries.get(entry.reservationId);
    if (earlier !== undefined && earlier.replay === null) throw new JournalError('reservation_id already journaled');
    if (this.sizeBytes >= this._maxBytes) throw new JournalFull(`journal ${this.path} is full`);
    await this._append(line(reserveRecord(entry)));
    this._entries.set(entry.reservationId, entry);
  }

  /**
   * Journals an unanswered Reserve (Source.IN_DOUBT) and the refund that ends
   * it, unless `limit` such entries are pending already; resolves whether it
   * did. Counted and written in one turn, so calls at once cannot pass the
   * limit together.
   */
  recordInDoubt(entry, ending, limit) {
    return this._serially(async () => {
      let pending = 0;
      for (const known of this.pending()) if (known.source === Source.IN_DOUBT) pending += 1;
      if (pending >= limit) return false;
      await this._reserve(entry);
      await this._end(entry.reservationId, ending, 0n);
      return true;
    });
  }

  /** Journals how an entry ended and what the lane thinks it costs. */
  recordEnd(reservationId, ending, localChargeNanos) {
    return this._serially(() => this._end(reservationId, ending, localChargeNanos));
  }

  async _end(reservationId, ending, localChargeNanos) {
    const current = this._entries.get(reservationId);
    if (current === undefined) throw new JournalError('no such entry');
    if (current.ending !== null) throw new JournalError('this entry already has its ending');
    if (typeof localChargeNanos !== 'bigint') throw new TypeError('localChargeNanos must be a BigInt');
    const checked = checkEnding(ending);
    await this._append(line(endRecord(reservationId, checked, localChargeNanos)));
    this._entries.set(reservationId, Object.freeze({ ...current, ending: checked, localChargeNanos }));
  }

  /** Journals that the ledger acknowledged an entry (or refused it for good). */
  recordReplay(reservationId, result, detail = '') {
    return this._serially(async () => {
      const current = this._entries.get(reservationId);
      if (current === undefined) throw new JournalError('no such entry');
      if (current.replay !== null) throw new JournalError('this entry was already replayed');
      if (!RESULTS.has(result)) throw new RangeError(`unknown replay result ${result}`);
      await this._append(line({ kind: 'replayed', reservation_id: reservationId, result, detail: String(detail) }));
      this._entries.set(reservationId, Object.freeze({ ...current, replay: result, replayDetail: String(detail) }));
    });
  }

  /** Writes one whole line and waits until it is on disk. */
  async _append(bytes) {
    if (this._descriptor < 0) throw new JournalError('the journal is closed');
    // Seals a torn last line (or one a failed write left) so it stays unreadable.
    const whole = this._needsNewline ? Buffer.concat([Buffer.from('\n'), bytes]) : bytes;
    try {
      let offset = 0;
      while (offset < whole.length) offset += await write(this._descriptor, whole.subarray(offset));
      await fsync(this._descriptor);
    } catch (error) {
      // Part of the line may be on disk: the next line starts on a fresh one.
      this._needsNewline = true;
      this.sizeBytes = fs.fstatSync(this._descriptor).size;
      throw error;
    }
    this._needsNewline = false;
    this.sizeBytes += whole.length;
  }

  /**
   * A name no archive has: the clock can repeat a reading (stepped back,
   * frozen, two rotations in one millisecond), and a rename would replace the
   * earlier archive, deleting it. Only this journal's lock holder makes these
   * names, so a name free now is still free at the rename.
   */
  _freeArchiveName() {
    const stamp = stampOf(new Date());
    for (let attempt = 0; attempt < MAX_ARCHIVES_PER_STAMP; attempt += 1) {
      const suffix = attempt === 0 ? '' : `-${attempt}`;
      const archive = path.join(path.dirname(this.path), `${path.basename(this.path)}.${stamp}${suffix}.done`);
      if (fs.lstatSync(archive, { throwIfNoEntry: false }) === undefined) return archive;
    }
    return null;
  }

  /**
   * Once every entry is replayed and the file is at least rotateBytes, moves
   * it aside (nothing is deleted) and starts an empty journal. Resolves with
   * the archive's path, or null.
   */
  rotateIfReplayed() {
    return this._serially(async () => {
      if (this.sizeBytes < this._rotateBytes || this.pending().length > 0) return null;
      const archive = this._freeArchiveName();
      if (archive === null) return null; // stays where it is, as a small replayed journal does
      fs.renameSync(this.path, archive);
      syncDirectory(path.dirname(this.path));
      fs.closeSync(this._descriptor);
      this._descriptor = -1;
      this._open();
      return archive;
    });
  }
}

module.exports = {
  checkJournalLimits,
  Journal,
  JournalError,
  JournalFull,
  JournalLocked,
  Source,
  ReplayResult,
  Settlement,
  FORMAT_VERSION,
  READ_LIMIT_FACTOR,
  DEFAULT_MAX_JOURNAL_BYTES,
  DEFAULT_ROTATE_JOURNAL_BYTES,
  MAX_JOURNAL_BYTES,
  MAX_TOKENS,
  MAX_AMOUNT_NANOS,
  newEntry,
  checkArguments,
  checkEnding,
  readEntries,
  encode,
  decode,
  nowText,
};
