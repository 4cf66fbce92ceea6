#!/usr/bin/env bash
# Installs everything (idempotent) and runs the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
# Python tracebacks of every thread on a fatal signal, also after pytest's own handler is
# gone. The rare segfault at exit after the last test (Ray's metric exporter thread racing
# exit()'s static destructors; 2026-12-02, CI on 2026-12-04) is sidestepped by
# tests/conftest.py, which ends the process once Python's atexit handlers have run.
export PYTHONFAULTHANDLER=1
exec python -m pytest -q "$@"
