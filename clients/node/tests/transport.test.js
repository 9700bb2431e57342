'use strict';
// The client against a scripted server: TLS and grants on the wire, and what
// call() does when the ledger's answer is lost.

const { after, before, describe, test } = require('node:test');
const assert = require('node:assert/strict');
const grpc = require('@grpc/grpc-js');
const { startFakeLedger, ledgerStatus, makeCertificates } = require('./fake-ledger');
const { LaneClient, Completed, DeadlineExceeded, InternalError, StoreUnavailable, Unavailable, isLedgerUnavailable } = require('..');

const REQUEST = Object.freeze({ model: 'm', requestBytes: 100, maxOutputTokens: 10 });
const ADMITTED = Object.freeze({ decision: 'ADMITTED', hold_nanos: '5000', cap_nanos: '5000' });
const SETTLED = Object.freeze({ charged_nanos: '1234', state: 'SETTLED', balance: null });
// Generous, so that a loaded test machine does not turn a slow handshake into a failure.
const DEADLINE_MS = 3000;

describe('TLS and grants', () => {
  const certificates = makeCertificates();
  let fake;

  before(async () => {
    if (!certificates) return;
    const credentials = grpc.ServerCredentials.createSsl(
      certificates.ca,
      [{ cert_chain: certificates.serverCert, private_key: certificates.serverKey }],
      true,
    );
    fake = await startFakeLedger({ GetBalance: (request) => ({ lane: request.lane, limit_nanos: '7' }) }, { credentials });
  });
  after(async () => fake?.stop());

  test('mutual TLS, with the grant on every call', { skip: !certificates && 'openssl is not installed' }, async () => {
    const client = new LaneClient(`localhost:${fake.port}`, 'recall', {
      grant: 'grant-1',
      tls: { rootCerts: certificates.ca, clientCert: certificates.clientCert, clientKey: certificates.clientKey },
      deadlineMs: DEADLINE_MS,
    });
    try {
      await client.waitForReady();
      const balance = await client.balance();
      assert.equal(balance.limitNanos, 7n);
      assert.equal(fake.calls.at(-1).metadata.authorization, 'Bearer grant-1');
    } finally {
      client.close();
    }
  });

  test('without a client certificate the handshake fails', { skip: !certificates && 'openssl is not installed' }, async () => {
    const client = new LaneClient(`127.0.0.1:${fake.port}`, 'recall', {
      grant: 'grant-1',
      tls: { rootCerts: certificates.ca, serverName: 'localhost' },
      deadlineMs: DEADLINE_MS,
    });
    try {
      await assert.rejects(client.balance(), Unavailable);
    } finally {
      client.close();
    }
  });
});

