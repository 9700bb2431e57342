'use strict';
// A lane written as an ES module imports the client by name, as index.d.ts
// declares it. Node finds a CommonJS module's named exports by reading its
// source (cjs-module-lexer), so every name must be one it can see.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { pathToFileURL } = require('node:url');

const INDEX = path.resolve(__dirname, '..', 'index.js');

test('every export of the package is a named export of its ES module import', async () => {
  const namespace = await import(pathToFileURL(INDEX).href);
  const names = Object.keys(require(INDEX));
  const missing = names.filter((name) => !(name in namespace));
  assert.deepEqual(missing, []);
  assert.equal(namespace.InvalidArgument, require(INDEX).InvalidArgument);
  assert.equal(namespace.isLedgerUnavailable, require(INDEX).isLedgerUnavailable);
});
