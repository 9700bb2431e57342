'use strict';
// Starts a real ledger server (the Python package in ../../.venv) with a test
// clock on a free port, and gives the tests admin and clock stubs. Not a test
// file itself: node --test runs only *.test.js here.

const { spawn } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const readline = require('node:readline');
const grpc = require('@grpc/grpc-js');
const { ledgerPackage } = require('../lib/proto');

const LEDGER_BIN = process.env.LEDGER_BIN || path.resolve(__dirname, '../../../.venv/bin/ledger');
const START_TIMEOUT_MS = 20_000;
const STOP_TIMEOUT_MS = 8_000;
const MAX_LOG_CHARS = 20_000;
const ADMIN_DEADLINE_MS = 5_000;

function promisify(stub, method, metadata) {
  return (request) =>
    new Promise((resolve, reject) => {
      const options = { deadline: Date.now() + ADMIN_DEADLINE_MS };
      stub[method](request, metadata, options, (error, response) => (error ? reject(error) : resolve(response)));
    });
}

/** The admin grant a server with auth writes to its data directory; null without auth. */
function adminGrantOf(dataDir) {
  const file = path.join(dataDir, 'admin.grant');
  return fs.existsSync(file) ? fs.readFileSync(file, 'ascii').trim() : null;
}

/** Resolves with the port from the server's one stdout line. */
function listeningPort(child, logs) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => fail(new Error('the ledger did not start in time')), START_TIMEOUT_MS);
    const lines = readline.createInterface({ input: child.stdout });
    function fail(error) {
      clearTimeout(timer);
      reject(new Error(`${error.message}\n--- ledger stderr ---\n${logs.text}`));
    }
    lines.on('line', (line) => {
      const match = /^ledger listening on 127\.0\.0\.1:(\d+)$/.exec(line.trim());
      if (match) {
        clearTimeout(timer);
        resolve(Number(match[1]));
      }
    });
    child.once('error', fail);
    child.once('exit', (code, signal) => fail(new Error(`the ledger exited (${code ?? signal})`)));
  });
}

/**
 * @returns {Promise<{address: string, adminGrant: string|null, admin: object, clock: object,
 *   stop: () => Promise<void>}>}
 */
async function startLedger() {
  const dataDir = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-'));
  const child = spawn(
    LEDGER_BIN,
    ['serve', '--listen', '127.0.0.1:0', '--data-dir', dataDir, '--test-clock'],
    { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, LEDGER_DATABASE_URL: '' } },
  );
  // Killed with the test process too, whatever way it ends.
  const killOnExit = () => child.kill('SIGKILL');
  process.once('exit', killOnExit);
  const logs = { text: '' };
  child.stderr.setEncoding('utf8');
  child.stderr.on('data', (chunk) => {
    logs.text = (logs.text + chunk).slice(-MAX_LOG_CHARS);
  });
  let port;
  try {
    port = await listeningPort(child, logs);
  } catch (error) {
    child.kill('SIGKILL');
    fs.rmSync(dataDir, { recursive: true, force: true });
    throw error;
  }
  const address = `127.0.0.1:${port}`;
  const adminGrant = adminGrantOf(dataDir);
  const metadata = new grpc.Metadata();
  if (adminGrant) metadata.set('authorization', `Bearer ${adminGrant}`);
  const { LaneAdmin, TestClock } = ledgerPackage();
  const credentials = grpc.credentials.createInsecure();
  const adminStub = new LaneAdmin(address, credentials);
  const clockStub = new TestClock(address, credentials);
  const exited = new Promise((resolve) => child.once('exit', resolve));

  async function stop() {
    adminStub.close();
    clockStub.close();
    child.kill('SIGTERM');
    const timer = setTimeout(() => child.kill('SIGKILL'), STOP_TIMEOUT_MS);
    await exited;
    clearTimeout(timer);
    process.removeListener('exit', killOnExit);
    fs.rmSync(dataDir, { recursive: true, force: true });
  }

  return {
    address,
    logs,
    /** Allows everything on every lane; null when the server runs without auth. */
    adminGrant,
    admin: {
      putLane: promisify(adminStub, 'PutLane', metadata),
      getLane: promisify(adminStub, 'GetLane', metadata),
    },
    clock: {
      setTime: promisify(clockStub, 'SetTime', metadata),
      advance: promisify(clockStub, 'Advance', metadata),
      getTime: promisify(clockStub, 'GetTime', metadata),
    },
    stop,
  };
}

module.exports = { startLedger, LEDGER_BIN };
