"""The demo: a tiny random Llama model, a byte-level BPE tokenizer and three adapters.

Everything is generated deterministically (fixed seeds, a built-in corpus) on first
use into a cache directory, so `serve run deploy/cluster.yaml` and
`lorafleet generate` work on a fresh machine with no model hub. Tests reuse
`build_tokenizer` and `build_model` to make their own tiny models.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

DEMO_BASE_NAME = "lorafleet-demo-base"
_CORPUS_WORDS = (
    "the quick brown fox jumps over the lazy dog while tenants share one base model "
    "and every adapter answers its own questions about serving routing memory kernels "
    "batches tokens prefix cache replica cluster redis registry slots ranks weights "
    "hello world how are you today what is lorafleet a multi tenant lora serving system"
).split()
CHAT_TEMPLATE = (
    # tools (chat's `tools`) as Hermes writes them: listed in a system turn first, each
    # earlier call as a <tool_call> block, a tool's answer as a "tool" turn
    "{% if tools %}<|system|>You may call these tools. To call one, answer "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.\n<tools>'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


@dataclass(frozen=True)
class DemoAssets:
    """Paths of the generated demo: the base model dir and adapter dirs by name."""

    model_dir: Path
    adapters: dict[str, Path]
    base_name: str = DEMO_BASE_NAME


def default_cache_dir() -> Path:
    root = os.environ.get("LORAFLEET_CACHE") or Path.home() / ".cache" / "lorafleet"
    return Path(root) / "demo-v2"  # v2: the chat template renders tools


def _corpus() -> list[str]:
    g = torch.Generator().manual_seed(1234)
    lines = []
    for _ in range(400):
        idx = torch.randint(len(_CORPUS_WORDS), (12,), generator=g).tolist()
        lines.append(" ".join(_CORPUS_WORDS[i] for i in idx))
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int = 384) -> None:
    """Train a small byte-level BPE tokenizer and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_model(
    out_dir: Path,
    *,
    arch: str = "llama",
    vocab_size: int = 384,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    seed: int = 0,
    shard_bytes: str | None = None,
    tie_word_embeddings: bool = False,
    **config,
) -> None:
    """Save a random-init HF model (config.json + safetensors) of the given architecture;
    tie_word_embeddings: the lm_head is the embedding (no lm_head.weight is saved);
    config: further config fields (e.g. head_dim, attention_bias). Biases (Qwen2's q/k/v,
    a Qwen3's with attention_bias) are drawn around 0 and a Qwen3's per-head q/k norm
    weights around 1, where transformers initialises them to zeros and ones, so a model
    that skipped or misplaced them would not match."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    cfg = cfg_cls(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=1024,
        initializer_range=0.08,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=0,
        **config,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    vary_biases_and_norms(model)
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(str(out_dir), safe_serialization=True, **kwargs)


def vary_biases_and_norms(model: torch.nn.Module) -> None:
    """Draw a random-init model's biases around 0 and its per-head q/k norm weights around
    1 (from torch's global generator), where transformers initialises them to zeros and
    ones: a model that skipped or misplaced them would then not match."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape))


def write_peft_adapter(
    out_dir: Path,
    *,
    num_layers: int,
    shapes: dict[str, tuple[int, int]],
    rank: int,
    alpha: float,
    seed: int,
    base_model: str,
) -> None:
    """Write a PEFT-format LoRA adapter (adapter_config.json + adapter_model.safetensors).

    shapes: PEFT module name -> (in_features, out_features) of the targeted modules.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module, (n_in, n_out) in shapes.items():
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.2
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(shapes),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))


_DEMO_ADAPTERS = {
    # name: (targets, rank, alpha, seed)
    "demo-poet": (("q_proj", "v_proj"), 8, 16, 11),
    "demo-coder": (("q_proj", "k_proj", "v_proj", "o_proj"), 16, 16, 12),
    "demo-chef": (("gate_proj", "up_proj", "down_proj"), 4, 8, 13),
}


def ensure_demo(cache_dir: Path | None = None) -> DemoAssets:
    """Generate the demo model, tokenizer and adapters once; return their paths."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    model_dir = root / DEMO_BASE_NAME
    adapters = {name: root / "adapters" / name for name in _DEMO_ADAPTERS}
    marker = root / ".complete"
    if marker.exists():
        return DemoAssets(model_dir, adapters)
    root.mkdir(parents=True, exist_ok=True)
    # Several replicas may start at once: one builds, the others wait on the lock.
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists():
            _build_demo(model_dir, adapters)
            marker.write_text("ok\n")
    return DemoAssets(model_dir, adapters)


# The demo model's shape (a tiny Llama).
DEMO_MODEL = dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256)


def demo_module_shapes() -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of the demo model."""
    h, inter = DEMO_MODEL["hidden"], DEMO_MODEL["intermediate"]
    q = DEMO_MODEL["heads"] * (h // DEMO_MODEL["heads"])
    kv = DEMO_MODEL["kv_heads"] * (h // DEMO_MODEL["heads"])
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def write_demo_adapter(
    path: Path, targets: tuple[str, ...], rank: int, alpha: float, seed: int
) -> Path:
    """A random PEFT adapter for the demo model (demo adapters, tests, benchmarks)."""
    shapes = demo_module_shapes()
    write_peft_adapter(
        path,
        num_layers=DEMO_MODEL["layers"],
        shapes={t: shapes[t] for t in targets},
        rank=rank,
        alpha=alpha,
        seed=seed,
        base_model=DEMO_BASE_NAME,
    )
    return path


def _build_demo(model_dir: Path, adapters: dict[str, Path]) -> None:
    build_tokenizer(model_dir)
    build_model(model_dir, **DEMO_MODEL)
    for name, (targets, rank, alpha, seed) in _DEMO_ADAPTERS.items():
        write_demo_adapter(adapters[name], targets, rank, alpha, seed)


def demo_prompts_jsonl(path: Path, assets: DemoAssets) -> None:
    """A sample input for `lorafleet generate`: each prompt under base and every demo adapter."""
    prompts = ["hello world how are you", "what is lorafleet", "the quick brown fox"]
    with path.open("w") as f:
        for prompt in prompts:
            for name in [None, *assets.adapters]:
                f.write(json.dumps({"prompt": prompt, "adapter": name}) + "\n")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Generate the demo model/adapters; print their paths.")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument(
        "--write-input", type=Path, default=None, help="also write a sample generate input"
    )
    args = ap.parse_args()
    assets = ensure_demo(args.cache_dir)
    if args.write_input:
        demo_prompts_jsonl(args.write_input, assets)
    print(
        json.dumps(
            {
                "model_dir": str(assets.model_dir),
                "adapters": {k: str(v) for k, v in assets.adapters.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
