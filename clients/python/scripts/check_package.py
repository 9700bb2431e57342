"""The Python client as a lane gets it: a wheel and an sdist built from
clients/python, each installed into a fresh virtual environment of its own, and
there a Reserve, a Settle and a Balance against a real ledger server.

    python clients/python/scripts/check_package.py     # `make test-python-package`

Exits 0 when both pass; prints what failed and exits 1 otherwise.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
import venv

from ledger_service.domain.clock import SystemClock
from ledger_service.domain.grants import Scope
from ledger_service.storage import keyring

ROOT = pathlib.Path(__file__).resolve().parents[3]
CLIENT = ROOT / "clients" / "python"
LANE = "package-check"
SERVER_STOP_SECONDS = 15

# Run by the fresh environment's interpreter: it must import the installed
# package, never the repository's.
SMOKE = """
import json, sys, ledger_client
from ledger_client import LaneClient, Usage
assert "site-packages" in ledger_client.__file__, ledger_client.__file__
address, lane, grant = sys.argv[1:4]
client = LaneClient(address, lane, grant=grant)
reservation = client.reserve("jev", 4_000, 100, deadline_seconds=5)
assert reservation.admitted, reservation
settled = client.settle(reservation.reservation_id, Usage(input_tokens=900, output_tokens=40),
                        deadline_seconds=5)
balance = client.balance(deadline_seconds=5)
client.close()
print(json.dumps({"charged": settled.charged_nanos, "spent": balance.spent_nanos,
                  "file": ledger_client.__file__}))
"""


def run(*argv: str | pathlib.Path, cwd: pathlib.Path | None = None) -> str:
    done = subprocess.run(
        [str(part) for part in argv], cwd=cwd, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, argv))} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def build(out: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    # The repository's setuptools, not a download: the build works offline too.
    run(sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel",
        "--outdir", out, CLIENT)  # fmt: skip
    (wheel,) = out.glob("ledger_client-*.whl")
    (sdist,) = out.glob("ledger_client-*.tar.gz")
    return wheel, sdist


def serve(data_dir: pathlib.Path) -> tuple[subprocess.Popen[str], str, str]:
    ledger = pathlib.Path(sys.executable).with_name("ledger")
    process = subprocess.Popen(
        [str(ledger), "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("ledger listening on "):
        raise SystemExit(f"the ledger did not start: {line!r}")
    address = line.rsplit(" ", 1)[1].strip()
    admin = keyring.admin_grant_path(data_dir).read_text().strip()
    run(ledger, "lane", "put", LANE, "--limit", "$1", "--price", "jev=0.10/0.40",
        "--server", address, "--grant", admin)  # fmt: skip
    now_us = SystemClock().now_us()
    grant = keyring.load(data_dir).issue(
        [LANE], [Scope.CHARGE], issued_at_us=now_us, expires_at_us=now_us + 3_600_000_000
    )
    return process, address, grant


def installed_and_tried(artifact: pathlib.Path, where: pathlib.Path, address: str,
                        grant: str) -> dict[str, object]:  # fmt: skip
    venv.create(where, with_pip=True)
    python = where / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", artifact)
    # Out of the repository, so that nothing of it is on sys.path.
    result: dict[str, object] = json.loads(
        run(python, "-c", SMOKE, address, LANE, grant, cwd=where)
    )
    return result


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ledger-client-package-") as scratch:
        base = pathlib.Path(scratch)
        wheel, sdist = build(base / "dist")
        process, address, grant = serve(base / "data")
        try:
            for artifact in (wheel, sdist):
                kind = "wheel" if artifact.suffix == ".whl" else "sdist"
                result = installed_and_tried(artifact, base / f"venv-{kind}", address, grant)
                if not (isinstance(result["charged"], int) and result["charged"] > 0):
                    raise SystemExit(f"{kind}: nothing was charged: {result}")
                print(f"{kind} {artifact.name}: installed, reserved, settled "
                      f"{result['charged']} nanos, read the balance")  # fmt: skip
        finally:
            process.terminate()
            process.wait(timeout=SERVER_STOP_SECONDS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
