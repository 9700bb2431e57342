"""The Node package carries its own copy of the wire contract, and it is the
repository's: clients/node/proto/ledger/v1/ledger.proto must equal
protos/ledger/v1/ledger.proto byte for byte (the prepack script
clients/node/scripts/copy-proto.js copies it; run it, or `npm pack`, after
changing the proto). `make test-node-package` installs the packed tarball.
"""

from __future__ import annotations

import json
import pathlib
import re

from ledger_service.domain.events import EventKind

ROOT = pathlib.Path(__file__).resolve().parent.parent
NODE = ROOT / "clients" / "node"
PROTO = pathlib.Path("ledger") / "v1" / "ledger.proto"


def test_the_bundled_proto_is_the_repository_proto() -> None:
    bundled = NODE / "proto" / PROTO
    source = ROOT / "protos" / PROTO
    assert bundled.is_file(), f"{bundled} is missing: run `node clients/node/scripts/copy-proto.js`"
    assert bundled.read_bytes() == source.read_bytes(), (
        f"{bundled.relative_to(ROOT)} differs from {source.relative_to(ROOT)}: "
        "run `node clients/node/scripts/copy-proto.js`"
    )


def test_the_package_ships_the_proto_and_refreshes_it_when_packed() -> None:
    package = json.loads((NODE / "package.json").read_text(encoding="utf-8"))
    assert "proto/" in package["files"]
    assert package["scripts"]["prepack"] == "node scripts/copy-proto.js"
    assert (NODE / "scripts" / "copy-proto.js").is_file()


def test_the_client_loads_the_bundled_proto_not_the_repository() -> None:
    source = (NODE / "lib" / "proto.js").read_text(encoding="utf-8")
    assert "path.resolve(__dirname, '..', 'proto')" in source
    assert "protos" not in source.replace("protos/", "")


def test_the_event_kinds_the_types_declare_are_the_servers() -> None:
    # index.d.ts's LedgerEvent.kind is a closed union (types.test.js holds a
    # lane's switch to it under tsc --strict); this holds it to EventKind, so a
    # kind the server adds is a kind the types declare.
    types = (NODE / "index.d.ts").read_text(encoding="utf-8")
    declared = re.findall(r"^  kind: (.+);$", types, flags=re.MULTILINE)
    assert len(declared) == 1, declared
    kinds = {kind.strip().strip("'") for kind in declared[0].split("|")}
    assert kinds == {kind.value for kind in EventKind}
