# The front door. `make run` starts the service on SQLite; `make test` runs
# every check CI runs (lint, types, stubs, tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install run test test-fast lint typecheck protos protos-check migrate bench test-python test-node test-node-package test-python-package clean

$(STAMP): pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e './clients/python[openai,anthropic]' -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/ledger migrate
	$(BIN)/ledger serve

migrate: $(STAMP)
	$(BIN)/ledger migrate

protos: $(STAMP)
	$(PY) protos/generate.py

# Fails when the committed stubs differ from what the .proto files generate.
protos-check: $(STAMP)
	$(PY) protos/generate.py
	git diff --exit-code --stat -- ledger_service/generated clients/python/ledger_client/generated
	test -z "$$(git status --porcelain -- ledger_service/generated clients/python/ledger_client/generated)"

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy ledger_service clients/python/ledger_client bench

# The fast tier, to run while working: domain and unit tests, no server, no
# database, no process (conftest.py says which tests are slow). Under 90 s.
test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow"

# Servers started by tests check every incremental window read against a full sum.
test-python: $(STAMP)
	LEDGER_VERIFY_WINDOWS=1 $(BIN)/pytest -q

test-node: $(STAMP)
	@if [ -f clients/node/package.json ]; then cd clients/node && npm ci --no-audit --no-fund --silent && LEDGER_VERIFY_WINDOWS=1 npm test; fi

# The Python client as a lane gets it: a wheel and an sdist, each installed into
# a fresh virtual environment, then a Reserve, a Settle and a Balance there.
test-python-package: $(STAMP)
	$(PY) clients/python/scripts/check_package.py

# The Node package as a lane gets it: `npm pack`, installed into an empty
# folder, then a Reserve, a Settle and a Balance against a real ledger.
test-node-package: $(STAMP)
	@if [ -f clients/node/package.json ]; then cd clients/node && { [ -d node_modules ] || npm ci --no-audit --no-fund --silent; } && node scripts/check-package.js; fi

test: lint typecheck protos-check test-python test-node test-node-package test-python-package

bench: $(STAMP)
	$(PY) -m bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
