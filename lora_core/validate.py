"""Validate a PEFT LoRA adapter directory without torch (the registry calls this too).

Nothing is loaded into torch: the config is parsed, the safetensors header is read, every
tensor name and shape is checked against the config (and the base model when given), and
the weights are scanned (memory-mapped) for NaN and infinities. `adapter_files` finds and reads
the files; `validate_moe` refuses targets on a mixture-of-experts base's MLP side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lora_core.adapter_files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterFiles,
    content_hash,
    require_files,
    resolve_adapter_dir,
)
from lora_core.base_shape import MODULES, BaseShape
from lora_core.errors import AdapterIncompatible
from lora_core.module_names import (
    module_key,
    parse_module_key,
    parse_tensor_name,
    supported_keys,
    unsupported_keys,
)
from lora_core.peft_config import LoraSpec
from lora_core.safetensors_header import TensorInfo, first_nonfinite, read_safetensors_header
from lora_core.validate_moe import check_moe_targets

# FP8 weights are accepted and widened to the engine dtype when packed (as vLLM's
# .to(dtype) on load does); validation checks them for NaN like the others.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64", "F8_E4M3", "F8_E5M2")
# Without a base, layer indices come from tensor names: bound them (no model is this deep).
MAX_LAYERS = 1024
_MODULES_ALLOWED = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"


@dataclass(frozen=True)
class ModuleInfo:
    """One adapted projection: lora_A [rank, in_features], lora_B [out_features, rank]."""

    rank: int
    in_features: int
    out_features: int
    scaling: float
    dtype: str


@dataclass(frozen=True)
class AdapterManifest:
    """A validated adapter directory.

    path: the resolved directory. spec: its parsed config.
    rank: the largest rank of any module. target_modules: short names that have
    tensors, sorted (e.g. ("k_proj", "q_proj")). modules: {(layer, short name): info}.
    content_hash: sha256 hex of adapter_config.json bytes + adapter_model.safetensors bytes.
    base_model: base_model_name_or_path from the config ("" if unset).
    """

    path: str
    spec: LoraSpec
    rank: int
    target_modules: tuple[str, ...]
    modules: dict[tuple[int, str], ModuleInfo]
    content_hash: str
    base_model: str

    @property
    def config_path(self) -> Path:
        return Path(self.path) / CONFIG_FILE

    @property
    def weights_path(self) -> Path:
        return Path(self.path) / WEIGHTS_FILE


def validate_adapter_dir(
    path: str | Path, *, max_rank: int, base: BaseShape | None = None
) -> AdapterManifest:
    """Check an adapter directory; AdapterLoadFailed / AdapterIncompatible name what is wrong.

    Without `base` (the registry) everything but the fit to the base shapes is checked.
    The weights are read through a memory map and hashed in chunks (nothing held in memory).
    """
    root = resolve_adapter_dir(path)
    require_files(root)
    spec = LoraSpec.from_file(root / CONFIG_FILE, base)
    tensors = read_safetensors_header(root / WEIGHTS_FILE)
    modules = _check_modules(spec, tensors, max_rank, base)
    _check_finite(first_nonfinite(root / WEIGHTS_FILE))
    return _manifest(root, spec, modules, content_hash(root))


def validate_adapter_files(
    files: AdapterFiles, *, max_rank: int, base: BaseShape | None = None
) -> AdapterManifest:
    """validate_adapter_dir on files already read (a replica about to load them)."""
    spec = LoraSpec.from_bytes(files.root / CONFIG_FILE, files.config, base)
    tensors = read_safetensors_header(files.root / WEIGHTS_FILE, files.weights)
    modules = _check_modules(spec, tensors, max_rank, base)
    _check_finite(first_nonfinite(files.root / WEIGHTS_FILE, files.weights))
    return _manifest(files.root, spec, modules, files.content_hash)


def _check_modules(
    spec: LoraSpec, tensors: dict[str, TensorInfo], max_rank: int, base: BaseShape | None
) -> dict[tuple[int, str], ModuleInfo]:
    if base is not None and base.num_experts:
        check_moe_targets(spec, base, tensors)
    expected = _check_targets(spec, _num_layers(tensors, base), base)
    pairs = _pair_tensors(tensors)
    modules = {lm: _module_info(spec, lm, ab, max_rank, base) for lm, ab in sorted(pairs.items())}
    _check_coverage(expected, set(modules))
    return modules


def _check_finite(nonfinite: str | None) -> None:
    if nonfinite is not None:
        # A NaN would not fail a request: it would silently turn every answer to garbage.
        raise AdapterIncompatible(nonfinite, "holds NaN or infinite values", "finite weights")


def _manifest(
    root: Path, spec: LoraSpec, modules: dict[tuple[int, str], ModuleInfo], digest: str
) -> AdapterManifest:
    return AdapterManifest(
        path=str(root),
        spec=spec,
        rank=max(info.rank for info in modules.values()),
        target_modules=tuple(sorted({m for _, m in modules})),
        modules=modules,
        content_hash=digest,
        base_model=spec.base_model,
    )


def _num_layers(tensors: dict[str, TensorInfo], base: BaseShape | None) -> int:
    """The base's layer count, or (without a base) as many layers as the tensors name."""
    if base is not None:
        return base.num_layers
    layers = [p[0] for name in tensors if (p := parse_tensor_name(name)) is not None]
    deepest = max(layers, default=0)
    if deepest >= MAX_LAYERS:
        raise AdapterIncompatible(
            WEIGHTS_FILE, f"names layer {deepest}", f"layer indices below {MAX_LAYERS}"
        )
    return 1 + deepest