describe('lost answers', () => {
  test('an unconfirmed Settle is sent again with the same content', async () => {
    let failures = 2;
    const fake = await startFakeLedger({
      Reserve: () => ADMITTED,
      Settle: () => {
        if (failures-- > 0) throw ledgerStatus(grpc.status.UNAVAILABLE, 'STORE_UNAVAILABLE');
        return SETTLED;
      },
    });
    const client = new LaneClient(`127.0.0.1:${fake.port}`, 'recall', { grant: () => 'rotating', deadlineMs: DEADLINE_MS });
    try {
      const result = await client.call(REQUEST, async () => ({ httpStatus: 200, usage: { inputTokens: 3, outputTokens: 4 } }));
      assert.equal(result.chargedNanos, 1234n);
      assert.equal(result.ledgerError, null);
      const settles = fake.calls.filter((call) => call.method === 'Settle');
      assert.equal(settles.length, 3);
      for (const settle of settles) assert.deepEqual(settle.request, settles[0].request);
      assert.equal(settles[0].request.outcome, 'SUCCEEDED');
      assert.equal(settles[0].request.input_tokens, '3');
      assert.equal(settles[0].metadata.authorization, 'Bearer rotating');
    } finally {
      client.close();
      await fake.stop();
    }
  });

  test('a Settle that never gets through is reported, not lost', async () => {
    const fake = await startFakeLedger({
      Reserve: () => ADMITTED,
      Settle: () => {
        throw ledgerStatus(grpc.status.UNAVAILABLE, 'STORE_UNAVAILABLE');
      },
    });
    const client = new LaneClient(`127.0.0.1:${fake.port}`, 'recall', { endAttempts: 2, deadlineMs: DEADLINE_MS });
    try {
      const result = await client.call(REQUEST, async () => ({ httpStatus: 500, answer: 42 }));
      assert.ok(result instanceof Completed);
      assert.equal(result.value.answer, 42);
      assert.equal(result.chargedNanos, null);
      assert.ok(result.ledgerError instanceof StoreUnavailable);

      const crash = new Error('socket hang up');
      await assert.rejects(
        client.call(REQUEST, async () => {
          throw crash;
        }),
        (error) => error === crash && error.ledgerError instanceof StoreUnavailable,
      );
      assert.equal(fake.calls.filter((call) => call.method === 'Settle').length, 4);
    } finally {
      client.close();
      await fake.stop();
    }
  });

  test('a Reserve that goes unanswered is denied, and refunded as never sent', async () => {
    const fake = await startFakeLedger({
      Reserve: () => new Promise((resolve) => setTimeout(() => resolve(ADMITTED), 1500).unref()),
      Refund: () => ({ balance: null }),
    });
    const client = new LaneClient(`127.0.0.1:${fake.port}`, 'recall', { deadlineMs: 500 });
    try {
      await client.waitForReady();
      let ran = false;
      const denied = await client.call(REQUEST, async () => {
        ran = true;
      });
      assert.equal(ran, false);
      assert.equal(denied.reason, 'LEDGER_UNAVAILABLE');
      assert.ok(denied.ledgerError instanceof DeadlineExceeded);
      // The refund goes in the background, off the call's path.
      for (let waited = 0; fake.calls.length < 2 && waited < 5000; waited += 10) {
        await new Promise((resolve) => setTimeout(resolve, 10));
      }
      const [reserve, refund] = fake.calls;
      assert.equal(refund.method, 'Refund');
      assert.equal(refund.request.reservation_id, reserve.request.reservation_id);
      assert.equal(refund.request.http_status, '0');
      assert.match(refund.request.reason, /^not sent/);
    } finally {
      client.close();
      await fake.stop();
    }
  });

  test('INTERNAL carries the id the server logged it under', async () => {
    const fake = await startFakeLedger({
      GetBalance: () => {
        const status = ledgerStatus(grpc.status.INTERNAL, 'INTERNAL', 'internal error (id 0123abcd)');
        status.metadata.set('ledger-error-id', '0123abcd');
        throw status;
      },
    });
    const client = new LaneClient(`127.0.0.1:${fake.port}`, 'recall', { deadlineMs: DEADLINE_MS });
    try {
      await assert.rejects(client.balance(), (error) => error instanceof InternalError && error.errorId === '0123abcd');
    } finally {
      client.close();
      await fake.stop();
    }
  });
});

test('a tail the ledger never accepts throws DeadlineExceeded naming deadlineMs, an outage', async () => {
  // A listener that takes the connection and says nothing, as a frozen ledger
  // does: the stream is given up at its deadline. It threw "Cancelled on
  // client", as if the lane had cancelled it.
  const net = require('node:net');
  const sockets = [];
  const silent = net.createServer((socket) => sockets.push(socket));
  await new Promise((resolve) => silent.listen(0, '127.0.0.1', resolve));
  const client = new LaneClient(`127.0.0.1:${silent.address().port}`, 'recall', { grant: 'grant-1', watchResumeMs: 0 });
  try {
    await assert.rejects(client.watchEvents({ deadlineMs: 100 }).next(), (error) => {
      assert.ok(error instanceof DeadlineExceeded, `${error}`);
      assert.ok(isLedgerUnavailable(error));
      assert.match(error.message, /did not accept the event stream within its deadlineMs \(100 ms\)/);
      return true;
    });
  } finally {
    await client.close();
    for (const socket of sockets) socket.destroy();
    silent.close();
  }
});
