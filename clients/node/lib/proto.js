'use strict';
// Loads the ledger's wire contract once, at run time, from the package's own
// copy (proto/ledger/v1/ledger.proto, copied from the repository's protos/ by
// the prepack script scripts/copy-proto.js; tests/test_node_package.py at the
// repository's root fails when the copy drifts), so the package works wherever
// it is installed. Protobuf stops in this module and in wire.js: the rest of
// the client sees plain objects with BigInt amounts and Date instants.

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', 'proto');
const PROTO_FILE = 'ledger/v1/ledger.proto';

// keepCase: field names as on the wire. longs: String: every int64 arrives as a
// decimal string (never a JS number, which loses precision above 2^53); wire.js
// turns them into BigInt. The google.protobuf well-known types resolve from
// protobufjs's bundled definitions; PROTO_ROOT is searched for everything else.
const LOADER_OPTIONS = Object.freeze({
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_ROOT],
});

let cached = null;

/**
 * The `ledger.v1` package as gRPC service constructors and message types.
 * @returns {{Ledger: grpc.ServiceClientConstructor, LaneAdmin: grpc.ServiceClientConstructor,
 *   TestClock: grpc.ServiceClientConstructor, definition: protoLoader.PackageDefinition}}
 */
function ledgerPackage() {
  if (cached === null) {
    const definition = protoLoader.loadSync(PROTO_FILE, LOADER_OPTIONS);
    const loaded = grpc.loadPackageDefinition(definition).ledger.v1;
    cached = Object.freeze({
      Ledger: loaded.Ledger,
      LaneAdmin: loaded.LaneAdmin,
      TestClock: loaded.TestClock,
      definition,
    });
  }
  return cached;
}

module.exports = { ledgerPackage, PROTO_ROOT, PROTO_FILE, LOADER_OPTIONS };
