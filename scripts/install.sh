#!/usr/bin/env bash
# Installs everything lorafleet needs on a fresh machine into ./.venv (idempotent).
# torch is pinned to the CPU build served from local disk; an unpinned torch would pull CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1; then
    echo "[install] redis-server missing: installing Debian's redis-server" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.lorafleet-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[dev]"
    # Hugging Face's `kernels` distribution (pulled in by transformers >= 5.25, see
    # pyproject.toml) would make transformers import this project's `kernels` package as it
    if .venv/bin/python -m pip show -q kernels >/dev/null 2>&1; then
        .venv/bin/python -m pip uninstall -y -q kernels
    fi
    touch "$stamp"
fi
