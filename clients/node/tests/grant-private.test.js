'use strict';
// A grant is a bearer credential: logging a client (console.log, util.inspect,
// an error reporter that prints the objects it holds) must not print it.

const { test } = require('node:test');
const assert = require('node:assert/strict');
const util = require('node:util');
const { LaneClient } = require('..');

const GRANT = `lg1.k0000000a.${'A'.repeat(60)}.${'B'.repeat(43)}`;

test('util.inspect of a client never shows its grant', () => {
  // It printed `_grant: 'lg1.k...'` in full.
  const client = new LaneClient('127.0.0.1:1', 'recall', { grant: GRANT });
  try {
    const shown = util.inspect(client, { depth: 10, showHidden: true });
    assert.ok(shown.includes('recall'), 'the inspection shows the client');
    assert.ok(!shown.includes('A'.repeat(60)), shown);
  } finally {
    client.close();
  }
});
