#!/usr/bin/env node
'use strict';
// prepack: copies the ledger's wire contract (../../protos/ledger/v1/ledger.proto)
// into this package (proto/ledger/v1/ledger.proto), so that a packed tarball
// carries the very proto of the checkout it was packed from. No dependencies.
// Packing from a copy of this folder alone (no ../../protos) keeps the
// committed copy. tests/test_node_package.py fails when the two differ.

const fs = require('node:fs');
const path = require('node:path');

const PACKAGE_ROOT = path.resolve(__dirname, '..');
const RELATIVE = path.join('ledger', 'v1', 'ledger.proto');
const SOURCE = path.resolve(PACKAGE_ROOT, '..', '..', 'protos', RELATIVE);
const TARGET = path.join(PACKAGE_ROOT, 'proto', RELATIVE);

function copyProto() {
  if (!fs.existsSync(SOURCE)) {
    if (!fs.existsSync(TARGET)) {
      throw new Error(`neither ${SOURCE} nor the bundled ${TARGET} exists`);
    }
    console.warn(`copy-proto: ${SOURCE} not found; packing the bundled copy`);
    return false;
  }
  const wanted = fs.readFileSync(SOURCE);
  if (fs.existsSync(TARGET) && fs.readFileSync(TARGET).equals(wanted)) return false;
  fs.mkdirSync(path.dirname(TARGET), { recursive: true });
  fs.writeFileSync(TARGET, wanted);
  console.warn(`copy-proto: updated ${path.relative(PACKAGE_ROOT, TARGET)} from protos/`);
  return true;
}

if (require.main === module) copyProto();

module.exports = { copyProto, SOURCE, TARGET };
