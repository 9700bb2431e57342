'use strict';
// A lane's own mistakes are never an outage: a TLS option that does not match
// the ledger, or a request past the ledger's message limit, fails the same way
// on every retry, so the client rejects with an error naming what to fix and
// call() does not enter its outage mode.

const { after, before, describe, test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const net = require('node:net');
const tls = require('node:tls');
const os = require('node:os');
const path = require('node:path');
const { startLedger } = require('./ledger-server');
const { makeCertificates } = require('./fake-ledger');
const { demandsClientCertificate } = require('../lib/client');
const { LaneClient, RequestTooLarge, TlsMismatch, Unavailable, isLedgerUnavailable } = require('..');

const DEADLINE_MS = 5000;

/** The TlsMismatch a Balance call is refused with (asked anew on each call). */
async function tlsMismatch(client) {
  const error = await client.balance().then(
    () => assert.fail('the call got through'),
    (rejected) => rejected,
  );
  assert.ok(error instanceof TlsMismatch, `${error.name}: ${error.message}`);
  return error;
}

/**
 * A real ledger serving TLS with the test certificates, given to it by the
 * LEDGER_TLS_* variables; it demands a client certificate when asked to. The
 * certificates' directory goes with the ledger's stop: the server looks at the
 * files again before each handshake, so they stay while it runs.
 */
async function startTlsLedger(certificates, { demandClientCertificate }) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-tls-'));
  const files = {
    LEDGER_TLS_CERT: ['server.pem', certificates.serverCert],
    LEDGER_TLS_KEY: ['server.key', certificates.serverKey],
  };
  if (demandClientCertificate) files.LEDGER_TLS_CLIENT_CA = ['ca.pem', certificates.ca];
  for (const [variable, [name, content]] of Object.entries(files)) {
    process.env[variable] = path.join(dir, name);
    fs.writeFileSync(process.env[variable], content);
  }
  const removeDir = () => fs.rmSync(dir, { recursive: true, force: true });
  let ledger;
  try {
    ledger = await startLedger();
  } catch (error) {
    removeDir();
    throw error;
  } finally {
    for (const variable of Object.keys(files)) delete process.env[variable];
  }
  const { stop } = ledger;
  ledger.stop = async () => {
    try {
      await stop();
    } finally {
      removeDir();
    }
  };
  return ledger;
}

function closedPort() {
  return new Promise((resolve) => {
    const probe = net.createServer();
    probe.listen(0, '127.0.0.1', () => {
      const { port } = probe.address();
      probe.close(() => resolve(port));
    });
  });
}

describe('a TLS option that does not match the ledger', () => {
  const certificates = makeCertificates();
  let ledger;
  before(async () => {
    ledger = await startLedger();
  });
  after(async () => ledger?.stop());

  test('TLS to a plaintext ledger names the tls option, and is no outage', async () => {
    assert.ok(certificates, 'openssl makes the test certificates');
    const client = new LaneClient(ledger.address, 'recall', {
      grant: ledger.adminGrant,
      tls: { rootCerts: certificates.ca, serverName: 'localhost' },
      deadlineMs: DEADLINE_MS,
    });
    try {
      const error = await client.balance().then(
        () => assert.fail('the call got through'),
        (rejected) => rejected,
      );
      assert.ok(error instanceof TlsMismatch, `${error.name}: ${error.message}`);
      assert.match(error.message, /does not speak TLS/);
      assert.match(error.message, /tls/);
      assert.equal(isLedgerUnavailable(error), false);
      assert.equal(error.retryable, false);
    } finally {
      client.close();
    }
  });

  test('TLS to nobody listening is still an outage', async () => {
    const client = new LaneClient(`127.0.0.1:${await closedPort()}`, 'recall', {
      tls: { rootCerts: certificates.ca, serverName: 'localhost' },
      deadlineMs: 1000,
    });
    try {
      await assert.rejects(client.balance(), Unavailable);
    } finally {
      client.close();
    }
  });
});

describe("a request past the server's message limit", () => {
  let ledger;
  before(async () => {
    process.env.LEDGER_MAX_MESSAGE_BYTES = '200';
    try {
      ledger = await startLedger();
    } finally {
      delete process.env.LEDGER_MAX_MESSAGE_BYTES;
    }
  });
  after(async () => ledger?.stop());

  test('is RequestTooLarge, not an overloaded ledger', async () => {
    // Refused for its size before its lane is looked up.
    const client = new LaneClient(ledger.address, 'a-lane', { grant: ledger.adminGrant, deadlineMs: DEADLINE_MS });
    try {
      const error = await client
        .reserve({ reservationId: 'r-1', model: 'm'.repeat(200), requestBytes: 1000, maxOutputTokens: 100 })
        .then(() => assert.fail('the call got through'), (rejected) => rejected);
      assert.ok(error instanceof RequestTooLarge, `${error.name}: ${error.message}`);
      assert.equal(error.field, 'request');
      assert.match(error.message, /max_message_bytes/);
      assert.match(error.message, /200/);
      assert.equal(isLedgerUnavailable(error), false);
      assert.equal(error.retryable, false);
    } finally {
      client.close();
    }
  });
});

