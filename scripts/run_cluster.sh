#!/usr/bin/env bash
# Installs everything (idempotent) and runs the whole cluster: `serve run deploy/cluster.yaml`.
# With the default config this generates the demo model + adapters and starts a local Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
# Serve's proxies share a port another proxy holds (SO_REUSEPORT): a second cluster on this
# host would take half of the first one's requests. Refuse to start while a port is taken.
python -m deploy.preflight deploy/cluster.yaml
exec serve run deploy/cluster.yaml "$@"
