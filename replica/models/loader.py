"""Load a Llama-family model from a local HF directory or a cached hub id.

Weights come only from safetensors (one file or a sharded index); q/k/v and gate/up
checkpoint tensors are copied into their slices of the fused layers. Every linear
layer's tensor, the embedding's and the lm_head's go through their module's
`weight_loader`, which reads only this TP rank's shard (rows of the vocabulary for the
embedding and the lm_head).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lora_core.errors import ModelLoadFailed
from replica.layers.linear import Linear
from replica.layers.vocab import VocabParallelEmbedding
from replica.models.config import ModelConfig
from replica.models.llama import CausalLM
from replica.parallel import SINGLE, TPGroup

# checkpoint projection name -> (fused module attribute, slice index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
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


def _target(model: CausalLM, name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (our parameter name, slice index of a fused layer or None)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        attr, shard = _FUSED[parts[-2]]
        return ".".join(parts[:-2] + [attr, parts[-1]]), shard
    return name, None


def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Copy every checkpoint tensor into `model`; every parameter must be covered."""
    params = dict(model.named_parameters(remove_duplicate=True))
    skip_head = model.config.tie_word_embeddings  # the embedding is the head
    loaded: set[str] = set()
    for file in _weight_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if "rotary_emb" in name or (name == "lm_head.weight" and skip_head):
                        continue
                    target, shard = _target(model, name)
                    if target not in params:
                        raise ModelLoadFailed(f"{file.name}: unexpected tensor {name!r}")
                    param = params[target]
                    module = model.get_submodule(target.rsplit(".", 1)[0])
                    if isinstance(module, Linear):  # reads only this rank's shard
                        module.weight_loader(param, f.get_slice(name), shard)
                    elif isinstance(module, VocabParallelEmbedding):  # and the lm_head
                        module.weight_loader(param, f.get_slice(name))
                    else:
                        tensor = f.get_tensor(name)
                        if param.shape != tensor.shape:
                            raise ModelLoadFailed(
                                f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                            )
                        param.data.copy_(tensor)
                    loaded.add(target)
        except (OSError, RuntimeError, ValueError, AttributeError, SafetensorError) as e:
            raise ModelLoadFailed(f"cannot load {file.name}: {e}") from e
    missing = set(params) - loaded
    if missing:
        raise ModelLoadFailed(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")


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
