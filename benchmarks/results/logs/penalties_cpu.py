"""c81e25b's process_logits against main's on this CPU: 128 greedy rows at vocabulary
128256, every other one penalised (benchmarks/sampler_gpu.py's case), 5 calls per figure,
two rounds interleaved. Run from the repository root:

    PYTHONPATH=. python benchmarks/results/logs/penalties_cpu.py
"""

import importlib.util
import subprocess
import sys
import time

import torch

sys.argv = ["x"]
from benchmarks.sampler_gpu import PENALISED, VOCAB, histories  # noqa: E402
from replica.logits_processors import process_logits  # noqa: E402
from replica.sampling_params import SamplingParams  # noqa: E402

src = subprocess.run(
    ["git", "show", "c81e25b:replica/logits_processors.py"], capture_output=True, text=True
).stdout
open("/tmp/old_lp.py", "w").write(src)
spec = importlib.util.spec_from_file_location("old_lp", "/tmp/old_lp.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
n = 128
hist = histories(n)
half = [PENALISED if i % 2 else SamplingParams(temperature=0.0) for i in range(n)]
logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
print(
    "bit-identical",
    torch.equal(old.process_logits(logits, half, hist), process_logits(logits, half, hist)),
)
for name, f in [("c81e25b", old.process_logits), ("main", process_logits)] * 2:
    f(logits, half, hist)
    t = time.perf_counter()
    for _ in range(5):
        f(logits, half, hist)
    print(f"{name} ms per call {(time.perf_counter() - t) / 5 * 1e3:.1f}")
