import importlib.util
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.argv = ["x"]
sys.path.insert(0, ".")
from benchmarks.sampler_gpu import PENALISED, VOCAB, histories  # noqa: E402
from replica import logits_processors as new  # noqa: E402
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
plain = [SamplingParams(temperature=0.0)] * n
half = [PENALISED if i % 2 else plain[i] for i in range(n)]
logits = torch.randn(n, VOCAB, device="cuda") * 3
print(
    "equal",
    torch.equal(old.process_logits(logits, half, hist), new.process_logits(logits, half, hist)),
)


def t(fn, reps=30):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


for _ in range(2):
    print("old ms", t(lambda: old.process_logits(logits, half, hist)))
    print("new ms", t(lambda: new.process_logits(logits, half, hist)))
print("clone ms", t(lambda: logits.clone()))
rows = [i for i in range(n) if half[i].processes_logits]
pen = [i for i in rows if half[i].penalised]
print("plan host ms", t(lambda: new._Plan.build(rows, pen, half, hist, n, VOCAB)))
used = [half[i] for i in rows]
uh = [hist[i] for i in rows]
print("old token_table host ms", t(lambda: old._token_table(used, uh, VOCAB, True)))
big = np.arange(82000, dtype=np.int64)
print("pageable h2d 656KB ms", t(lambda: torch.from_numpy(big).to("cuda")))
pinned = torch.from_numpy(big).pin_memory()
print("pinned h2d 656KB ms", t(lambda: pinned.to("cuda", non_blocking=True)))
small = np.arange(1000, dtype=np.int64)
print("pageable h2d 8KB ms", t(lambda: torch.from_numpy(small).to("cuda")))
print("torch.tensor 640 list ms", t(lambda: torch.tensor(list(range(640)), device="cuda")))
for name, f in [("old", old.process_logits), ("new", new.process_logits)]:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            f(logits, half, hist)
        torch.cuda.synchronize()
    print("=====", name)
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=40
        )
    )
    print(
        prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=40
        )
    )
