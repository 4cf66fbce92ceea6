"""The engine's LoRA layers run the Triton kernels (CPU interpreter here) and give the
same greedy tokens as the torch reference, for mixed adapter + base batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _generate(tmp_path, model_dir, adapters, env_extra, tag) -> list[list[int]]:
    rows = [
        {"prompt": "hello world how", "adapter": "all16rs"},
        {"prompt": "the quick", "adapter": "pattern"},
        {"prompt": "what is", "adapter": None},
        {"prompt": "hello world how", "adapter": "qv8"},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / f"{tag}.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        sys.executable,
        "-m",
        "deploy.cli",
        "generate",
        "--model",
        str(model_dir),
        "--max-tokens",
        "3",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "3",
        "--input",
        str(inp),
        "--output",
        str(out),
        "--quiet",
    ]
    for name in ("all16rs", "pattern", "qv8"):
        args += ["--adapter", f"{name}={adapters[name]}"]
    env = {**os.environ, **env_extra}
    res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]


def test_triton_interpreter_path_equals_reference(tmp_path, llama_dir, llama_adapters):
    ref = _generate(tmp_path, llama_dir, llama_adapters, {"LORAFLEET_KERNELS": "reference"}, "ref")
    tri = _generate(
        tmp_path,
        llama_dir,
        llama_adapters,
        {"LORAFLEET_KERNELS": "triton", "TRITON_INTERPRET": "1"},
        "tri",
    )
    assert tri == ref
    assert len({tuple(t) for t in ref}) >= 3
