"""Builders of tiny models and PEFT adapters shared by the test suite, and a runner of
engine requests to completion.

Every test builds what it needs from these (no hub access): a random-init HF model
of a given architecture with a locally trained byte-level BPE tokenizer, and PEFT
LoRA adapters saved by `peft` itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deploy.demo import build_model, build_tokenizer

TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)


def make_tiny_model(
    out_dir: Path, arch: str = "llama", seed: int = 0, vocab_size: int = 384, **overrides
) -> Path:
    """A tiny random model + tokenizer (of vocab_size tokens both) in out_dir (returns it)."""
    if (out_dir / "config.json").exists():
        return out_dir
    build_tokenizer(out_dir, vocab_size)
    build_model(out_dir, arch=arch, seed=seed, vocab_size=vocab_size, **{**TINY, **overrides})
    return out_dir


def make_tiny_mixtral(
    out_dir: Path, seed: int = 0, experts: int = 4, top_k: int = 2, fused: bool = False
) -> Path:
    """A tiny random Mixtral (TINY's sizes, `experts` experts of TINY's intermediate, top_k
    of them per token) + the tiny tokenizer in out_dir. transformers 5 saves the experts
    per expert (block_sparse_moe.experts.<e>.w1/w2/w3, block_sparse_moe.gate); fused: the
    weights are written in its in-memory naming instead (mlp.gate, mlp.experts.gate_up_proj
    [E, 2I, H], mlp.experts.down_proj [E, H, I]), which its loader reads too."""
    import transformers

    if (out_dir / "config.json").exists():
        return out_dir
    cfg = transformers.MixtralConfig(
        **_tiny_config(), intermediate_size=TINY["intermediate"], num_local_experts=experts,
        num_experts_per_tok=top_k,
    )  # fmt: skip
    return _save_moe(out_dir, transformers.MixtralForCausalLM, cfg, seed, fused)


# A Qwen MoE's sizes beyond TINY's: experts of 48 features (moe_intermediate_size), the
# dense MLPs (mlp_only_layers) TINY's 128, Qwen2-MoE's shared expert 96: all different,
# so a size taken for another fails to load.
QWEN_MOE = dict(moe_intermediate_size=48, shared_expert_intermediate_size=96)


def make_tiny_qwen_moe(
    out_dir: Path,
    arch: str = "qwen3_moe",
    seed: int = 0,
    experts: int = 4,
    top_k: int = 2,
    fused: bool = False,
    **config,
) -> Path:
    """A tiny random Qwen3-MoE (arch "qwen3_moe") or Qwen2-MoE ("qwen2_moe", with its
    shared expert and q/k/v biases) + the tiny tokenizer in out_dir: TINY's sizes,
    `experts` experts of QWEN_MOE's sizes, top_k per token; config: further fields
    (num_hidden_layers, mlp_only_layers, decoder_sparse_step, norm_topk_prob, head_dim,
    ...). transformers 5 saves the experts per expert (mlp.experts.<e>.gate_proj/up_proj/
    down_proj); fused: in its in-memory naming instead (mlp.experts.gate_up_proj /
    down_proj). Biases are drawn around 0 and q/k norm weights around 1 (transformers'
    zeros and ones would hide one skipped)."""
    import transformers

    if (out_dir / "config.json").exists():
        return out_dir
    cfg_cls, model_cls = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    }[arch]
    sizes = dict(QWEN_MOE)
    if arch == "qwen3_moe":
        del sizes["shared_expert_intermediate_size"]
    fields = {**_tiny_config(), "intermediate_size": TINY["intermediate"], **sizes, **config}
    cfg = cfg_cls(**fields, num_experts=experts, num_experts_per_tok=top_k)
    return _save_moe(out_dir, model_cls, cfg, seed, fused)


def _tiny_config() -> dict:
    return dict(
        vocab_size=384,
        hidden_size=TINY["hidden"],
        num_hidden_layers=TINY["layers"],
        num_attention_heads=TINY["heads"],
        num_key_value_heads=TINY["kv_heads"],
        max_position_embeddings=1024,
        initializer_range=0.08,
        bos_token_id=0,
        eos_token_id=0,
    )


def _save_moe(out_dir: Path, model_cls, cfg, seed: int, fused: bool) -> Path:
    """A model_cls(cfg) of weights drawn from seed, saved (fused: in its in-memory naming)
    with the tiny tokenizer in out_dir."""
    from safetensors.torch import save_file

    from deploy.demo import vary_biases_and_norms

    build_tokenizer(out_dir, 384)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    vary_biases_and_norms(model)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if fused:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(".mlp.experts.gate_up_proj" in k for k in state)
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


THINK_TEMPLATE_END = (
    # Qwen 3's: enable_thinking false closes the thinking in the prompt
    "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}"
)


def make_think_model(out_dir: Path, seed: int = 4) -> Path:
    """A tiny Llama of a reasoning model's vocabulary: the tiny tokenizer with "<think>" and
    "</think>" added as one token each (not special: their text stays in the output), as
    Qwen 3's and DeepSeek-R1's are, and a chat template that honours
    chat_template_kwargs {"enable_thinking": false} as Qwen 3's does."""
    from transformers import AutoTokenizer

    if (out_dir / "config.json").exists():
        return out_dir
    build_tokenizer(out_dir, 384)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template += THINK_TEMPLATE_END
    tok.save_pretrained(str(out_dir))
    build_model(out_dir, arch="llama", seed=seed, vocab_size=len(tok), **TINY)
    return out_dir


