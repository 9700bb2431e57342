'use strict';
// index.d.ts as a TypeScript lane meets it: the README's own example and a
// call() under a reservation id of the lane's, checked with tsc --strict.
// TypeScript is a devDependency (npm ci installs it); TSC_JS may name another
// lib/tsc.js. Skipped only when none can be found (a bare `npm ci --omit=dev`).

const { test } = require('node:test');
const assert = require('node:assert/strict');
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

function findTsc() {
  if (process.env.TSC_JS) return process.env.TSC_JS;
  try {
    return require.resolve('typescript/lib/tsc.js');
  } catch {
    // not installed here
  }
  const cache = path.join(os.homedir(), '.npm', '_npx');
  for (const entry of fs.existsSync(cache) ? fs.readdirSync(cache) : []) {
    const candidate = path.join(cache, entry, 'node_modules', 'typescript', 'lib', 'tsc.js');
    if (fs.existsSync(candidate)) return candidate;
  }
  return null;
}

const LANE = `
import { LaneClient, usageOf, Completed, Denied } from '../..';

const ledger = new LaneClient('127.0.0.1:1', 'recall', { grant: 'g' });

// The README's "One lane's whole call".
async function judge(prompt: string): Promise<unknown> {
  const body = JSON.stringify({ model: 'jev-small', max_tokens: 200, messages: [{ role: 'user', content: prompt }] });
  const booking = { model: 'jev-small', requestBytes: Buffer.byteLength(body), maxOutputTokens: 200 };
  const result = await ledger.call(booking, async () => {
    const response = await fetch('http://provider', { method: 'POST', body, signal: AbortSignal.timeout(300) });
    if (!response.ok) return { httpStatus: response.status };
    const answer = await response.json();
    return { httpStatus: 200, usage: usageOf(answer), answer };
  });
  if (!result.admitted) return null;
  return result.value.answer ?? null;
}

// A lane that tags its provider request with the id first passes one.
async function tagged(reservationId: string): Promise<bigint | null> {
  const result: Denied | Completed<{ httpStatus: number }> = await ledger.call(
    { model: 'jev-small', requestBytes: 10, maxOutputTokens: 20, reservationId },
    async () => ({ httpStatus: 200 }),
  );
  return result.admitted ? result.chargedNanos : null;
}

void judge;
void tagged;
`;

const EVENTS = `
import { LaneClient, LedgerEvent, EventPage, MAX_PAGE_SIZE } from '../..';

const ledger = new LaneClient('127.0.0.1:1', 'recall', { grant: 'g', watchResumeMs: 10_000 });

// The README's "The lane's history": every event so far, then each new one.
async function audit(record: (event: LedgerEvent) => void): Promise<void> {
  let last = 0n;
  for await (const event of ledger.allEvents({ pageSize: 500 })) {
    record(event);
    last = event.seq;
  }
  for await (const event of ledger.watchEvents({ afterSeq: last })) record(event);
}

async function firstPage(): Promise<bigint | null> {
  const page: EventPage = await ledger.listEvents({ afterSeq: '7', pageSize: MAX_PAGE_SIZE });
  const charged: bigint[] = page.events.map((event) => event.billedNanos ?? event.amountNanos);
  return charged.length > 0 ? page.nextAfterSeq : null;
}

// A lane_configured event's new policy, typed: its limit and one model's price.
function newLimit(event: LedgerEvent, model: string): [bigint, bigint] | null {
  if (event.policy === null) return null;
  const price = event.policy.prices.get(model);
  return price === undefined ? null : [event.policy.limitNanos, price.inputNanosPerMillionTokens];
}

void audit;
void firstPage;
void newLimit;
`;

// A lane that handles each kind of event: the switch covers every kind the
// server sends (ledger_service/domain/events.py EventKind) and nothing else,
// so a kind missing from LedgerEvent, or one it has beyond these, fails here.
const KINDS = `
import { LedgerEvent } from '../..';

function counted(event: LedgerEvent): number {
  switch (event.kind) {
    case 'reserved':
    case 'denied':
    case 'settled':
    case 'refunded':
    case 'expired':
    case 'lane_configured':
    case 'reconciled':
    case 'corrected':
      return 1;
    default: {
      const unknown: never = event.kind;
      return unknown;
    }
  }
}

void counted;
`;

