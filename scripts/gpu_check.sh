#!/usr/bin/env bash
# The whole GPU check in one command, for a lent CUDA machine (the device tool runs it in
# a copy of the working tree; its image has torch, triton and transformers): the `gpu`
# tests, then the engine (CUDA graphs and eager) and sampler benchmarks, the launch probe,
# the prefill / mixed steps (eager against piecewise graphs) and paged attention (the
# Triton kernel against the torch path and dense SDPA). Results land in $OUT
# (or ./gpu_out); copy the JSON files into benchmarks/results/ once read. The kernel grid
# is not run by default (about 6 minutes); pass --kernels to add it.
#
#   bash scripts/gpu_check.sh [--kernels]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD"
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m pytest -m gpu tests/gpu -q --timeout 200 -p no:cacheprovider 2>&1 \
  | tail -n 40 | tee "$out/gpu_tests.log" || status=1
python3 benchmarks/engine_gpu.py --repeat 3 --out "$out/engine_gpu_h200.json" 2>&1 \
  | tail -n 30 || status=1
python3 benchmarks/sampler_gpu.py --out "$out/sampler_h200.json" 2>&1 | tail -n 20 || status=1
python3 benchmarks/launch_probe.py --out "$out/launch_probe.json" 2>&1 | head -n 9 || status=1
python3 benchmarks/engine_gpu.py --eager --only 128:0,128:32 --out "$out/engine_gpu_eager.json" 2>&1 \
  | tail -n 6 || status=1
python3 benchmarks/mixed_step_gpu.py --out "$out/mixed_step.json" 2>&1 | tail -n 10 || status=1
python3 benchmarks/attention_gpu.py --out "$out/attention.json" 2>&1 | tail -n 16 || status=1
if [[ "${1:-}" == "--kernels" ]]; then
  python3 benchmarks/lora_kernels.py --out "$out/lora_kernels_h200.json" 2>&1 \
    | tail -n 60 || status=1
fi
exit "$status"
