'use strict';
// The journal: durable, append-only, one process at a time, a torn tail
// tolerated, in the Python client's format (clients/python/tests/test_client_journal.py).

const { afterEach, beforeEach, describe, mock, test } = require('node:test');
const assert = require('node:assert/strict');
const { execFileSync, spawn, spawnSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { randomUUID } = require('node:crypto');
const { Journal, JournalError, JournalFull, JournalLocked, Source, ReplayResult, Settlement } = require('..');
const { newEntry, nowText, decode, encode } = require('../lib/journal');

const LANE = 'recall';
const TRACE_ID = '4bf92f3577b34da6a3ce929d0e0e4736';
const SUCCESS = Object.freeze({
  settlement: Settlement.SETTLE_SUCCEEDED,
  httpStatus: 200,
  usage: Object.freeze({ inputTokens: 10n, outputTokens: 20n, billedNanos: null, cachedInputTokens: 0n, cacheWriteTokens: 0n }),
  reason: '',
});
const PYTHON = path.resolve(__dirname, '../../../.venv/bin/python');
const hasPython = (() => {
  try {
    execFileSync(PYTHON, ['-c', 'import ledger_client.journal'], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
})();

let directory;
let file;
const opened = [];

beforeEach(() => {
  directory = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-journal-'));
  file = path.join(directory, 'journal.jsonl');
});

afterEach(async () => {
  for (const journal of opened.splice(0)) await journal.close();
  fs.rmSync(directory, { recursive: true, force: true });
});

function open(limits = {}, lane = LANE) {
  const journal = new Journal(file, lane, { maxBytes: 1 << 20, rotateBytes: 1 << 19, ...limits });
  opened.push(journal);
  return journal;
}

function entry(source = Source.ALLOWANCE, holdNanos = 100n) {
  const args = {
    reservationId: randomUUID(),
    model: 'model-a',
    requestBytes: 1234n,
    maxOutputTokens: 256n,
    estimateNanos: 90n,
    ttlUs: 30_000_000n,
  };
  return newEntry(LANE, args, source, holdNanos, { traceId: TRACE_ID });
}

const ids = (entries) => entries.map((one) => one.reservationId);

describe('the journal', () => {
  test('entries survive a reopen', async () => {
    const first = entry();
    const second = entry(Source.LEDGER);
    let journal = open();
    await journal.recordReserve(first);
    await journal.recordEnd(first.reservationId, SUCCESS, 42n);
    await journal.recordReserve(second);
    await journal.close();

    journal = open();
    assert.deepEqual(ids(journal.pending()), [first.reservationId, second.reservationId]);
    const again = journal.entry(first.reservationId);
    assert.deepEqual(again.arguments, first.arguments, 'the full Reserve arguments');
    assert.deepEqual(again.ending, SUCCESS);
    assert.equal(again.localChargeNanos, 42n);
    assert.deepEqual(journal.entry(second.reservationId), second);
    await journal.recordReplay(first.reservationId, ReplayResult.LANDED);
    await journal.close();

    journal = open();
    assert.deepEqual(ids(journal.pending()), [second.reservationId]);
    assert.equal(journal.skippedLines, 0);
  });

  test('the journal only ever grows', async () => {
    const journal = open();
    const one = entry();
    const snapshots = [];
    for (const write of [
      () => journal.recordReserve(one),
      () => journal.recordEnd(one.reservationId, SUCCESS, 1n),
      () => journal.recordReplay(one.reservationId, ReplayResult.LANDED),
      () => journal.recordReserve(entry()),
    ]) {
      await write();
      snapshots.push(fs.readFileSync(file));
    }
    for (let index = 1; index < snapshots.length; index += 1) {
      const [earlier, later] = [snapshots[index - 1], snapshots[index]];
      assert.ok(later.length > earlier.length && later.subarray(0, earlier.length).equals(earlier));
    }
    const lines = snapshots.at(-1).toString().trimEnd().split('\n');
    assert.deepEqual(lines.map((line) => JSON.parse(line).kind), ['reserve', 'end', 'replayed', 'reserve']);
  });

  test('each line is whole and fsync\'d before its write resolves', async () => {
    const journal = open();
    const one = entry();
    const order = [];
    const realFsync = fs.fsync;
    mock.method(fs, 'fsync', (descriptor, callback) => {
      order.push('fsync called');
      realFsync(descriptor, (error) => {
        order.push('fsync done');
        callback(error);
      });
    });
    try {
      await journal.recordReserve(one);
      order.push('resolved');
    } finally {
      mock.restoreAll();
    }
    assert.deepEqual(order, ['fsync called', 'fsync done', 'resolved']);
    // Another reader sees the whole line at once.
    const record = JSON.parse(fs.readFileSync(file, 'utf8'));
    assert.equal(record.reservation_id, one.reservationId);
    assert.equal(record.request_bytes, 1234);
    assert.equal(record.estimate_nanos, 90);
    assert.equal(record.ttl_us, 30_000_000);
    assert.equal(record.lane, LANE);
    assert.equal((fs.statSync(file).mode & 0o777).toString(8), '600');
  });

  test('a torn last line is ignored and sealed', async () => {
    const kept = entry();
    let journal = open();
    await journal.recordReserve(kept);
    await journal.close();
    const whole = fs.readFileSync(file);
    const torn = Buffer.from(JSON.stringify({ v: 1, kind: 'reserve', reservation_id: 'torn' }).slice(0, 30));
    fs.writeFileSync(file, Buffer.concat([whole, torn])); // a crash in the middle of a write

    const later = entry();
    journal = open();
    assert.deepEqual(ids(journal.pending()), [kept.reservationId]);
    assert.equal(journal.skippedLines, 1);
    await journal.recordReserve(later);
    await journal.close();

    journal = open();
    assert.deepEqual(ids(journal.pending()), [kept.reservationId, later.reservationId]);
    assert.equal(journal.skippedLines, 1, 'the torn fragment stays a line of its own');
    const bytes = fs.readFileSync(file);
    const sealed = Buffer.concat([whole, torn, Buffer.from('\n')]);
    assert.ok(bytes.subarray(0, sealed.length).equals(sealed));
  });

  test('a write that fails half-way leaves the next line whole', async () => {
    const journal = open();
    const lost = entry();
    const kept = entry();
    const realWrite = fs.write;
    mock.method(fs, 'write', (descriptor, buffer, offset, length, position, callback) => {
      // Half the line reaches the file, then the disk is full.
      realWrite(descriptor, buffer, offset, Math.floor(length / 2), position, () => {
        callback(Object.assign(new Error('no space left on device'), { code: 'ENOSPC' }));
      });
    });
    try {
      await assert.rejects(journal.recordReserve(lost), /no space/);
    } finally {
      mock.restoreAll();
    }
    await journal.recordReserve(kept);
    await journal.close();
    const again = open();
    assert.deepEqual(ids(again.pending()), [kept.reservationId]);
    assert.equal(again.skippedLines, 1);
  });

  test('garbage and contradicting lines are skipped', async () => {
    const first = entry();
    let journal = open();
    await journal.recordReserve(first);
    await journal.close();
    fs.appendFileSync(file, '[1, 2]\n');
    fs.appendFileSync(file, '{"v": 1, "kind": "end", "reservation_id": "nobody"}\n');
    fs.appendFileSync(file, '{"v": 99, "kind": "reserve"}\n');
    fs.appendFileSync(file, '\n   \n'); // blank lines are not lines at all
    journal = open();
    assert.equal(journal.pending().length, 1);
    assert.equal(journal.skippedLines, 3);
  });

  test('one client at a time', async () => {
    const journal = open();
    // Held by this very process: the message must not send the lane hunting for another process.
    assert.throws(() => open(), (error) => error instanceof JournalLocked && /in use by another client \(this process or another\)/.test(error.message), 'a second Journal of this process');

    // Another process holding it.
    const holder = spawn(process.execPath, [
      '-e',
      `const { Journal } = require(${JSON.stringify(path.resolve(__dirname, '..'))});
       new Journal(${JSON.stringify(`${file}.other`)}, 'recall');
       console.log('held');
       setInterval(() => {}, 1000);`,
    ], { stdio: ['ignore', 'pipe', 'inherit'] });
    try {
      await new Promise((resolve, reject) => {
        holder.stdout.once('data', resolve);
        holder.once('exit', reject);
      });
      assert.throws(() => new Journal(`${file}.other`, LANE), JournalLocked);
    } finally {
      holder.kill('SIGKILL');
      await new Promise((resolve) => (holder.exitCode !== null || holder.signalCode !== null ? resolve() : holder.once('exit', resolve)));
    }
    // Its lock outlived it (SIGKILL), but it is dead: the lock is taken over.
    assert.ok(fs.existsSync(`${file}.other.lock`));
    const taken = new Journal(`${file}.other`, LANE);
    opened.push(taken);
    assert.equal(JSON.parse(fs.readFileSync(`${file}.other.lock`, 'utf8')).pid, process.pid);

    await journal.close();
    assert.equal(fs.existsSync(`${file}.lock`), false, 'closing releases the lock');
    open(); // free again once closed
  });

  test('a lock left by an earlier process with this same pid is taken over', async () => {
    // A lane in a container restarted after a SIGKILL runs as the same pid (1,
    // say) on the same host name: the lock file names this very pid, yet no
    // Journal of this process holds it. Refusing it would refuse every restart.
    const stale = { pid: process.pid, host: os.hostname(), at: '2020-01-01T00:00:00.000000+00:00' };
    fs.writeFileSync(`${file}.lock`, `${JSON.stringify(stale)}\n`);
    const journal = open();
    assert.equal(JSON.parse(fs.readFileSync(`${file}.lock`, 'utf8')).at === stale.at, false, 'a lock of its own now');
    assert.throws(() => open(), JournalLocked, 'a second Journal of this process is still refused');
    await journal.close();
    assert.equal(fs.existsSync(`${file}.lock`), false);
  });

  test('calls at once journal no more in-doubt Reserves than the limit', async () => {
    const journal = open();
    const refund = { settlement: Settlement.REFUND, httpStatus: 0, usage: null, reason: 'the call was not made' };
    const kept = await Promise.all(
      Array.from({ length: 12 }, () => journal.recordInDoubt(entry(Source.IN_DOUBT, 0n), refund, 3)),
    );
    assert.equal(kept.filter(Boolean).length, 3);
    const inDoubt = journal.pending().filter((one) => one.source === Source.IN_DOUBT);
    assert.equal(inDoubt.length, 3);
    assert.ok(inDoubt.every((one) => one.ending?.settlement === Settlement.REFUND));
  });

  test('a journal belongs to one lane', async () => {
    const journal = open();
    await journal.recordReserve(entry());
    await journal.close();
    assert.throws(() => open({}, 'other-lane'), (error) => error instanceof JournalError && /another lane/.test(error.message));
    assert.equal(fs.existsSync(`${file}.lock`), false, 'a refused open keeps no lock');
  });

  test('a journal past four times its limit is not read', async () => {
    const journal = open();
    for (let index = 0; index < 3; index += 1) await journal.recordReserve(entry());
    await journal.close();
    const size = fs.statSync(file).size;
    assert.throws(() => open({ maxBytes: Math.floor(size / 4) - 1, rotateBytes: 1 }), /larger than it may grow/);
  });

  test('a full journal refuses new entries but takes endings', async () => {
    const journal = open({ maxBytes: 500, rotateBytes: 500 });
    const first = entry();
    await journal.recordReserve(first);
    await journal.recordReserve(entry());
    await assert.rejects(journal.recordReserve(entry()), JournalFull);
    await journal.recordEnd(first.reservationId, SUCCESS, 5n);
    await journal.recordReplay(first.reservationId, ReplayResult.LANDED);
  });

  test('a replayed journal is rotated without deleting anything', async () => {
    const journal = open({ maxBytes: 4096, rotateBytes: 200 });
    const one = entry();
    await journal.recordReserve(one);
    assert.equal(await journal.rotateIfReplayed(), null, 'pending entries keep the file');
    await journal.recordEnd(one.reservationId, SUCCESS, 5n);
    await journal.recordReplay(one.reservationId, ReplayResult.LANDED);
    const archive = await journal.rotateIfReplayed();
    assert.ok(archive !== null && fs.existsSync(archive));
    assert.match(path.basename(archive), /^journal\.jsonl\.\d{8}T\d{12}Z\.done$/);
    assert.deepEqual(journal.pending(), []);
    assert.equal(journal.sizeBytes, 0);
    await journal.recordReserve(entry());
    assert.equal(fs.readFileSync(archive, 'utf8').trimEnd().split('\n').length, 3);
    assert.equal(fs.readFileSync(file, 'utf8').trimEnd().split('\n').length, 1);
  });

  test('two rotations at one clock reading keep both archives', async (t) => {
    // The archive is named by the wall clock, which can repeat (stepped back,
    // frozen, two rotations in one millisecond): a rename over the first
    // archive would delete it.
    t.mock.timers.enable({ apis: ['Date'], now: new Date('2026-10-26T12:00:00Z') });
    const journal = open({ maxBytes: 4096, rotateBytes: 200 });
    const archives = [];
    for (let round = 0; round < 2; round += 1) {
      const one = entry();
      await journal.recordReserve(one);
      await journal.recordEnd(one.reservationId, SUCCESS, 5n);
      await journal.recordReplay(one.reservationId, ReplayResult.LANDED);
      archives.push(await journal.rotateIfReplayed());
    }
    assert.notEqual(archives[0], archives[1]);
    const ids = archives.map((archive) => JSON.parse(fs.readFileSync(archive, 'utf8').split('\n')[0]).reservation_id);
    assert.equal(new Set(ids).size, 2, "each archive keeps its own rotation's lines");
  });

  test('close() waits for the writes asked for before it; a closed journal takes no more lines', async () => {
    const journal = open();
    const one = entry();
    const written = journal.recordReserve(one);
    await journal.close();
    await written;
    assert.ok(fs.readFileSync(file, 'utf8').includes(one.reservationId));
    await assert.rejects(journal.recordReserve(entry()), JournalError);
    assert.equal(journal.isOpen, false);
  });

  test('cache counts survive a reopen; an ending written before them reads them as zero', async () => {
    const cached = { inputTokens: 10_000n, outputTokens: 500n, billedNanos: null, cachedInputTokens: 6_000n, cacheWriteTokens: 2_000n };
    const first = entry();
    const second = entry();
    let journal = open();
    await journal.recordReserve(first);
    await journal.recordEnd(first.reservationId, { ...SUCCESS, usage: cached }, 7n);
    await journal.recordReserve(second);
    await journal.close();
    const oldLine = {
      v: 1,
      at: nowText(),
      kind: 'end',
      reservation_id: second.reservationId,
      settlement: 'settle_succeeded',
      http_status: 200,
      usage: { input_tokens: 10, output_tokens: 20, billed_nanos: null },
      reason: '',
      local_charge_nanos: 42,
    };
    fs.appendFileSync(file, `${JSON.stringify(oldLine)}\n`);
    journal = open();
    assert.equal(journal.skippedLines, 0);
    assert.deepEqual(journal.entry(first.reservationId).ending.usage, cached);
    assert.deepEqual(journal.entry(second.reservationId).ending.usage, { ...SUCCESS.usage });
  });

  test('integers beyond 2^53 keep every digit', async () => {
    const big = 2n ** 62n - 1n;
    const one = newEntry(
      LANE,
      { reservationId: 'big', model: 'm', requestBytes: 2n ** 40n, maxOutputTokens: 10n ** 12n, estimateNanos: 2n ** 62n },
      Source.ALLOWANCE,
      big,
    );
    let journal = open();
    await journal.recordReserve(one);
    await journal.close();
    assert.match(fs.readFileSync(file, 'utf8'), /"local_hold_nanos":4611686018427387903,/);
    journal = open();
    assert.equal(journal.entry('big').localHoldNanos, big);
    assert.equal(journal.entry('big').arguments.estimateNanos, 2n ** 62n);
    assert.deepEqual(decode('{"a":[1,-2.5,"\\u00e9",true,null,{}]}'), Object.assign(Object.create(null), { a: [1n, -2.5, 'é', true, null, Object.create(null)] }));
    assert.equal(encode({ b: 1n, a: 'é' }), '{"a":"\\u00e9","b":1}', 'sorted keys, ASCII only, as Python writes');
    assert.throws(() => decode('{"a":1}x'), SyntaxError);
  });

  test('arguments the ledger would refuse are not journaled', () => {
    const base = { reservationId: 'x', model: 'm', requestBytes: 1n, maxOutputTokens: 1n };
    for (const bad of [
      { reservationId: 'has space' },
      { reservationId: '' },
      { model: '' },
      { requestBytes: -1n },
      { requestBytes: 2n ** 40n + 1n },
      { maxOutputTokens: 10n ** 12n + 1n },
      { estimateNanos: 2n ** 62n + 1n },
      { ttlUs: 0n },
    ]) {
      assert.throws(() => newEntry(LANE, { ...base, ...bad }, Source.ALLOWANCE, 1n), RangeError, JSON.stringify(Object.keys(bad)));
    }
  });
});

describe('a lock whose holder died', () => {
  const linux = process.platform === 'linux';
  test('is taken over while the holder is a zombie its parent has not reaped yet', { skip: (!linux || !hasPython) && 'needs Linux /proc and the venv python' }, async () => {
    // A parent that forks a child, lets it exit and never waits for it.
    const parent = spawn(PYTHON, ['-c', 'import os, time\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nprint(pid, flush=True)\ntime.sleep(30)'], { stdio: ['ignore', 'pipe', 'inherit'] });
    try {
      const pid = Number(await new Promise((resolve) => parent.stdout.once('data', (data) => resolve(String(data).trim()))));
      const state = () => fs.readFileSync(`/proc/${pid}/stat`, 'utf8').replace(/^.*\) /s, '')[0];
      for (let tries = 0; state() !== 'Z' && tries < 100; tries += 1) await new Promise((resolve) => setTimeout(resolve, 10));
      assert.equal(state(), 'Z', 'the child is a zombie');
      fs.writeFileSync(`${file}.lock`, `${JSON.stringify({ pid, host: os.hostname(), at: nowText() })}\n`);
      open();
      assert.equal(JSON.parse(fs.readFileSync(`${file}.lock`, 'utf8')).pid, process.pid);
    } finally {
      parent.kill('SIGKILL');
    }
  });
});

describe('a journal path that cannot hold a journal', () => {
  for (const where of ['a directory', 'under a file', 'where nothing can be made']) {
    test(`is refused naming the setting: ${where}`, () => {
      fs.writeFileSync(path.join(directory, 'a-file'), 'not a directory');
      const target = {
        'a directory': directory,
        'under a file': path.join(directory, 'a-file', 'journal.jsonl'),
        'where nothing can be made': '/proc/ledger-journal.jsonl',
      }[where];
      assert.throws(
        () => new Journal(target, LANE),
        (error) => error instanceof JournalError && /^journalPath .*: cannot open the journal \(/.test(error.message),
      );
    });
  }
});

describe('a journal under a folder that cannot be made', () => {
  // Node's own fs.mkdirSync(..., {recursive: true}) spins for ever where
  // mkdir(2) answers ENOENT under a parent that exists (procfs), so the lane
  // would hang in new LaneClient. Run in a child, killed if it never returns.
  test('is refused with a JournalError, as the Python client refuses it', { skip: !fs.existsSync('/proc/self') && 'no /proc' }, () => {
    const script = `
const { Journal, JournalError } = require(${JSON.stringify(path.resolve(__dirname, '..'))});
try { new Journal('/proc/ledger-journal-folder/journal.jsonl', 'recall'); console.log('opened'); }
catch (error) { console.log(error instanceof JournalError ? 'JournalError' : error.name); }`;
    const child = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8', timeout: 20_000, killSignal: 'SIGKILL' });
    assert.equal(child.signal, null, 'it returned');
    assert.equal(child.stdout.trim(), 'JournalError');
  });
});

describe('one format with the Python client', { skip: !hasPython && 'the repository venv has no ledger_client' }, () => {
  const PYTHON_READS = `
import json, sys
from ledger_client.journal import read_entries
entries, skipped, torn = read_entries(open(sys.argv[1], 'rb').read())
print(json.dumps({'skipped': skipped, 'torn': torn, 'entries': [
  {'id': e.reservation_id, 'source': e.source.value, 'hold': str(e.local_hold_nanos),
   'estimate': str(e.arguments.estimate_nanos), 'ttl_us': e.arguments.ttl_us, 'model': e.arguments.model,
   'settlement': e.ending.settlement.value if e.ending else None, 'reason': e.ending.reason if e.ending else None,
   'cached': e.ending.usage.cached_input_tokens if e.ending and e.ending.usage else None,
   'charge': str(e.local_charge_nanos), 'replay': e.replay.value if e.replay else None, 'trace_id': e.trace_id}
  for e in entries.values()]}))
`;
  const PYTHON_WRITES = `
import sys
from ledger_client.bookings import ReserveArguments
from ledger_client.journal import Journal, JournalEntry, Source, ReplayResult, now_text
from ledger_client.outcomes import Ending, Settlement, Usage
with Journal(sys.argv[1], 'recall', max_bytes=1 << 20, rotate_bytes=1 << 19) as journal:
    for index, source in enumerate((Source.ALLOWANCE, Source.LEDGER, Source.IN_DOUBT)):
        arguments = ReserveArguments(f'py-{index}', 'model-b', 3500, 500, 2**62 if index == 0 else None, 5_000_000)
        journal.record_reserve(JournalEntry('recall', arguments, source, 2**62 - index, now_text(), trace_id='${TRACE_ID}'))
    journal.record_end('py-0', Ending(Settlement.SETTLE_SUCCEEDED, 200, Usage(100, 7, None, 60, 20)), 123)
    journal.record_end('py-2', Ending(Settlement.REFUND, 0, None, 'pas envoy\\u00e9'), 0)
    journal.record_replay('py-2', ReplayResult.ABSENT, 'nothing there')
`;

  test('Python reads what Node writes', async () => {
    const journal = open();
    const allowance = entry(Source.ALLOWANCE, 2n ** 62n - 1n);
    const cached = { inputTokens: 100n, outputTokens: 7n, billedNanos: null, cachedInputTokens: 60n, cacheWriteTokens: 20n };
    await journal.recordReserve(allowance);
    await journal.recordEnd(allowance.reservationId, { ...SUCCESS, usage: cached }, 1234n);
    const inDoubt = newEntry(LANE, { reservationId: 'doubt', model: 'model-b', requestBytes: 0n, maxOutputTokens: 0n }, Source.IN_DOUBT, 0n);
    await journal.recordReserve(inDoubt);
    await journal.recordEnd('doubt', { settlement: Settlement.REFUND, httpStatus: 0, usage: null, reason: 'pas envoyé' }, 0n);
    await journal.recordReplay('doubt', ReplayResult.ABSENT, 'the ledger holds nothing for it');
    await journal.close();
    const read = JSON.parse(execFileSync(PYTHON, ['-c', PYTHON_READS, file], { encoding: 'utf8' }));
    assert.equal(read.skipped, 0);
    assert.equal(read.torn, false);
    assert.deepEqual(read.entries, [
      {
        id: allowance.reservationId, source: 'allowance', hold: String(2n ** 62n - 1n), estimate: '90', ttl_us: 30_000_000,
        model: 'model-a', settlement: 'settle_succeeded', reason: '', cached: 60, charge: '1234', replay: null, trace_id: TRACE_ID,
      },
      {
        id: 'doubt', source: 'in_doubt', hold: '0', estimate: 'None', ttl_us: null, model: 'model-b',
        settlement: 'refund', reason: 'pas envoyé', cached: null, charge: '0', replay: 'absent', trace_id: '',
      },
    ]);
  });

  test('Node reads what Python writes', () => {
    execFileSync(PYTHON, ['-c', PYTHON_WRITES, file]);
    const journal = open();
    assert.equal(journal.skippedLines, 0);
    assert.deepEqual(ids(journal.entries()), ['py-0', 'py-1', 'py-2']);
    assert.deepEqual(ids(journal.pending()), ['py-0', 'py-1']);
    const [first, second, third] = journal.entries();
    assert.deepEqual(first.arguments, {
      reservationId: 'py-0', model: 'model-b', requestBytes: 3500n, maxOutputTokens: 500n, estimateNanos: 2n ** 62n, ttlUs: 5_000_000n,
    });
    assert.equal(first.source, Source.ALLOWANCE);
    assert.equal(first.localHoldNanos, 2n ** 62n);
    assert.equal(first.traceId, TRACE_ID);
    assert.deepEqual(first.ending, {
      settlement: 'settle_succeeded', httpStatus: 200, reason: '',
      usage: { inputTokens: 100n, outputTokens: 7n, billedNanos: null, cachedInputTokens: 60n, cacheWriteTokens: 20n },
    });
    assert.equal(first.localChargeNanos, 123n);
    assert.equal(second.source, Source.LEDGER);
    assert.equal(second.ending, null);
    assert.equal(second.arguments.estimateNanos, null);
    assert.equal(third.ending.reason, 'pas envoyé');
    assert.equal(third.replay, ReplayResult.ABSENT);
    assert.equal(third.replayDetail, 'nothing there');
  });
});

describe("the journal's check of a Reserve's arguments", () => {
  // The journal keeps only ids and models a Reserve takes, refused by the same
  // rule and the same words (clients/cases/arguments.json), as the Python
  // journal keeps ReserveArguments.
  const { checkArguments } = require('../lib/journal');
  const ARGUMENTS = require('../../cases/arguments.json');
  const cases = ARGUMENTS.reserve.filter((item) => ['reservation_id', 'model'].includes(Object.keys(item.set).join()));
  for (const argumentCase of cases) {
    test(argumentCase.why, () => {
      const values = { ...ARGUMENTS.reserve_defaults, ...argumentCase.set };
      const check = () =>
        checkArguments({ reservationId: values.reservation_id, model: values.model, requestBytes: 100n, maxOutputTokens: 10n });
      if (argumentCase.accepted) check();
      else assert.throws(check, (error) => error instanceof RangeError && error.message === argumentCase.message);
    });
  }
});
