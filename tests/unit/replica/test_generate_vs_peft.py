"""`lorafleet generate` in float32 equals HF transformers + PEFT greedy output, token for token,
with every adapter and base requests mixed in one run and fewer slots than adapters."""

from __future__ import annotations

import json
import os

import pytest
import torch

from deploy.cli import main

PROMPTS = [
    "hello world how are you",
    "the quick brown fox jumps",
    "what is lorafleet a multi tenant lora",
]
MAX_NEW = 10


def _peft_reference(model_dir, adapter_path, prompt_ids: list[list[int]]) -> list[list[int]]:
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, str(adapter_path))
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            gen = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=MAX_NEW,
                do_sample=False,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def _run_cli(tmp_path, model_dir, adapters, rows, *extra) -> list[dict]:
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["generate", "--model", str(model_dir), "--input", str(inp), "--output", str(outp)]
    for name, path in adapters.items():
        args += ["--adapter", f"{name}={path}"]
    args += [
        "--max-tokens",
        str(MAX_NEW),
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "3",
        "--quiet",
        *extra,
    ]
    assert main(args) == 0
    return [json.loads(line) for line in outp.read_text().splitlines()]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(request, tmp_path_factory):
    arch = request.param
    model_dir = request.getfixturevalue(f"{arch}_dir")
    adapters = request.getfixturevalue(f"{arch}_adapters")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tok(p).input_ids for p in PROMPTS]
    ref = {None: _peft_reference(model_dir, None, ids)}
    for name, path in adapters.items():
        ref[name] = _peft_reference(model_dir, path, ids)
    # Interleave adapters so every step mixes several adapters and base requests.
    rows = [{"prompt": p, "adapter": name} for p in PROMPTS for name in [None, *adapters]]
    return model_dir, adapters, ref, rows, tmp_path_factory.mktemp(arch)


def test_mixed_run_equals_peft(setup):
    model_dir, adapters, ref, rows, tmp = setup
    out = _run_cli(tmp, model_dir, adapters, rows)
    assert len(out) == len(rows)
    # Adapters must really change the output, or this test could not fail.
    assert all(ref[name] != ref[None] for name in adapters)
    for row, res in zip(rows, out, strict=True):
        expected = ref[row["adapter"]][PROMPTS.index(row["prompt"])]
        assert res["prompt"] == row["prompt"] and res["adapter"] == row["adapter"]
        assert res["token_ids"] == expected, (row, res)
        assert res["finish_reason"] in ("stop", "length")
        assert res["finish_reason"] == (
            "length" if len(expected) == MAX_NEW and 0 not in expected else "stop"
        )


@pytest.mark.parametrize("dense_prompts", [False, True])
def test_triton_kernels_equal_peft(setup, monkeypatch, dense_prompts):
    """Every kernel on Triton (the CPU interpreter here; CUDA's default): the LoRA
    shrink / expand and kernels.paged_attention, whose prompt chunks and decode tokens
    attend over the paged cache in place, give PEFT's tokens too. dense_prompts: every
    whole prompt through dense causal SDPA instead (CUDA's default from 1024 tokens)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (a CPU machine)")
    monkeypatch.setenv("LORAFLEET_KERNELS", "triton")
    model_dir, adapters, ref, rows, tmp = setup
    out = _run_cli(
        tmp, model_dir, adapters, rows, "--dense-prompt-min", "1" if dense_prompts else "0"
    )
    got = [r["token_ids"] for r in out]
    assert got == [ref[r["adapter"]][PROMPTS.index(r["prompt"])] for r in rows]


def test_prefix_cache_off_gives_identical_outputs(setup):
    model_dir, adapters, _, rows, tmp = setup
    on = _run_cli(tmp, model_dir, adapters, rows + rows)
    off = _run_cli(tmp, model_dir, adapters, rows + rows, "--no-prefix-caching")
    assert [r["token_ids"] for r in on] == [r["token_ids"] for r in off]
    assert [r["text"] for r in on] == [r["text"] for r in off]
