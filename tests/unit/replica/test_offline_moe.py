"""`lorafleet generate` on a Mixtral model directory, as users run it (a real subprocess):
greedy tokens of base and attention adapters in one run equal HF + PEFT's, from either
checkpoint naming; an adapter reaching the router or the experts (PEFT's
target_parameters, or a dense MLP's gate/up/down of a same-sized Llama adapter) is
refused before anything runs, in one line naming the field, the module and what a
Mixtral takes, with no traceback and no output file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.hf_reference import hf_greedy
from tests.tiny import make_peft_adapter, make_tiny_mixtral

ROOT = Path(__file__).resolve().parents[3]
ATTENTION = "allowed: q_proj, k_proj, v_proj, o_proj"
ROWS = [
    {"prompt": "hello world how are you", "adapter": "qv8", "max_tokens": 10},
    {"prompt": "the quick brown fox", "max_tokens": 10},
    {"prompt": "what is lorafleet", "adapter": "pattern", "max_tokens": 10},
    {"prompt": "the quick brown fox", "adapter": "attn16rs", "max_tokens": 10},
]


def _generate(tmp_path: Path, model: Path, adapters: dict[str, Path], rows: list[dict]):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    named = [a for n, p in adapters.items() for a in ("--adapter", f"{n}={p}")]
    res = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "generate", "--model", str(model), *named,
         "--device", "cpu", "--input", str(inp), "--output", str(out), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return res, out


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_greedy_with_attention_adapters_equals_hf_peft(
    tmp_path, mixtral_dir, mixtral_adapters, fused
):
    model = make_tiny_mixtral(tmp_path / "fused", seed=7, fused=True) if fused else mixtral_dir
    res, out = _generate(tmp_path, model, mixtral_adapters, ROWS)
    assert res.returncode == 0, res.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(str(model))
    for row, g in zip(ROWS, got, strict=True):
        adapter = mixtral_adapters.get(row.get("adapter"))
        ids = tok(row["prompt"]).input_ids
        want = hf_greedy(model, adapter, ids, max_new_tokens=row["max_tokens"])
        assert g["token_ids"] == want, row


def _expert_adapters(mixtral_dir: Path, llama_adapters: dict[str, Path], tmp_path: Path):
    experts = make_peft_adapter(
        mixtral_dir, tmp_path / "experts", r=4, lora_alpha=8, target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj"],
    )  # fmt: skip
    return {
        "experts": (
            experts,
            # one parameter: peft saves them as a set, in no fixed order. Refused before
            # the model loads, against its config.json's shapes: what a Mixtral allows
            "target_parameters: ['mlp.experts.gate_up_proj'] targets parameters (as peft "
            "does for mixture-of-experts expert weights), which this engine cannot adapt; "
            f"allowed: null or []; LoRA through target_modules on {ATTENTION.removeprefix('allowed: ')} "
            "(attention)",
        ),
        # a Llama adapter of the same sizes: its q/k/v/o would fit, its gate/up/down cannot
        "dense-mlp": (
            llama_adapters["all16rs"],
            "target_modules: matches 'model.layers.0.mlp.gate_proj': MixtralForCausalLM is a "
            f"mixture-of-experts model whose router and experts take no LoRA; {ATTENTION} "
            "(attention)",
        ),
    }


@pytest.mark.parametrize("case", ["experts", "dense-mlp"])
@pytest.mark.parametrize("used", [True, False], ids=["used", "unused"])
def test_expert_adapters_refused_in_one_line(
    tmp_path, mixtral_dir, mixtral_adapters, llama_adapters, case, used
):
    path, message = _expert_adapters(mixtral_dir, llama_adapters, tmp_path)[case]
    rows = [{"prompt": "hello", "adapter": "bad" if used else "qv8", "max_tokens": 2}]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    res, out = _generate(run_dir, mixtral_dir, {"qv8": mixtral_adapters["qv8"], "bad": path}, rows)
    assert res.returncode == 1
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0] == "lorafleet generate: " + message
    assert not out.exists()
