"""An adapter's weights on CPU, packed for the engine's fused layers.

For each layer and group of `base_shape.GROUPS` (qkv, o, gate_up, down) each slice
holds A: [r_s, H] and B: [N_s, r_s] with the module's scaling (alpha/r, or
alpha/sqrt(r) with rslora; per module from rank_pattern/alpha_pattern) folded into B,
so delta_s(x) = x @ A^T @ B^T. A slice the adapter does not target is None.

PEFT stores lora_A [r, in] and lora_B [out, r] whatever `fan_in_fan_out` says (that
flag only describes the base weight's layout, peft/tuners/lora/layer.py), so no
transpose is needed for either value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from lora_core.adapter_files import AdapterFiles, read_adapter_files
from lora_core.base_shape import GROUPS, BaseShape
from lora_core.errors import AdapterIncompatible, AdapterLoadFailed
from lora_core.module_names import PEFT_PREFIX, module_key
from lora_core.validate import AdapterManifest

# Per layer: {group: one entry per slice (None = untargeted)}.
LayerSlices = dict[str, tuple["SliceWeights | None", ...]]


@dataclass(frozen=True)
class SliceWeights:
    """One adapted projection. a: [r, H]; b: [N, r], already multiplied by the scaling."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class AdapterWeights:
    """content_hash: the manifest's; rank: the largest slice rank; layers[i][group] slices."""

    content_hash: str
    rank: int
    layers: tuple[LayerSlices, ...]

    def slices(self, layer: int, group: str) -> tuple[SliceWeights | None, ...]:
        return self.layers[layer][group]

    @property
    def nbytes(self) -> int:
        """Bytes held by all A and B tensors."""
        return sum(
            s.a.numel() * s.a.element_size() + s.b.numel() * s.b.element_size()
            for layer in self.layers
            for slices in layer.values()
            for s in slices
            if s is not None
        )


def load_adapter_weights(
    manifest: AdapterManifest,
    base: BaseShape,
    dtype: torch.dtype,
    files: AdapterFiles | None = None,
) -> AdapterWeights:
    """Read, verify (content hash, shapes) and pack a validated adapter on CPU in `dtype`.

    files: the bytes `manifest` was validated from (used as they are, not read again).
    """
    beyond = [lm for lm in manifest.modules if lm[0] >= base.num_layers]
    if beyond:
        layer, module = min(beyond)
        raise AdapterIncompatible(
            f"{module_key(layer, module)}.lora_A.weight",
            f"layer {layer} does not exist in the base model",
            f"layers 0..{base.num_layers - 1}",
        )
    tensors = _read_verified(manifest, files)
    layers = []
    for layer in range(base.num_layers):
        layers.append({g: _group(manifest, tensors, base, layer, g, dtype) for g in GROUPS})
    return AdapterWeights(manifest.content_hash, manifest.rank, tuple(layers))


def _read_verified(
    manifest: AdapterManifest, files: AdapterFiles | None
) -> dict[str, torch.Tensor]:
    """The safetensors tensors, refused unless the files still hash to the manifest's hash."""
    if files is None:
        files = read_adapter_files(manifest.path)
    data, digest = files.weights, files.content_hash
    if digest != manifest.content_hash:
        raise AdapterLoadFailed(
            f"{manifest.path}: files changed since validation (sha256 {digest[:16]}, "
            f"expected {manifest.content_hash[:16]}); allowed: re-register the adapter"
        )
    try:
        return load_safetensors(data)
    except SafetensorError as e:
        raise AdapterLoadFailed(f"{manifest.weights_path}: corrupt safetensors file: {e}") from e


def _group(
    manifest: AdapterManifest,
    tensors: dict[str, torch.Tensor],
    base: BaseShape,
    layer: int,
    group: str,
    dtype: torch.dtype,
) -> tuple[SliceWeights | None, ...]:
    return tuple(_slice(manifest, tensors, base, layer, module, dtype) for module in GROUPS[group])


def _slice(
    manifest: AdapterManifest,
    tensors: dict[str, torch.Tensor],
    base: BaseShape,
    layer: int,
    module: str,
    dtype: torch.dtype,
) -> SliceWeights | None:
    info = manifest.modules.get((layer, module))
    if info is None:
        return None
    name = PEFT_PREFIX + module_key(layer, module)
    a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
    want_in, want_out = base.module_shape(module)
    if tuple(a.shape) != (info.rank, want_in) or tuple(b.shape) != (want_out, info.rank):
        raise AdapterIncompatible(
            f"{name}.lora_A/lora_B.weight",
            f"shapes {list(a.shape)} / {list(b.shape)} do not fit the base model",
            f"lora_A [r, {want_in}], lora_B [{want_out}, r]",
        )
    # Fold the scaling in float64 so the rounding happens once, in the final cast.
    b_scaled = b.to(torch.float64) * info.scaling
    return SliceWeights(a.to(dtype).contiguous(), b_scaled.to(dtype).contiguous())