// A lane that copies its allowance's settings from the policy a
// lane_configured event carries, as the README's outage section asks:
// event.policy.prices is a ReadonlyMap, and must be taken as it is.
const ALLOWANCE = `
import { LedgerEvent, OutagePolicy, DEFAULT_BYTES_PER_TOKEN_MILLI } from '../..';

function allowanceOf(event: LedgerEvent): OutagePolicy | null {
  if (event.policy === null) return null;
  return OutagePolicy.allowance({
    maxNanos: 50_000_000n,
    maxCalls: 200,
    journalPath: '/tmp/journal.jsonl',
    prices: event.policy.prices,
    bytesPerTokenMilli: event.policy.bytesPerTokenMilli ?? DEFAULT_BYTES_PER_TOKEN_MILLI,
    overheadTokens: event.policy.overheadTokens ?? 0n,
  });
}

void allowanceOf;
`;

// A call's own deadline, beside the client's: every unary call takes one.
// call() does not (its calls keep the client's, as the Python client's
// model_call does), so one given there is a type error, not silently dropped.
const DEADLINES = `
import { LaneClient } from '../..';

const ledger = new LaneClient('127.0.0.1:1', 'recall', { deadlineMs: 250 });

async function slowly(): Promise<void> {
  const deadlineMs = 1000;
  await ledger.reserve({ reservationId: 'r-1', model: 'm', requestBytes: 10, maxOutputTokens: 10, deadlineMs });
  await ledger.settle({ reservationId: 'r-1', outcome: 'UNKNOWN', deadlineMs });
  await ledger.refund({ reservationId: 'r-2', httpStatus: 429, deadlineMs });
  await ledger.balance({ deadlineMs });
  await ledger.booking('r-1', { deadlineMs, traceparent: '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01' });
  await ledger.listEvents({ pageSize: 1000, deadlineMs });
  for await (const event of ledger.allEvents({ deadlineMs })) void event;
}

void slowly;
`;

const tsc = findTsc();

/** What tsc --strict says of `source` saved as `name` here ('' when it type-checks). */
function typeCheck(name, source) {
  const folder = fs.mkdtempSync(path.join(__dirname, '.types-'));
  try {
    fs.writeFileSync(path.join(folder, name), source);
    const args = [tsc, '--noEmit', '--strict', '--skipLibCheck', '--target', 'es2022', '--module', 'commonjs', '--lib', 'es2022,dom', path.join(folder, name)];
    try {
      execFileSync(process.execPath, args, { encoding: 'utf8', stdio: 'pipe' });
      return '';
    } catch (error) {
      return `${error.stdout}${error.stderr}`;
    }
  } finally {
    fs.rmSync(folder, { recursive: true, force: true });
  }
}

test('the README example and a call() with its own reservationId type-check under --strict', { skip: tsc === null && 'no TypeScript compiler' }, () => {
  assert.equal(typeCheck('lane.ts', LANE), '');
});

test('every name the package exports at run time is declared in index.d.ts', { skip: tsc === null && 'no TypeScript compiler' }, () => {
  // A TypeScript lane can use only what the types declare.
  const names = Object.keys(require('..')).sort();
  const source = `import * as client from '../..';\nconst names: Array<keyof typeof client> = ${JSON.stringify(names)};\nvoid names;\n`;
  assert.equal(typeCheck('exports.ts', source), '');
});

test("the README's events example and a page's cursor type-check under --strict", { skip: tsc === null && 'no TypeScript compiler' }, () => {
  assert.equal(typeCheck('events.ts', EVENTS), '');
});

test("a LedgerEvent's kind is one of the server's kinds, so a typo in one does not type-check", { skip: tsc === null && 'no TypeScript compiler' }, () => {
  assert.equal(typeCheck('kinds.ts', KINDS), '');
  const typo = KINDS.replace("case 'reconciled':", "case 'reconcilled':");
  assert.match(typeCheck('typo.ts', typo), /'"reconcilled"' is not comparable to type/);
});

test("an allowance takes a lane_configured event's prices (a ReadonlyMap) as they are", { skip: tsc === null && 'no TypeScript compiler' }, () => {
  assert.equal(typeCheck('allowance.ts', ALLOWANCE), '');
});

test("each unary call takes a deadlineMs of its own, and call() does not", { skip: tsc === null && 'no TypeScript compiler' }, () => {
  assert.equal(typeCheck('deadlines.ts', DEADLINES), '');
  const inCall = `${DEADLINES}\nvoid ledger.call({ model: 'm', requestBytes: 1, maxOutputTokens: 1, deadlineMs: 1000 }, async () => ({ httpStatus: 200 }));\n`;
  assert.match(typeCheck('in-call.ts', inCall), /'deadlineMs' does not exist in type 'CallRequest'/);
});