def make_peft_adapter(
    model_dir: Path, out_dir: Path, seed: int = 0, scale: float = 0.3, **lora_kwargs
) -> Path:
    """Save a PEFT LoRA adapter for model_dir with random (non-zero) A and B."""
    import transformers
    from peft import LoraConfig, get_peft_model

    if (out_dir / "adapter_config.json").exists():
        return out_dir
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lora_kwargs.setdefault("lora_dropout", 0.0)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(str(out_dir))
    return out_dir


# Five adapters of different ranks and targets (rsLoRA, rank/alpha patterns, partial modules).
ADAPTER_SPECS: dict[str, dict] = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all16rs": dict(
        r=16,
        lora_alpha=8,
        use_rslora=True,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
    "mlp4": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "pattern": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        rank_pattern={"q_proj": 16, "o_proj": 2},
        alpha_pattern={"v_proj": 32},
    ),
    "regex12": dict(r=12, lora_alpha=24, target_modules=r".*\.(k_proj|down_proj)"),
}


# Adapters of a mixture-of-experts model: its attention projections only (its MLP side
# takes no LoRA).
MOE_ADAPTER_SPECS: dict[str, dict] = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "attn16rs": dict(
        r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    ),
    "pattern": dict(
        r=8,
        lora_alpha=16,
        target_modules=r".*\.(k_proj|o_proj)",
        rank_pattern={"o_proj": 4},
    ),
}


def mixed_requests(prompts: list[str], params, refs: dict) -> list[tuple]:
    """Every prompt with the base and each adapter ref {name: ref} -> run_requests'
    requests, named "<name or base>-<prompt index>"."""
    return [
        (f"{name or 'base'}-{i}", prompt, params, refs[name] if name else None)
        for i, prompt in enumerate(prompts)
        for name in (None, *refs)
    ]


def run_requests(engine, requests) -> dict[str, list[int]]:
    """Add requests [(rid, prompt, params, adapter ref or None)] to an LLMEngine and step
    it until all finish -> {rid: generated token ids}."""
    for rid, prompt, params, ref in requests:
        engine.add_request(rid, engine.tokenizer(prompt).input_ids, params, ref)
    out: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def with_mlp_lora(src: Path, dst: Path, layers: int, hidden: int, intermediate: int) -> Path:
    """A copy of the rank-8 q/v adapter src at dst that also puts LoRA on every layer's
    dense MLP projections (gate_proj, up_proj, down_proj), as a same-sized dense model's
    adapter would: what a mixture-of-experts base must refuse. -> dst."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    sizes = {"gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
             "down_proj": (intermediate, hidden)}  # fmt: skip
    for layer in range(layers):
        for module, (n_in, n_out) in sizes.items():
            key = f"base_model.model.model.layers.{layer}.mlp.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(8, n_in)
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, 8)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst
