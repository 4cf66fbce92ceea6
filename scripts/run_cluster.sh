#!/usr/bin/env bash
# Installs everything (idempotent) and runs the whole cluster: `serve run deploy/cluster.yaml`.
# With the default config this generates the demo model + adapters and starts a local Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
# deploy/run_cluster.py: serve run, refused while another cluster holds the ports, and
# stopped by SIGTERM as by Ctrl-C (gracefully: replicas leave the registry).
exec python -m deploy.run_cluster deploy/cluster.yaml "$@"
