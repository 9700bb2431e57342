#!/usr/bin/env node
'use strict';
// Installs the package the way a lane would and uses it against a real ledger:
// `npm pack` here, then in an empty temporary folder `npm init -y`,
// `npm install <tarball>` and a tiny script that requires
// `@lane-ledger/client`, does a Reserve and a Settle and reads the balance.
// Fails (exit 1) on any step. `make test-node-package` runs it; the server is
// started as the tests start it (tests/ledger-server.js: ../../.venv/bin/ledger
// or LEDGER_BIN, with a test clock on a temporary data directory).

const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const PACKAGE_ROOT = path.resolve(__dirname, '..');
const NPM = process.platform === 'win32' ? 'npm.cmd' : 'npm';
const NPM_QUIET = ['--no-audit', '--no-fund', '--loglevel=error'];
const STEP_TIMEOUT_MS = 180_000;

// The lane of the check: 1000 nanos per input token, 4000 per output token.
const LANE = 'package-check';
const PRICES = { m: { input_nanos_per_million_tokens: '1000000000', output_nanos_per_million_tokens: '4000000000' } };
// 3500 bytes at the default 3.5 bytes per token: 1000 input tokens (1_000_000)
// plus 100 output tokens (400_000).
const EXPECTED_CAP = 1_400_000n;
// 900 input and 50 output tokens: 900_000 + 200_000.
const EXPECTED_CHARGE = 1_100_000n;

// Runs in the temporary folder, with nothing of this checkout on its path.
const LANE_SCRIPT = `'use strict';
const { LaneClient, capNanos, realCostNanos } = require('@lane-ledger/client');

async function main() {
  const [address, lane, grant] = process.argv.slice(2);
  const client = new LaneClient(address, lane, { grant: grant || undefined, deadlineMs: 5000 });
  try {
    await client.waitForReady(10000);
    const reserved = await client.reserve({ reservationId: 'package-check-1', model: 'm', requestBytes: 3500, maxOutputTokens: 100 });
    const settled = await client.settle({ reservationId: 'package-check-1', outcome: 'SUCCEEDED', inputTokens: 900, outputTokens: 50 });
    const balance = await client.balance();
    const price = { inputNanosPerMillionTokens: 1000000000n, outputNanosPerMillionTokens: 4000000000n };
    console.log(JSON.stringify({
      resolved: require.resolve('@lane-ledger/client'),
      admitted: reserved.admitted,
      capNanos: reserved.capNanos,
      localCapNanos: capNanos(price, 3500n, 100n, 3500n, 0n),
      chargedNanos: settled.chargedNanos,
      localChargeNanos: realCostNanos(price, { inputTokens: 900n, outputTokens: 50n, cachedInputTokens: 0n, cacheWriteTokens: 0n }),
      state: settled.state,
      spentNanos: balance.spentNanos,
      openBookings: balance.openBookings,
    }, (key, value) => (typeof value === 'bigint' ? value.toString() : value)));
  } finally {
    client.close();
  }
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
`;

function run(command, args, cwd) {
  try {
    return execFileSync(command, args, { cwd, encoding: 'utf8', timeout: STEP_TIMEOUT_MS, stdio: ['ignore', 'pipe', 'pipe'] });
  } catch (error) {
    throw new Error(`${command} ${args.join(' ')} (in ${cwd}) failed:\n${error.stdout ?? ''}${error.stderr ?? error.message}`);
  }
}

function check(condition, what, got) {
  if (!condition) throw new Error(`package check: ${what} (got ${JSON.stringify(got)})`);
}

/** Packs the package into `dir`; returns the tarball's path. */
function pack(dir) {
  const out = run(NPM, ['pack', '--json', '--pack-destination', dir, ...NPM_QUIET], PACKAGE_ROOT);
  const [info] = JSON.parse(out.slice(out.indexOf('[')));
  const files = info.files.map((file) => file.path);
  for (const wanted of ['index.js', 'index.d.ts', 'lib/proto.js', 'lib/pricing.js', 'proto/ledger/v1/ledger.proto']) {
    check(files.includes(wanted), `the tarball carries ${wanted}`, files);
  }
  check(!files.some((file) => file.startsWith('tests/') || file.startsWith('node_modules/')), 'the tarball carries no tests', files);
  return path.join(dir, info.filename);
}

/** An empty project with the tarball installed; returns its folder. */
function install(tarball, dir) {
  const app = path.join(dir, 'lane');
  fs.mkdirSync(app);
  run(NPM, ['init', '-y', ...NPM_QUIET], app);
  run(NPM, ['install', tarball, ...NPM_QUIET], app);
  return app;
}

async function main() {
  const work = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-package-'));
  let ledger = null;
  try {
    const tarball = pack(work);
    const app = install(tarball, work);
    fs.writeFileSync(path.join(app, 'lane.js'), LANE_SCRIPT);

    // Required only now: the server helper loads this checkout's own proto.
    const { startLedger } = require('../tests/ledger-server');
    ledger = await startLedger();
    await ledger.clock.setTime({ seconds: '1790000000', nanos: 0 });
    await ledger.admin.putLane({ lane: { lane: LANE, limit_nanos: '1000000000', prices: PRICES } });

    const out = run(process.execPath, ['lane.js', ledger.address, LANE, ledger.adminGrant ?? ''], app);
    const result = JSON.parse(out.trim().split('\n').pop());
    const installed = fs.realpathSync(path.join(app, 'node_modules', '@lane-ledger', 'client'));
    check(fs.realpathSync(result.resolved).startsWith(installed + path.sep), 'the script used the installed copy', result.resolved);
    check(!installed.startsWith(PACKAGE_ROOT), 'the installed copy is not this checkout', installed);
    check(result.admitted === true, 'the Reserve was admitted', result.admitted);
    check(BigInt(result.capNanos) === EXPECTED_CAP, `the cap is ${EXPECTED_CAP}`, result.capNanos);
    check(BigInt(result.localCapNanos) === EXPECTED_CAP, 'capNanos() agrees with the ledger', result.localCapNanos);
    check(result.state === 'SETTLED', 'the booking is settled', result.state);
    check(BigInt(result.chargedNanos) === EXPECTED_CHARGE, `the charge is ${EXPECTED_CHARGE}`, result.chargedNanos);
    check(BigInt(result.localChargeNanos) === EXPECTED_CHARGE, 'realCostNanos() agrees with the ledger', result.localChargeNanos);
    check(BigInt(result.spentNanos) === EXPECTED_CHARGE, 'the balance shows the charge', result.spentNanos);
    check(BigInt(result.openBookings) === 0n, 'no booking is left open', result.openBookings);
    console.log(`package check: ${path.basename(tarball)} installs and works (Reserve, Settle, Balance)`);
  } finally {
    if (ledger !== null) await ledger.stop();
    fs.rmSync(work, { recursive: true, force: true });
  }
}

main().catch((error) => {
  console.error(error.message ?? error);
  process.exit(1);
});
