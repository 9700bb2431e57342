'use strict';
// Starts a real ledger server (the Python package in ../../.venv) with a test
// clock on a free port, and gives the tests admin and clock stubs and the
// lane's events. halt() ends the process and restart() starts it again on the
// same port and data directory (an outage the lane lives through). Not a test
// file itself: node --test runs only *.test.js here.

const { execFileSync, spawn } = require('node:child_process');
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

/** Spawns `ledger serve` on `listen` over `dataDir`; resolves once it listens. */
async function spawnLedger(dataDir, listen, logs) {
  const child = spawn(
    LEDGER_BIN,
    ['serve', '--listen', listen, '--data-dir', dataDir, '--test-clock'],
    { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, LEDGER_DATABASE_URL: '' } },
  );
  // Killed with the test process too, whatever way it ends.
  const killOnExit = () => child.kill('SIGKILL');
  process.once('exit', killOnExit);
  child.stderr.setEncoding('utf8');
  child.stderr.on('data', (chunk) => {
    logs.text = (logs.text + chunk).slice(-MAX_LOG_CHARS);
  });
  const exited = new Promise((resolve) => child.once('exit', (code, signal) => resolve(code ?? signal)));
  try {
    const port = await listeningPort(child, logs);
    return { child, port, exited, killOnExit };
  } catch (error) {
    child.kill('SIGKILL');
    process.removeListener('exit', killOnExit);
    throw error;
  }
}

/** Ends the process with `signal` (SIGKILL after STOP_TIMEOUT_MS); resolves with its exit code or signal. */
async function endProcess(running, signal) {
  running.child.kill(signal);
  const timer = setTimeout(() => running.child.kill('SIGKILL'), STOP_TIMEOUT_MS);
  const ended = await running.exited;
  clearTimeout(timer);
  process.removeListener('exit', running.killOnExit);
  return ended;
}

/**
 * @param {{copyFrom?: string}} [options] copyFrom: a halted server's data directory to start from
 * @returns {Promise<{address: string, adminGrant: string|null, admin: object, clock: object,
 *   events: (lane: string) => Promise<object[]>, issueGrant: (...args: string[]) => string, halt: (signal?: string) => Promise<number|string>,
 *   restart: () => Promise<void>, freeze: () => void, thaw: () => void, stop: () => Promise<void>}>}
 */
async function startLedger({ copyFrom } = {}) {
  const dataDir = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-'));
  // A replica of another server: its keyring, grants and lanes (its own database file).
  if (copyFrom) fs.cpSync(copyFrom, dataDir, { recursive: true });
  const logs = { text: '' };
  let running;
  try {
    running = await spawnLedger(dataDir, '127.0.0.1:0', logs);
  } catch (error) {
    fs.rmSync(dataDir, { recursive: true, force: true });
    throw error;
  }
  const port = running.port;
  const address = `127.0.0.1:${port}`;
  const adminGrant = adminGrantOf(dataDir);
  const metadata = new grpc.Metadata();
  if (adminGrant) metadata.set('authorization', `Bearer ${adminGrant}`);
  const { Ledger, LaneAdmin, TestClock } = ledgerPackage();
  const credentials = grpc.credentials.createInsecure();
  const adminStub = new LaneAdmin(address, credentials);
  const clockStub = new TestClock(address, credentials);
  const ledgerStub = new Ledger(address, credentials);
  const listEvents = promisify(ledgerStub, 'ListEvents', metadata);

  /** Every event of the lane, oldest first (as the admin sees them). */
  async function events(lane) {
    const all = [];
    let token = '';
    for (let page = 0; page < 100; page += 1) {
      const response = await listEvents({ lane, page_size: 1000, page_token: token });
      all.push(...response.events);
      token = response.next_page_token;
      if (!token) return all;
    }
    throw new Error('more events than a test makes');
  }

  /** Ends the server process (SIGTERM: a graceful stop), keeping its data directory and port. */
  async function halt(signal = 'SIGTERM') {
    if (running === null) throw new Error('the ledger is not running');
    const ended = await endProcess(running, signal);
    running = null;
    return ended;
  }

  /** Starts the server again on the same port and data directory. */
  async function restart() {
    if (running !== null) throw new Error('the ledger is running');
    const deadline = Date.now() + START_TIMEOUT_MS;
    for (;;) {
      try {
        running = await spawnLedger(dataDir, address, logs);
        return;
      } catch (error) {
        // The port may take a moment to be free again.
        if (Date.now() >= deadline) throw error;
        await new Promise((resolve) => setTimeout(resolve, 200));
      }
    }
  }

  /** `ledger grant issue` against this server's keyring: the grant's text. */
  function issueGrant(...args) {
    const command = ['grant', 'issue', '--data-dir', dataDir, ...args];
    return execFileSync(LEDGER_BIN, command, { encoding: 'ascii', timeout: START_TIMEOUT_MS }).trim();
  }

  /** SIGSTOP: the process stops, its kernel still accepts connections and bytes. */
  function freeze() {
    running.child.kill('SIGSTOP');
  }

  function thaw() {
    running.child.kill('SIGCONT');
  }

  async function stop() {
    if (running !== null) thaw();
    adminStub.close();
    clockStub.close();
    ledgerStub.close();
    if (running !== null) await endProcess(running, 'SIGTERM');
    running = null;
    fs.rmSync(dataDir, { recursive: true, force: true });
  }

  return {
    address,
    port,
    dataDir,
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
    events,
    issueGrant,
    halt,
    restart,
    freeze,
    thaw,
    stop,
  };
}

module.exports = { startLedger, LEDGER_BIN };
