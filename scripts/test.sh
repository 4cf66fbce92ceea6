#!/usr/bin/env bash
# Installs everything (idempotent) and runs the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
exec python -m pytest -q "$@"
