'use strict';
// A lane's own mistakes are never an outage: a TLS option that does not match
// the ledger, or a request past the ledger's message limit, fails the same way
// on every retry, so the client rejects with an error naming what to fix and
// call() does not enter its outage mode.

const { after, before, describe, test } = require('node:test');
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const { once } = require('node:events');
const readline = require('node:readline');
const fs = require('node:fs');
const net = require('node:net');
const tls = require('node:tls');
const os = require('node:os');
const path = require('node:path');
const { startLedger } = require('./ledger-server');
const { makeCertificates } = require('./fake-ledger');
const { refusesClientCertificate } = require('../lib/client');
const { LaneClient, OutagePolicy, RequestTooLarge, TlsMismatch, Unavailable, isLedgerUnavailable } = require('..');

const DEADLINE_MS = 5000;
const PYTHON = path.resolve(__dirname, '../../../.venv/bin/python');
// A TLS server demanding a client certificate of ca.pem, as OpenSSL refuses
// one: with an alert. It prints its port and takes one connection.
const ALERTING_SERVER = `
import pathlib, socket, ssl, sys
files = pathlib.Path(sys.argv[1])
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(files / "server.pem", files / "server.key")
context.load_verify_locations(files / "ca.pem")
context.verify_mode = ssl.CERT_REQUIRED
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
connection, _ = listener.accept()
try:
    context.wrap_socket(connection, server_side=True).close()
except OSError:
    pass
`;
// 1 nano per input token, 2 per output token; a call of 3,500 request bytes
// and 500 output tokens holds 2,000 nanos, well within the allowance.
const PRICES = Object.freeze({ 'model-a': { inputNanosPerMillionTokens: 1_000_000n, outputNanosPerMillionTokens: 2_000_000n } });
const REQUEST = Object.freeze({ model: 'model-a', requestBytes: 3_500, maxOutputTokens: 500 });

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
 * The TlsMismatch a lane with this tls option meets at `address`: on each
 * Balance (asked anew), and from call(), whose outage mode (an allowance) it
 * never enters: the model is not called and nothing is journaled.
 */
