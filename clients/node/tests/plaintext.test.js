'use strict';
// A grant sent to another machine without TLS travels unencrypted: the client
// warns once (process.emitWarning), naming the address (docs/security.md; the
// cases are clients/cases/plaintext.json, shared with the Python client and the CLI).

const { test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { LaneClient } = require('..');
const { isLocalAddress } = require('../lib/client');

const CASES = JSON.parse(fs.readFileSync(path.resolve(__dirname, '..', '..', 'cases', 'plaintext.json'), 'utf8'));
const GRANT = 'lg1.key.payload.signature';

for (const { address, local } of CASES.addresses) {
  test(`${address} is ${local ? '' : 'not '}this machine`, () => {
    assert.equal(isLocalAddress(address), local);
  });
}

/** The plaintext warnings emitted while `make` runs. */
async function warningsOf(make) {
  const seen = [];
  const listen = (warning) => {
    if (warning.code === 'LEDGER_PLAINTEXT_GRANT') seen.push(warning);
  };
  process.on('warning', listen);
  try {
    const client = make();
    await client.close({ graceMs: 0 });
    // emitWarning reports on the next tick.
    await new Promise((resolve) => setImmediate(resolve));
  } finally {
    process.off('warning', listen);
  }
  return seen;
}

test('a grant to another machine without TLS warns once, naming the address', async () => {
  const seen = await warningsOf(() => new LaneClient('10.0.0.5:50051', 'recall', { grant: GRANT, logger: null }));
  assert.equal(seen.length, 1);
  assert.match(seen[0].message, /10\.0\.0\.5:50051/);
  assert.match(seen[0].message, /unencrypted/);
  assert.ok(!seen[0].message.includes(GRANT), 'the warning never quotes the grant');
});

test('no warning on this machine, without a grant, or with TLS', async () => {
  for (const [address, options] of [
    ['127.0.0.1:50051', { grant: GRANT }],
    ['unix:/run/ledger.sock', { grant: GRANT }],
    ['10.0.0.5:50051', {}],
    ['10.0.0.5:50051', { grant: GRANT, tls: true }],
  ]) {
    assert.deepEqual(await warningsOf(() => new LaneClient(address, 'recall', { logger: null, ...options })), [], address);
  }
});

test('a missing address is refused naming it', () => {
  // An unset environment variable (process.env.LEDGER_ADDRESS) failed with
  // "Cannot read properties of undefined (reading 'startsWith')".
  for (const address of [undefined, null, '', '   ', 50051]) {
    assert.throws(() => new LaneClient(address, 'recall', { grant: GRANT }), {
      name: 'TypeError',
      message: /^address: .*HOST:PORT/,
    });
  }
});

test('an address gRPC can never reach is refused at construction, naming it', () => {
  // Each was taken and then failed every call as UNAVAILABLE ("Misformatted
  // domain name"), or reached another port: the lane ran on its outage mode
  // for good. The Python client refuses the same (check_address).
  for (const [address, message] of [
    ['http://127.0.0.1:50051', /^address: http:\/\/ is no gRPC target/],
    ['https://ledger.internal:50051', /^address: https:\/\/ is no gRPC target/],
    [' 127.0.0.1:50051', /^address: starts or ends with a space/],
    ['127.0.0.1:50051\n', /^address: starts or ends with a space/],
    ['127.0.0.1:99999', /^address: the port must be a number from 1 to 65535, not '99999'/],
    ['127.0.0.1:0', /^address: the port must be a number from 1 to 65535, not '0'/],
    ['127.0.0.1:-1', /^address: the port must be a number from 1 to 65535, not '-1'/],
    ['[::1]:http', /^address: the port must be a number from 1 to 65535, not 'http'/],
  ]) {
    assert.throws(() => new LaneClient(address, 'recall', { grant: GRANT, logger: null }), { name: 'TypeError', message }, address);
  }
});

test('the addresses gRPC takes are taken', async () => {
  for (const address of [
    '127.0.0.1:50051',
    'ledger.internal',
    '[::1]:50051',
    '::1',
    'ipv4:10.0.0.11:50051,10.0.0.12:50051',
    'dns:///ledger.internal:50051',
    'unix:/tmp/ledger.sock',
    'unix:///tmp/ledger.sock',
    'xds:///ledger.internal',
  ]) {
    await new LaneClient(address, 'recall', { logger: null }).close({ graceMs: 0 });
  }
});
