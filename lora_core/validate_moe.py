"""The refusal of an adapter reaching a mixture-of-experts base's MLP side (torch-free).

A mixture-of-experts base takes LoRA on attention only (`BaseShape.lora_modules`): target_modules
matching its router, experts, Qwen2-MoE's shared expert or a Qwen MoE's dense MLP layers
(`module_names.moe_keys`) are refused before any tensor is checked.
"""

from __future__ import annotations

from lora_core.base_shape import BaseShape
from lora_core.errors import AdapterIncompatible
from lora_core.module_names import moe_keys, parse_module_key, tensor_module_key
from lora_core.peft_config import LoraSpec
from lora_core.safetensors_header import TensorInfo


def check_moe_targets(spec: LoraSpec, base: BaseShape, tensors: dict[str, TensorInfo]) -> None:
    """Refuses target_modules reaching a mixture-of-experts model's MLP side (`moe_keys`),
    naming the first such module (layer-major) the adapter holds tensors for, else the
    first the model has (`_in_model`), else the first the config reaches: moe_keys lists
    mlp.gate_proj/up_proj/down_proj on every layer (a same-sized Llama adapter's targets),
    so the first match alone may name a sparse layer 0's mlp.down_proj, which no Qwen MoE
    or Mixtral has."""
    keys = moe_keys(base.num_layers, base.num_experts, base.architecture)
    targeted = [key for key in keys if spec.targets(key)]
    if not targeted:
        return
    held = {tensor_module_key(name) for name in tensors}
    in_model = [k for k in targeted if _in_model(k, base)]
    key = next((k for k in targeted if k in held), (in_model or targeted)[0])
    raise AdapterIncompatible(
        "target_modules",
        f"matches {key!r}: {base.architecture} is a mixture-of-experts model "
        f"whose {base.moe_parts} take no LoRA",
        f"{', '.join(base.lora_modules)} (attention)",
    )


def _in_model(key: str, base: BaseShape) -> bool:
    """Whether the model has this moe_keys key (in transformers 5's naming or the older
    one): a sparse layer (`BaseShape.moe_layers`) has all but the dense
    mlp.gate_proj/up_proj/down_proj, a Qwen MoE's dense layer only those. Every key, where
    moe_layers is unknown (a base recorded before it was)."""
    if not base.moe_layers:
        return True
    layer = int(key.split(".")[2])
    dense = parse_module_key(key) is not None  # of moe_keys, only mlp.<module> parses
    return dense != base.moe_layers[layer]
