#!/usr/bin/env bash
# Installs everything, builds the demo model + adapters, and runs offline generation on them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
work=${LORAFLEET_DEMO_OUT:-.lorafleet-cache/demo-run}
mkdir -p "$work"
assets=$(python -m deploy.demo --write-input "$work/in.jsonl")
model=$(python -c 'import json,sys; print(json.loads(sys.argv[1])["model_dir"])' "$assets")
adapter_args=$(python -c 'import json,sys; print(" ".join(f"--adapter {k}={v}" for k, v in json.loads(sys.argv[1])["adapters"].items()))' "$assets")
# shellcheck disable=SC2086
lorafleet generate --model "$model" $adapter_args --max-loras 2 --max-cpu-loras 3 \
    --max-tokens 24 --input "$work/in.jsonl" --output "$work/out.jsonl"
echo "wrote $work/out.jsonl:" >&2
python - "$work/out.jsonl" <<'PY'
import json
import sys

for row in map(json.loads, open(sys.argv[1])):
    name = row["adapter"] or "base"
    print(f"{name:>12} | {row['prompt']!r} -> {row['text']!r} ({row['finish_reason']})")
PY