describe('plaintext to a ledger serving TLS', () => {
  const certificates = makeCertificates();
  let ledger;
  before(async () => {
    ledger = await startTlsLedger(certificates, { demandClientCertificate: false });
  });
  after(async () => ledger?.stop());

  test('its handshake is not taken for a demand of a client certificate', async () => {
    // The probe behind mutual TLS's TlsMismatch must see none here, where
    // none is demanded: a "Failed to connect" then stays an outage. Without
    // ALPN h2 in the probe, gRPC would hang up on it here too.
    assert.equal(await demandsClientCertificate(ledger.address, DEADLINE_MS), false);
  });

  test('names the tls option, on every call, and is no outage', async () => {
    // grpc-js says only "Failed to connect", as for a restarting server; one
    // TLS handshake the client tries itself tells the two apart.
    const client = new LaneClient(ledger.address, 'a-lane', { grant: 'a-grant', deadlineMs: DEADLINE_MS });
    try {
      for (let attempt = 0; attempt < 2; attempt += 1) {
        const error = await tlsMismatch(client);
        assert.match(error.message, /serves TLS/);
        assert.match(error.message, /tls/);
        assert.equal(isLedgerUnavailable(error), false);
      }
    } finally {
      client.close();
    }
  });
});

describe('TLS without a client certificate to a ledger demanding one (mutual TLS)', () => {
  const certificates = makeCertificates();
  let ledger;
  before(async () => {
    ledger = await startTlsLedger(certificates, { demandClientCertificate: true });
  });
  after(async () => ledger?.stop());

  test('names the missing client certificate, on every call, and is no outage', async () => {
    // grpc-js says only "Failed to connect" here too: the ledger completes the
    // handshake and hangs up before a byte of HTTP/2.
    const client = new LaneClient(ledger.address, 'a-lane', {
      grant: ledger.adminGrant,
      tls: { rootCerts: certificates.ca, serverName: 'localhost' },
      deadlineMs: DEADLINE_MS,
    });
    try {
      for (let attempt = 0; attempt < 2; attempt += 1) {
        const error = await tlsMismatch(client);
        assert.match(error.message, /client certificate/);
        assert.match(error.message, /clientCert/);
        assert.equal(isLedgerUnavailable(error), false);
        assert.equal(error.retryable, false);
      }
    } finally {
      client.close();
    }
  });

  test('with the client certificate, the call gets through', async () => {
    const client = new LaneClient(ledger.address, 'a-lane', {
      grant: ledger.adminGrant,
      tls: { rootCerts: certificates.ca, clientCert: certificates.clientCert, clientKey: certificates.clientKey, serverName: 'localhost' },
      deadlineMs: DEADLINE_MS,
    });
    try {
      await client.balance().catch((error) => assert.ok(!isLedgerUnavailable(error) && !(error instanceof TlsMismatch), `${error.name}: ${error.message}`));
    } finally {
      client.close();
    }
  });

  test('a TLS listener hanging up before the handshake is still an outage', async () => {
    const hangingUp = net.createServer((socket) => socket.destroy());
    await new Promise((resolve) => hangingUp.listen(0, '127.0.0.1', resolve));
    const client = new LaneClient(`127.0.0.1:${hangingUp.address().port}`, 'a-lane', {
      grant: 'a-grant',
      tls: { rootCerts: certificates.ca, serverName: 'localhost' },
      deadlineMs: 2000,
    });
    try {
      await assert.rejects(client.balance(), Unavailable);
    } finally {
      client.close();
      hangingUp.close();
    }
  });
});

describe('a TLS ledger replaced by a plaintext one on the same address', () => {
  test('is an outage again once the TLS listener is gone, not a remembered TlsMismatch', async () => {
    // The operator fixed the mismatch on the server's side; while the plaintext
    // ledger restarts (a listener hanging up), the call is a real outage.
    const certificates = makeCertificates();
    const tlsListener = tls.createServer({ cert: certificates.serverCert, key: certificates.serverKey }, (socket) =>
      socket.end(),
    );
    await new Promise((resolve) => tlsListener.listen(0, '127.0.0.1', resolve));
    const { port } = tlsListener.address();
    const client = new LaneClient(`127.0.0.1:${port}`, 'a-lane', { grant: 'a-grant', deadlineMs: DEADLINE_MS });
    let hangingUp = null;
    try {
      await assert.rejects(client.balance(), TlsMismatch);
      await new Promise((resolve) => tlsListener.close(resolve));
      hangingUp = net.createServer((socket) => {
        socket.resume();
        socket.end();
      });
      await new Promise((resolve) => hangingUp.listen(port, '127.0.0.1', resolve));
      const error = await client.balance().then(
        () => assert.fail('the call got through'),
        (rejected) => rejected,
      );
      assert.ok(error instanceof Unavailable, `${error.name}: ${error.message}`);
      assert.equal(isLedgerUnavailable(error), true);
    } finally {
      client.close();
      hangingUp?.close();
    }
  });
});
