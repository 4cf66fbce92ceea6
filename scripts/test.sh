#!/usr/bin/env bash
# Installs everything (idempotent) and runs the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
# Python tracebacks of every thread on a fatal signal, also after pytest's own handler is
# gone: one run of five on 2026-12-02 segfaulted at interpreter exit after all tests passed.
export PYTHONFAULTHANDLER=1
exec python -m pytest -q "$@"
