'use strict';
// A scripted stand-in for the ledger, for what a real server cannot be made to
// do on demand: TLS with client certificates, lost answers, a store outage.
// Not a test file itself: node --test runs only *.test.js here.

const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const { ledgerPackage } = require('../lib/proto');

const METHODS = ['Reserve', 'Settle', 'Refund', 'GetBalance', 'GetBooking', 'ListEvents'];

/** A gRPC error with the server's trailers, as the real ledger sends them. */
function ledgerStatus(code, reason, details = 'scripted failure') {
  const metadata = new grpc.Metadata();
  if (reason) metadata.set('ledger-reason', reason);
  return { code, details, metadata };
}

/**
 * Serves the Ledger service with `script[method](request, call)` (may be async;
 * a thrown {code, details, metadata} becomes the call's status). Every call is
 * recorded in `calls` as {method, request, metadata}.
 */
async function startFakeLedger(script, { credentials = grpc.ServerCredentials.createInsecure() } = {}) {
  const server = new grpc.Server();
  const calls = [];
  const implementation = {};
  for (const method of METHODS) {
    implementation[method] = (call, callback) => {
      calls.push({ method, request: call.request, metadata: call.metadata.getMap() });
      const behaviour = script[method];
      if (!behaviour) {
        callback({ code: grpc.status.UNIMPLEMENTED, details: `${method} is not scripted` });
        return;
      }
      Promise.resolve()
        .then(() => behaviour(call.request, call))
        .then((response) => callback(null, response), (error) => callback(error));
    };
  }
  server.addService(ledgerPackage().Ledger.service, implementation);
  const port = await new Promise((resolve, reject) => {
    server.bindAsync('127.0.0.1:0', credentials, (error, bound) => (error ? reject(error) : resolve(bound)));
  });
  return {
    port,
    calls,
    stop: async () => server.forceShutdown(),
  };
}

/**
 * A throwaway CA named `caName` with a server certificate for `serverNames`
 * (its subjectAltName) and a client certificate, made by the openssl command
 * line; null when there is none.
 */
function makeCertificates({ serverNames = 'DNS:localhost,IP:127.0.0.1', caName = 'test ca' } = {}) {
  try {
    execFileSync('openssl', ['version'], { stdio: 'ignore' });
  } catch {
    return null;
  }
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-tls-'));
  const file = (name) => path.join(dir, name);
  const openssl = (...args) => execFileSync('openssl', args, { stdio: 'ignore', cwd: dir });
  const newKey = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes'];
  try {
    openssl('req', '-x509', ...newKey, '-keyout', 'ca.key', '-out', 'ca.crt', '-days', '1', '-subj', `/CN=${caName}`);
    for (const [name, extensions] of [
      ['server', `subjectAltName=${serverNames}\nextendedKeyUsage=serverAuth\n`],
      ['client', 'extendedKeyUsage=clientAuth\n'],
    ]) {
      fs.writeFileSync(file(`${name}.ext`), extensions);
      openssl('req', ...newKey, '-keyout', `${name}.key`, '-out', `${name}.csr`, '-subj', `/CN=${name}`);
      openssl('x509', '-req', '-in', `${name}.csr`, '-CA', 'ca.crt', '-CAkey', 'ca.key', '-CAcreateserial',
        '-out', `${name}.crt`, '-days', '1', '-extfile', `${name}.ext`);
    }
    const read = (name) => fs.readFileSync(file(name));
    return {
      ca: read('ca.crt'),
      serverCert: read('server.crt'),
      serverKey: read('server.key'),
      clientCert: read('client.crt'),
      clientKey: read('client.key'),
    };
  } catch {
    return null;
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

module.exports = { startFakeLedger, ledgerStatus, makeCertificates };