def _pair_tensors(tensors: dict[str, TensorInfo]) -> dict[tuple[int, str], dict[str, TensorInfo]]:
    """{(layer, module): {"A": info, "B": info}}; refuses foreign or unpaired tensors."""
    pairs: dict[tuple[int, str], dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        parsed = parse_tensor_name(name)
        if parsed is None:
            raise AdapterIncompatible(
                name,
                "not a lora_A/lora_B weight of a supported module",
                f"base_model.model.model.layers.<i>.(self_attn|mlp).<module>.lora_(A|B).weight "
                f"for module in {_MODULES_ALLOWED}",
            )
        layer, module, ab = parsed
        pairs.setdefault((layer, module), {})[ab] = info
    if not pairs:
        raise AdapterIncompatible(WEIGHTS_FILE, "holds no LoRA tensors", "lora_A/lora_B weights")
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterIncompatible(
                f"{module_key(layer, module)}.{missing}.weight",
                "is missing",
                "both lora_A and lora_B",
            )
    return pairs


def _check_targets(spec: LoraSpec, num_layers: int, base: BaseShape | None) -> set[tuple[int, str]]:
    """The (layer, module) pairs the config targets; refuses targets the base lacks."""
    allowed = ", ".join(base.lora_modules) if base is not None else _MODULES_ALLOWED
    for key in unsupported_keys(num_layers):
        if spec.targets(key):
            raise AdapterIncompatible(
                "target_modules", f"matches {key!r}, which this engine cannot adapt", allowed
            )
    base_keys = supported_keys(num_layers, base.lora_modules if base is not None else MODULES)
    matched = [k for k in base_keys if spec.targets(k)]
    if not matched:
        raise AdapterIncompatible(
            "target_modules",
            f"{spec.target_modules!r} matches no module of the base model",
            allowed,
        )
    if not isinstance(spec.target_modules, str):
        # Against every module of the base, not only the adapted ones: peft saves an
        # "all-linear" + exclude_modules adapter with the excluded modules still listed.
        for entry in spec.target_modules:
            if not any(k == entry or k.endswith(f".{entry}") for k in base_keys):
                raise AdapterIncompatible(
                    "target_modules", f"{entry!r} matches no module of the base model", allowed
                )
    return {lm for k in matched if (lm := parse_module_key(k)) is not None}


def _module_info(
    spec: LoraSpec,
    layer_module: tuple[int, str],
    ab: dict[str, TensorInfo],
    max_rank: int,
    base: BaseShape | None,
) -> ModuleInfo:
    layer, module = layer_module
    key = module_key(layer, module)
    (a_dtype, a_shape), (b_dtype, b_shape) = ab["A"], ab["B"]
    for suffix, dtype, shape in (("A", a_dtype, a_shape), ("B", b_dtype, b_shape)):
        if dtype not in FLOAT_DTYPES or len(shape) != 2:
            raise AdapterIncompatible(
                f"{key}.lora_{suffix}.weight",
                f"dtype {dtype} shape {list(shape)}",
                f"a 2-D float tensor ({', '.join(FLOAT_DTYPES)})",
            )
    rank, in_features = a_shape
    out_features = b_shape[0]
    if b_shape[1] != rank:
        raise AdapterIncompatible(
            f"{key}.lora_B.weight",
            f"shape {list(b_shape)} does not match lora_A {list(a_shape)}",
            f"[out_features, {rank}]",
        )
    _check_rank(spec, key, rank, max_rank)
    if base is not None and layer >= base.num_layers:
        raise AdapterIncompatible(
            f"{key}.lora_A.weight",
            f"layer {layer} does not exist in the base model",
            f"layers 0..{base.num_layers - 1}",
        )
    if base is not None and (in_features, out_features) != base.module_shape(module):
        want_in, want_out = base.module_shape(module)
        raise AdapterIncompatible(
            f"{key}.lora_A/lora_B.weight",
            f"in/out features ({in_features}, {out_features}) do not fit the base model",
            f"lora_A [r, {want_in}], lora_B [{want_out}, r]",
        )
    return ModuleInfo(rank, in_features, out_features, spec.scaling_for(key), a_dtype)


def _check_rank(spec: LoraSpec, key: str, rank: int, max_rank: int) -> None:
    declared, field = spec.rank_for(key), spec.rank_field(key)
    if declared > max_rank:
        raise AdapterIncompatible(
            field, f"rank {declared} of {key} exceeds max_rank", f"rank <= {max_rank}"
        )
    if rank != declared:
        raise AdapterIncompatible(
            f"{key}.lora_A.weight", f"rank {rank} but {field} says {declared}", f"rank {declared}"
        )


def _check_coverage(expected: set[tuple[int, str]], present: set[tuple[int, str]]) -> None:
    extra = sorted(present - expected)
    if extra:
        layer, module = extra[0]
        raise AdapterIncompatible(
            f"{module_key(layer, module)}.lora_A.weight",
            "is not targeted by target_modules/layers_to_transform",
            "tensors only for targeted modules",
        )
    missing = sorted(expected - present)
    if missing:
        layer, module = missing[0]
        raise AdapterIncompatible(
            f"{module_key(layer, module)}.lora_A.weight",
            f"is missing ({len(missing)} targeted modules have no tensors)",
            "lora_A and lora_B for every targeted module",
        )


__all__ = [
    "AdapterManifest",
    "ModuleInfo",
    "content_hash",
    "resolve_adapter_dir",
    "validate_adapter_dir",
]
