'use strict';
// The lane's events through the lane client (listEvents, allEvents,
// watchEvents) against a real ledger server: pages, the tail, its resumption
// after the server restarts or its connection is cut, and the streams it
// frees. The Python client's are clients/python/tests/test_client_events.py.

const { after, before, test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const net = require('node:net');
const path = require('node:path');
const { startLedger } = require('./ledger-server');
const { LaneClient, PermissionDenied, TooManyWatchers, Unavailable } = require('..');

// 1 nano per input token and 2 per output token, per million: easy sums.
const PRICES = { m: { input_nanos_per_million_tokens: '1000000', output_nanos_per_million_tokens: '2000000' } };
const REQUEST = Object.freeze({ model: 'm', requestBytes: 100, maxOutputTokens: 10 });
// Generous, for a busy machine; never a measure.
const DEADLINE_MS = 5000;
const WAIT_MS = 60_000;
// The server's share of event streams for one grant (max_watchers_per_grant).
const STREAMS_PER_GRANT = 16;

let ledger;
let lanes = 0;
const clients = [];

before(async () => {
  ledger = await startLedger();
});

after(async () => {
  for (const client of clients) await client.close();
  await ledger?.stop();
});

/** A new lane and a client of it whose grant reads its history (charge alone cannot: auth.py). */
async function reader(server = ledger, options = {}) {
  lanes += 1;
  const lane = `events-${process.pid}-${lanes}`;
  await server.admin.putLane({ lane: { lane, limit_nanos: '1000000', prices: PRICES } });
  const grant = server.issueGrant('--lane', lane, '--scope', 'charge', '--scope', 'read');
  const client = new LaneClient(server.address, lane, { grant, deadlineMs: DEADLINE_MS, logger: null, ...options });
  clients.push(client);
  return client;
}

async function reserve(client, count, prefix = 'r') {
  for (let number = 0; number < count; number += 1) {
    await client.reserve({ ...REQUEST, reservationId: `${prefix}-${number}` });
  }
}

/** Reserves sent again (the same ids: booked once) until a restarted ledger answers. */
async function reserveOnceBack(client, count) {
  const giveUp = Date.now() + WAIT_MS;
  for (let number = 0; number < count; number += 1) {
    for (;;) {
      try {
        await client.reserve({ ...REQUEST, reservationId: `after-restart-${number}` });
        break;
      } catch (error) {
        if (!(error instanceof Unavailable) || Date.now() > giveUp) throw error;
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
    }
  }
}

async function take(iterator, count) {
  const taken = [];
  while (taken.length < count) {
    const { value, done } = await iterator.next();
    assert.equal(done, false, 'the tail ended early');
    taken.push(value);
  }
  return taken;
}

async function collect(iterable) {
  const all = [];
  for await (const event of iterable) all.push(event);
  return all;
}

const seqs = (events) => events.map((event) => BigInt(event.seq));

test('pages follow each other to the end of the log', async () => {
  const client = await reader();
  await reserve(client, 5);
  const expected = seqs(await ledger.events(client.lane)); // lane_configured, then 5 reserved
  assert.equal(expected.length, 6);
  const first = await client.listEvents({ pageSize: 4 });
  assert.deepEqual(seqs(first.events), expected.slice(0, 4));
  assert.equal(first.nextAfterSeq, expected[3]);
  const second = await client.listEvents({ afterSeq: first.nextAfterSeq, pageSize: 4 });
  assert.deepEqual(seqs(second.events), expected.slice(4));
  assert.equal(second.nextAfterSeq, null, 'the end of the log as it stands');
  assert.deepEqual(seqs(await collect(client.allEvents({ pageSize: 2 }))), expected);
  assert.deepEqual(seqs(await collect(client.allEvents({ afterSeq: expected[2] }))), expected.slice(3));
});

test('events are typed as the ledger recorded them', async () => {
  const client = await reader();
  const reservation = await client.reserve({ ...REQUEST, reservationId: 'r-typed' });
  const reserved = (await collect(client.allEvents())).filter((event) => event.kind === 'reserved');
  assert.equal(reserved.length, 1);
  const [event] = reserved;
  assert.deepEqual([event.lane, event.reservationId, event.model], [client.lane, 'r-typed', 'm']);
  assert.equal(typeof event.seq, 'bigint');
  assert.equal(event.holdNanos, reservation.holdNanos);
  assert.equal(event.amountNanos, reservation.holdNanos);
  assert.ok(event.occurredAt instanceof Date);
  assert.deepEqual(event.expiresAt, reservation.expiresAt);
  assert.equal(event.billedNanos, null);
  assert.equal(event.denialReason, null);
  assert.ok(event.hash && event.previousHash);
  await client.settle({ reservationId: 'r-typed', outcome: 'SUCCEEDED', inputTokens: 10, outputTokens: 5, billedNanos: 7, httpStatus: 200 });
  const settled = await client.listEvents({ afterSeq: event.seq });
  assert.equal(settled.events.length, 1);
  const [ended] = settled.events;
  assert.deepEqual([ended.kind, ended.outcome, ended.httpStatus, ended.inputTokens], ['settled', 'SUCCEEDED', 200n, 10n]);
  assert.deepEqual([ended.billedNanos, ended.amountNanos, ended.previousHash], [7n, 7n, event.hash]);
});

test('a lane_configured event carries the policy the ledger resolved', async () => {
  // reader() sets the limit and one price; the ledger fills in the rest with
  // its defaults (docs/semantics.md). The Python client's test of the same name.
  const client = await reader();
  const [configured] = (await client.listEvents({ pageSize: 1 })).events;
  assert.equal(configured.kind, 'lane_configured');
  const { policy } = configured;
  assert.deepEqual([policy.lane, policy.limitNanos, policy.version], [client.lane, 1_000_000n, configured.seq]);
  assert.deepEqual([policy.windowSeconds, policy.holdTtlSeconds], [86_400, 120]);
  assert.deepEqual([policy.bytesPerTokenMilli, policy.overheadTokens], [3500n, 0n]);
  const price = { inputNanosPerMillionTokens: 1_000_000n, outputNanosPerMillionTokens: 2_000_000n, cachedInputNanosPerMillionTokens: null, cacheWriteNanosPerMillionTokens: null };
  assert.deepEqual(policy.prices, new Map([['m', price]]));
  assert.deepEqual([policy.expireCharge, policy.parent, policy.maxChargeMultiple], ['HOLD', '', 100n]);
  assert.deepEqual(policy.updatedAt, configured.occurredAt);
  await reserve(client, 1);
  assert.deepEqual((await client.listEvents({ afterSeq: configured.seq })).events.map((event) => event.policy), [null]);
});

test('a grant without read is refused the history', async () => {
  // A lane's usual grant (charge) reads its balance and bookings, not its
  // events: ListEvents and WatchEvents need read (ledger_service/api/auth.py).
  const client = await reader();
  const grant = ledger.issueGrant('--lane', client.lane, '--scope', 'charge');
  const charging = new LaneClient(ledger.address, client.lane, { grant, deadlineMs: DEADLINE_MS, logger: null });
  clients.push(charging);
  await assert.rejects(charging.listEvents(), PermissionDenied);
  await assert.rejects(charging.watchEvents().next(), PermissionDenied);
});

test('the tail sees events committed after it started', async () => {
  const client = await reader();
  const tail = client.watchEvents();
  const [configured] = await take(tail, 1); // the stream is open: the lane's first event came
  assert.equal(configured.kind, 'lane_configured');
  await reserve(client, 3);
  const later = await take(tail, 3);
  assert.deepEqual(later.map((event) => event.kind), ['reserved', 'reserved', 'reserved']);
  assert.deepEqual(seqs(later), seqs(await collect(client.allEvents({ afterSeq: configured.seq }))));
  await tail.return();
});

test('closing the client ends the tail', async () => {
  const client = await reader();
  const tail = client.watchEvents();
  await take(tail, 1);
  const next = tail.next();
  await client.close();
  assert.deepEqual(await next, { value: undefined, done: true }, 'ended without an error');
});

test('return() stops a tail waiting for its next event, and frees its stream', { timeout: WAIT_MS }, async () => {
  // A lane stopping its tail from elsewhere (a shutdown hook) while the loop
  // waits on a quiet lane: return() waited for the next event, the stream
  // held open, one of the grant's 16 (the server frees each as it sees it
  // cancelled: a tail opened at once meets TooManyWatchers until then).
  const client = await reader(ledger, { watchResumeMs: WAIT_MS });
  const tails = [];
  for (let count = 0; count < STREAMS_PER_GRANT; count += 1) {
    const tail = client.watchEvents();
    await take(tail, 1);
    tails.push(tail);
  }
  const waiting = tails.map((tail) => tail.next());
  for (const tail of tails) assert.deepEqual(await tail.return(), { value: undefined, done: true });
  for (const next of waiting) assert.deepEqual(await next, { value: undefined, done: true });
  // Every stream is free again: a 17th tail is not refused.
  const again = client.watchEvents();
  assert.equal((await again.next()).value.kind, 'lane_configured');
  await again.return();
});

test('a tail resumes after a restart without skipping or repeating an event', async () => {
  const server = await startLedger();
  try {
    const client = await reader(server);
    await reserve(client, 2);
    const tail = client.watchEvents();
    const before = await take(tail, 3);
    await server.halt(); // the stream ends: SHUTTING_DOWN, then no ledger at all
    await server.restart(); // the same port and data directory
    await reserveOnceBack(client, 3);
    const later = await take(tail, 3);
    assert.deepEqual(seqs([...before, ...later]), seqs(await server.events(client.lane)));
    await tail.return();
    await client.close();
  } finally {
    await server.stop();
  }
});

/**
 * A TCP proxy to the ledger whose cut() drops every connection through it at
 * once, as a load balancer or a network failure does, while the ledger runs
 * on; new connections are taken as before.
 */
async function cuttingProxy(upstream) {
  const [host, port] = [upstream.slice(0, upstream.lastIndexOf(':')), Number(upstream.slice(upstream.lastIndexOf(':') + 1))];
  const sockets = new Set();
  const server = net.createServer((client) => {
    const target = net.connect(port, host);
    for (const end of [client, target]) {
      sockets.add(end);
      end.on('error', () => {});
      end.on('close', () => sockets.delete(end));
    }
    client.pipe(target).pipe(client);
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const cut = () => {
    for (const end of sockets) end.destroy();
  };
  return {
    address: `127.0.0.1:${server.address().port}`,
    cut,
    close: () => new Promise((resolve) => {
      cut();
      server.close(resolve);
    }),
  };
}

test('a tail resumes after its connection is cut', async () => {
  const client = await reader();
  const proxy = await cuttingProxy(ledger.address);
  try {
    const grant = ledger.issueGrant('--lane', client.lane, '--scope', 'read');
    const cutOff = new LaneClient(proxy.address, client.lane, { grant, deadlineMs: DEADLINE_MS, logger: null });
    clients.push(cutOff);
    const tail = cutOff.watchEvents();
    const before = await take(tail, 1);
    proxy.cut(); // the ledger runs on; the tail's stream is gone
    await reserve(client, 3); // booked directly, while the tail may be between streams
    const later = await take(tail, 3);
    assert.deepEqual(seqs([...before, ...later]), seqs(await ledger.events(client.lane)));
    await tail.return();
  } finally {
    await proxy.close();
  }
});

test('stopping a tail frees its stream', async () => {
  // One grant has 16 streams at the server. A tail left open would hold its
  // own: the 17th would be refused (TooManyWatchers, once its resumption gave
  // up), whether the loop was left or the iterator's return() called.
  const client = await reader(ledger, { watchResumeMs: WAIT_MS });
  for (let turn = 0; turn < STREAMS_PER_GRANT + 4; turn += 1) {
    if (turn % 2) {
      const tail = client.watchEvents();
      assert.equal((await tail.next()).value.kind, 'lane_configured');
      await tail.return();
      continue;
    }
    for await (const event of client.watchEvents()) {
      assert.equal(event.kind, 'lane_configured');
      break;
    }
  }
});

test('a refused tail throws once its resumption gives up', async () => {
  // TOO_MANY_WATCHERS is "slow down, send it again" (the error table): a tail
  // tries again, and throws it once watchResumeMs passed without room.
  const client = await reader(ledger, { watchResumeMs: 0 });
  const held = [];
  for (let count = 0; count < STREAMS_PER_GRANT; count += 1) {
    const tail = client.watchEvents();
    await tail.next();
    held.push(tail);
  }
  await assert.rejects(client.watchEvents().next(), TooManyWatchers);
  for (const tail of held) await tail.return();
});

test('the README example runs', async () => {
  const readme = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
  const code = [...readme.matchAll(/```js\n([\s\S]*?)```/g)].map((match) => match[1]).find((block) => block.includes('lane.watchEvents('));
  // A lane of its own: the README's other examples book on 'recall'.
  lanes += 1;
  const name = `readme-${process.pid}-${lanes}`;
  await ledger.admin.putLane({ lane: { lane: name, limit_nanos: '1000000', prices: PRICES } });
  const grant = ledger.issueGrant('--lane', name, '--scope', 'charge', '--scope', 'read');
  const environment = { env: { LEDGER_ADDRESS: ledger.address, LEDGER_GRANT: grant } };
  const load = new Function('require', 'process', `${code.replace("'recall'", JSON.stringify(name))}\nreturn { lane, audit };`);
  const { lane, audit } = load((module) => require(module === '@lane-ledger/client' ? '..' : module), environment);
  const recorded = [];
  let wake = () => {};
  const until = (count) => new Promise((resolve) => {
    wake = () => recorded.length >= count && resolve();
    wake();
  });
  const running = audit((event) => {
    recorded.push(event);
    wake();
  });
  const soFar = seqs(await ledger.events(name));
  await until(soFar.length);
  await reserve(lane, 2);
  await until(soFar.length + 2);
  await lane.close(); // ends the tail, and so the example's function
  await running;
  assert.deepEqual(seqs(recorded), seqs(await ledger.events(name)));
});
