"""Load a Llama-family (Llama, Mistral, Qwen2, Qwen3) or mixture-of-experts (Mixtral,
Qwen2-MoE, Qwen3-MoE) model from a local HF directory or a cached hub id.

Weights come only from safetensors (one file or a sharded index); q/k/v and gate/up
checkpoint tensors are copied into their slices of the fused layers. Every linear
layer's tensor, the embedding's and the lm_head's go through their module's
`weight_loader`, which reads only this TP rank's shard (rows of the vocabulary for the
embedding and the lm_head); the norms (Qwen3's per-head q_norm / k_norm included) are
replicated, read whole by every rank. Experts go through `LocalExperts.weight_loader`,
which reads only this rank's experts, from either checkpoint naming transformers loads:
fused `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I], or
per expert (what transformers 5 still saves): a Mixtral's
`block_sparse_moe.experts.<e>.w1 / w3` (gate / up, [I, H]) and `.w2` (down, [H, I]) with
the router at `block_sparse_moe.gate`, a Qwen MoE's `mlp.experts.<e>.gate_proj / up_proj /
down_proj`. A Qwen2-MoE's shared expert (`mlp.shared_expert.gate_proj / up_proj /
down_proj`) loads as a dense MLP, its `mlp.shared_expert_gate` replicated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lora_core.errors import ModelLoadFailed
from replica.layers.linear import Linear
from replica.layers.vocab import VocabParallelEmbedding
from replica.models.config import ModelConfig
from replica.models.llama import CausalLM
from replica.models.moe import LocalExperts
from replica.parallel import SINGLE, TPGroup

# checkpoint projection name -> (fused module attribute, slice index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Per-expert checkpoint tensors: Mixtral's w1 gate, w3 up (parts of gate_up_proj), w2
# down; a Qwen MoE's gate_proj, up_proj, down_proj.
_EXPERT_RE = re.compile(
    r"(.+)\.(?:block_sparse_moe\.experts\.(\d+)\.(w[123])"
    r"|mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj))\.weight"
)
_EXPERT_PART = {
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


def resolve_model_dir(model: str) -> Path:
    """A local directory as is; otherwise a hub id looked up in the local HF cache only."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelLoadFailed(
            f"model {model!r}: not a directory; allowed: a HF model directory or a cached hub id"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any hub failure means "not available locally"
        raise ModelLoadFailed(
            f"model {model!r}: no such directory and not in the local HF cache ({type(e).__name__})"
        ) from e


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadFailed(f"cannot read {path}: {e}") from e
    try:
        return ModelConfig.from_hf(raw)
    except KeyError as e:
        raise ModelLoadFailed(f"{path}: missing field {e.args[0]!r}") from e


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadFailed(f"corrupt {index}: {e}") from e
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = list(model_dir.glob("*.bin")) + list(model_dir.glob("*.pt"))
        hint = " (pickle weights are refused: convert to safetensors)" if pickles else ""
        raise ModelLoadFailed(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def _target(name: str) -> tuple[str, int | None, int]:
    """Checkpoint tensor name -> (our parameter name, slice index of a fused layer or None,
    0); for one expert's tensor (parameter name, its global expert index, its part)."""
    expert = _EXPERT_RE.fullmatch(name)
    if expert is not None:
        prefix, mixtral_index, w, qwen_index, proj = expert.groups()
        attr, part = _EXPERT_PART[w or proj]
        return f"{prefix}.mlp.experts.{attr}", int(mixtral_index or qwen_index), part
    name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        attr, shard = _FUSED[parts[-2]]
        return ".".join(parts[:-2] + [attr, parts[-1]]), shard, 0
    return name, None, 0


def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Copy every checkpoint tensor into `model`; every parameter must be covered."""
    params = dict(model.named_parameters(remove_duplicate=True))
    skip_head = model.config.tie_word_embeddings  # the embedding is the head
    loaded: set[str] = set()
    expert_pieces: dict[str, set[tuple[int, int]]] = {}  # expert parameter -> pieces read
    for file in _weight_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if "rotary_emb" in name or (name == "lm_head.weight" and skip_head):
                        continue
                    target, shard, part = _target(name)
                    if target not in params:
                        raise ModelLoadFailed(f"{file.name}: unexpected tensor {name!r}")
                    parent, attr = target.rsplit(".", 1)
                    module = model.get_submodule(parent)
                    if isinstance(module, LocalExperts):  # reads only this rank's experts
                        pieces = module.weight_loader(attr, f.get_slice(name), shard, part)
                        expert_pieces.setdefault(target, set()).update(pieces)
                        continue
                    _load_tensor(params[target], module, f, name, shard)
                    loaded.add(target)
        except (OSError, RuntimeError, ValueError, AttributeError, SafetensorError) as e:
            raise ModelLoadFailed(f"cannot load {file.name}: {e}") from e
    for target, pieces in expert_pieces.items():
        parent, attr = target.rsplit(".", 1)
        if pieces == model.get_submodule(parent).pieces(attr):
            loaded.add(target)
    missing = set(params) - loaded
    if missing:
        raise ModelLoadFailed(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")


def _load_tensor(param: torch.nn.Parameter, module, f, name: str, shard: int | None) -> None:
    """One checkpoint tensor into param (of `module`), reading only this rank's shard of a
    linear layer, the embedding and the lm_head."""
    if isinstance(module, Linear):
        module.weight_loader(param, f.get_slice(name), shard)
    elif isinstance(module, VocabParallelEmbedding):  # and the lm_head
        module.weight_loader(param, f.get_slice(name))
    else:
        tensor = f.get_tensor(name)
        if param.shape != tensor.shape:
            raise ModelLoadFailed(f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
        param.data.copy_(tensor)


def load_model(
    model: str, dtype: torch.dtype, device: torch.device, tp: TPGroup = SINGLE
) -> tuple[CausalLM, Path]:
    """Build rank tp.rank's shard of `model` (dir or cached hub id) on `device` and load
    its weights."""
    model_dir = resolve_model_dir(model)
    cfg = read_config(model_dir)
    with torch.device(device):
        net = CausalLM(cfg, tp).to(dtype)
    load_weights(net, model_dir)
    return net.eval(), model_dir