async function tlsMismatchOnEveryPath(address, tls) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-tls-lane-'));
  const journalPath = path.join(dir, 'journal.jsonl');
  const outage = OutagePolicy.allowance({ maxNanos: 10n ** 9n, maxCalls: 10, journalPath, prices: PRICES });
  const options = { grant: 'a-grant', tls, deadlineMs: DEADLINE_MS, outage, replayIntervalMs: null, logger: null };
  const client = new LaneClient(address, 'a-lane', options);
  try {
    const error = await tlsMismatch(client);
    assert.equal(isLedgerUnavailable(error), false);
    assert.equal(error.retryable, false);
    await tlsMismatch(client);
    await assert.rejects(client.call(REQUEST, () => assert.fail('the model was called')), TlsMismatch);
    await client.close();
    assert.equal(fs.existsSync(journalPath) ? fs.readFileSync(journalPath, 'utf8') : '', '');
    return error;
  } finally {
    await client.close();
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

/**
 * A plain TCP proxy (no TLS of its own) to a port on 127.0.0.1: each
 * connection goes on to the upstream, or is closed once nothing listens there.
 */
async function startProxy(upstreamPort) {
  const sockets = new Set();
  const proxy = net.createServer((client) => {
    const upstream = net.connect(upstreamPort, '127.0.0.1');
    for (const [socket, other] of [[client, upstream], [upstream, client]]) {
      sockets.add(socket);
      socket.once('close', () => sockets.delete(socket));
      socket.once('error', () => other.destroy()); // the ledger is down: accepted, then closed
    }
    client.pipe(upstream).pipe(client);
  });
  await new Promise((resolve) => proxy.listen(0, '127.0.0.1', resolve));
  return {
    address: `127.0.0.1:${proxy.address().port}`,
    close: () => {
      for (const socket of sockets) socket.destroy();
      return new Promise((resolve) => proxy.close(resolve));
    },
  };
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

  test('a clientKey that is not the key of clientCert is refused at construction, naming both', () => {
    const other = makeCertificates({ caName: 'another ca' });
    const tlsOption = { rootCerts: certificates.ca, clientCert: certificates.clientCert, clientKey: other.clientKey };
    assert.throws(() => new LaneClient(ledger.address, 'recall', { tls: tlsOption }), (error) => {
      assert.ok(error instanceof TypeError, error.name);
      assert.match(error.message, /clientKey/);
      assert.match(error.message, /clientCert/);
      return true;
    });
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
    assert.equal(await refusesClientCertificate(ledger.address, DEADLINE_MS, {}), false);
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

describe("a mutual-TLS ledger refusing the lane's tls option", () => {
  const certificates = makeCertificates();
  // A second CA, which the ledger does not know.
  const other = makeCertificates({ caName: 'another ca' });
  const lane = { rootCerts: certificates.ca, clientCert: certificates.clientCert, clientKey: certificates.clientKey, serverName: 'localhost' };
  const untrusted = { ...lane, clientCert: other.clientCert, clientKey: other.clientKey };
  let ledger;
  before(async () => {
    ledger = await startTlsLedger(certificates, { demandClientCertificate: true });
  });
  after(async () => ledger?.stop());

  test("rootCerts that do not trust the ledger's certificate are named", async () => {
    const error = await tlsMismatchOnEveryPath(ledger.address, { ...lane, rootCerts: other.ca });
    assert.match(error.message, /the ledger's certificate/);
    assert.match(error.message, /rootCerts/);
  });

  test('a serverName the certificate does not carry is named', async () => {
    const error = await tlsMismatchOnEveryPath(ledger.address, { ...lane, serverName: 'ledger.example' });
    assert.match(error.message, /'ledger\.example'/);
    assert.match(error.message, /serverName/);
  });

  test('a client certificate the ledger does not trust is named', async () => {
    // grpc-js says only "Failed to connect", as for a restarting server: the
    // ledger completes the handshake and hangs up before a byte of HTTP/2.
    const error = await tlsMismatchOnEveryPath(ledger.address, untrusted);
    assert.match(error.message, /does not trust this client's certificate/);
    assert.match(error.message, /clientCert/);
  });

  test('an alert refusing the client certificate is a refusal too', async () => {
    // Another TLS stack in front of the ledger refuses an untrusted certificate
    // with an alert (unknown_ca), not a silent hang-up: OpenSSL's own server,
    // through Python's ssl (Node's server hangs up without one).
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-alert-'));
    for (const [name, content] of [['server.pem', certificates.serverCert], ['server.key', certificates.serverKey], ['ca.pem', certificates.ca]]) {
      fs.writeFileSync(path.join(dir, name), content);
    }
    const server = spawn(PYTHON, ['-c', ALERTING_SERVER, dir], { stdio: ['ignore', 'pipe', 'inherit'] });
    try {
      const [line] = await once(readline.createInterface({ input: server.stdout }), 'line');
      assert.equal(await refusesClientCertificate(`127.0.0.1:${line.trim()}`, DEADLINE_MS, untrusted), true);
    } finally {
      server.kill();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  test('down behind a plain TCP proxy, it is an outage, with or without a client certificate', async () => {
    // The proxy accepts and then closes, as a ledger refusing a client's
    // certificate would seem to; only a TLS answer counts as that refusal.
    const own = await startTlsLedger(certificates, { demandClientCertificate: true });
    const proxy = await startProxy(own.port);
    const lanes = [{ ...lane, clientCert: undefined, clientKey: undefined }, untrusted];
    try {
      for (const tls of lanes) await tlsMismatchOnEveryPath(proxy.address, tls); // seen through the proxy
      await own.halt();
      for (const tls of lanes) {
        const client = new LaneClient(proxy.address, 'a-lane', { grant: 'a-grant', tls, deadlineMs: 2000 });
        try {
          const error = await client.balance().then(() => assert.fail('the call got through'), (rejected) => rejected);
          assert.equal(error.constructor, Unavailable, `${error.name}: ${error.message}`);
        } finally {
          await client.close();
        }
      }
    } finally {
      await proxy.close();
      await own.stop();
    }
  });
});

describe("an address the ledger's certificate does not carry", () => {
  test('is named, with serverName', async () => {
    // The ledger's certificate names only ledger.example; the lane dials its IP address.
    const certificates = makeCertificates({ serverNames: 'DNS:ledger.example' });
    const ledger = await startTlsLedger(certificates, { demandClientCertificate: false });
    try {
      const error = await tlsMismatchOnEveryPath(ledger.address, { rootCerts: certificates.ca });
      assert.match(error.message, /'127\.0\.0\.1'/);
      assert.match(error.message, /serverName/);
    } finally {
      await ledger.stop();
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

test('a tls or channelOptions option of the wrong kind is refused at construction, naming it', () => {
  // Each was taken: a string or number for tls made a TLS channel with the
  // system's roots, rootCerts that are no PEM were dropped by OpenSSL in
  // silence (the system's roots again), a misspelt rootCert was never read,
  // and channelOptions 'x' was spread into nothing.
  for (const [options, message] of [
    [{ tls: 'yes' }, /^tls must be true, false or an object of TlsOptions, not string/],
    [{ tls: 1 }, /^tls must be true, false or an object of TlsOptions, not number/],
    [{ tls: [] }, /^tls must be true, false or an object of TlsOptions, not an array/],
    [{ tls: { rootCert: 'x' } }, /^tls has no field 'rootCert'/],
    [{ tls: { rootCerts: 'not pem' } }, /^tls\.rootCerts holds no PEM certificate/],
    [{ tls: { rootCerts: Buffer.from('garbage') } }, /^tls\.rootCerts holds no PEM certificate/],
    [{ tls: { rootCerts: '-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n' } }, /^tls\.rootCerts does not load/],
    [{ tls: { rootCerts: 42 } }, /^tls\.rootCerts must be PEM as a string or a Buffer, not number/],
    [{ tls: { clientCert: true } }, /^tls\.clientCert must be PEM as a string or a Buffer, not boolean/],
    [{ tls: { serverName: 42 } }, /^tls\.serverName must be a non-empty string, not number/],
    [{ channelOptions: 'x' }, /^channelOptions must be an object of grpc-js channel options, not string/],
  ]) {
    assert.throws(() => new LaneClient('127.0.0.1:50051', 'recall', { logger: null, ...options }), { name: 'TypeError', message }, JSON.stringify(options));
  }
});

test('the tls options that load are taken', async () => {
  const certificates = makeCertificates();
  for (const tlsOption of [true, false, null, {}, { rootCerts: certificates.ca }, { rootCerts: Buffer.from(certificates.ca), serverName: 'localhost' }]) {
    await new LaneClient('127.0.0.1:50051', 'recall', { logger: null, tls: tlsOption }).close({ graceMs: 0 });
  }
});
