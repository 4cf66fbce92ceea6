"""`adapter_config.json` of a PEFT LoRA adapter, parsed and validated once (torch-free).

Matching follows peft 0.21 (`peft.tuners.tuners_utils.check_target_module_exists`,
`peft.utils.other.get_pattern_key`); module names are transformers keys such as
"model.layers.0.self_attn.q_proj" (a leading "base_model.model." is accepted too).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from lora_core.base_shape import ATTENTION_GROUPS, GROUPS, MODULES, BaseShape
from lora_core.errors import AdapterIncompatible, AdapterLoadFailed
from lora_core.module_names import strip_peft_prefix

# Config fields of LoRA variants that change the math; each must be off/empty. A problem's
# "{value}" names the field's value.
_REFUSED_VARIANTS: dict[str, tuple[str, str]] = {
    "use_dora": ("DoRA adapters are not supported", "use_dora: false"),
    "lora_bias": ("LoRA-B biases are not supported", "lora_bias: false"),
    "use_qalora": ("QA-LoRA adapters are not supported", "use_qalora: false"),
    "use_bdlora": ("BD-LoRA adapters are not supported", "use_bdlora: null or false"),
    "alora_invocation_tokens": ("activated LoRA (aLoRA) is not supported", "null"),
    "layer_replication": ("layer replication is not supported", "null"),
    "trainable_token_indices": ("trainable token embeddings are not supported", "null"),
    "arrow_config": ("Arrow routing is not supported", "null"),
}
ALL_LINEAR = "all-linear"
_MODULES_ALLOWED = "a list of module names or one regex over q/k/v/o/gate/up/down_proj"
_ATTENTION = ", ".join(m for g in ATTENTION_GROUPS for m in GROUPS[g])


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA adapter's configuration.

    r: default rank (>= 1). lora_alpha: default alpha (> 0).
    target_modules: names (a module matches when its key equals one or ends with "."+it)
        or one regex that must fully match the key.
    exclude_modules: same forms, never adapted; None when absent.
    rank_pattern / alpha_pattern: {pattern: rank / alpha}; the first key that matches
        the end of a module key (regex `(.*\\.)?(pattern)$`) overrides r / lora_alpha.
    use_rslora: scaling is alpha/sqrt(r) instead of alpha/r.
    fan_in_fan_out: the base weight is stored [in, out] (GPT-2 Conv1D); PEFT's lora_A
        [r, in] and lora_B [out, r] keep their layout either way.
    lora_dropout: training only; ignored.
    bias: must be "none". use_dora: must be false. modules_to_save: must be empty.
    layers_to_transform / layers_pattern: restrict list targets to these layer indices.
    peft_type: must be "LORA". base_model: base_model_name_or_path ("" if unset).
    """

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    exclude_modules: tuple[str, ...] | str | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    use_rslora: bool
    fan_in_fan_out: bool
    lora_dropout: float
    bias: str
    use_dora: bool
    modules_to_save: tuple[str, ...]
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    peft_type: str
    base_model: str

    @classmethod
    def from_file(cls, path: str | Path, base: BaseShape | None = None) -> LoraSpec:
        """Parse adapter_config.json; AdapterLoadFailed when unreadable or not JSON."""
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise AdapterLoadFailed(f"cannot read {path}: {e}") from e
        return cls.from_bytes(path, raw, base)

    @classmethod
    def from_bytes(cls, path: str | Path, raw: bytes, base: BaseShape | None = None) -> LoraSpec:
        """Parse adapter_config.json's bytes (path names it in messages)."""
        try:
            cfg = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AdapterLoadFailed(f"cannot read {path}: {e}") from e
        if not isinstance(cfg, dict):
            raise AdapterLoadFailed(f"{path}: adapter_config.json is not a JSON object")
        return cls.from_dict(cfg, base)

    @classmethod
    def from_dict(cls, cfg: dict, base: BaseShape | None = None) -> LoraSpec:
        """Validate a parsed adapter_config.json; AdapterIncompatible names the bad field.
        base, the base model's shape where known, only tailors what a refusal allows (the
        projections that base takes LoRA on)."""
        _refuse_variants(cfg, base)
        peft_type = cfg.get("peft_type")
        if peft_type != "LORA":
            raise AdapterIncompatible("peft_type", f"{peft_type!r} is not a LoRA adapter", '"LORA"')
        bias = cfg.get("bias", "none")
        if bias != "none":
            raise AdapterIncompatible("bias", f"bias={bias!r} trains base biases", '"none"')
        modules_to_save = _names(cfg, "modules_to_save", allow_regex=False) or ()
        if modules_to_save:
            raise AdapterIncompatible(
                "modules_to_save",
                f"fully trained modules {list(modules_to_save)} are not supported",
                "null or []",
            )
        targets = _names(cfg, "target_modules", allow_regex=True)
        if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
            # peft resolves it when training; for the Llama family it is every projection.
            targets = MODULES
        if not targets:
            raise AdapterIncompatible("target_modules", "missing or empty", _MODULES_ALLOWED)
        return cls(
            r=_int(cfg, "r", 8),
            lora_alpha=_number(cfg, "lora_alpha", 8),
            target_modules=targets,
            exclude_modules=_names(cfg, "exclude_modules", allow_regex=True),
            rank_pattern=_pattern(cfg, "rank_pattern", int),
            alpha_pattern=_pattern(cfg, "alpha_pattern", float),
            use_rslora=_bool(cfg, "use_rslora"),
            fan_in_fan_out=_bool(cfg, "fan_in_fan_out"),
            lora_dropout=_dropout(cfg),
            bias=bias,
            use_dora=False,
            modules_to_save=(),
            layers_to_transform=_layers(cfg),
            layers_pattern=_names(cfg, "layers_pattern", allow_regex=False) or None,
            peft_type=peft_type,
            base_model=str(cfg.get("base_model_name_or_path") or ""),
        )

    def targets(self, key: str) -> bool:
        """Whether PEFT puts a LoRA layer on the module with this key."""
        key = strip_peft_prefix(key)
        if self.exclude_modules is not None and _list_or_regex_match(self.exclude_modules, key):
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, key) is not None
        if not _list_or_regex_match(self.target_modules, key):
            return False
        if self.layers_to_transform is None:
            return True
        layer = _layer_index(key, self.layers_pattern)
        return layer is not None and layer in self.layers_to_transform

    def rank_for(self, key: str) -> int:
        """The rank PEFT gives the module with this key (rank_pattern, else r)."""
        pattern = _pattern_key(self.rank_pattern, strip_peft_prefix(key))
        return self.r if pattern is None else self.rank_pattern[pattern]

    def alpha_for(self, key: str) -> float:
        """The alpha PEFT gives the module with this key (alpha_pattern, else lora_alpha)."""
        pattern = _pattern_key(self.alpha_pattern, strip_peft_prefix(key))
        return self.lora_alpha if pattern is None else self.alpha_pattern[pattern]

    def scaling_for(self, key: str) -> float:
        """alpha/r, or alpha/sqrt(r) with use_rslora, for the module with this key."""
        rank, alpha = self.rank_for(key), self.alpha_for(key)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def rank_field(self, key: str) -> str:
        """Which config field sets this module's rank ("r" or "rank_pattern[...]")."""
        pattern = _pattern_key(self.rank_pattern, strip_peft_prefix(key))
        return "r" if pattern is None else f"rank_pattern[{pattern!r}]"


def _pattern_key(patterns: dict, key: str) -> str | None:
    """peft's get_pattern_key: first pattern p with `(.*\\.)?(p)$` matching key."""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", key):
            return p
    return None


def _list_or_regex_match(names: tuple[str, ...] | str, key: str) -> bool:
    if isinstance(names, str):
        return re.fullmatch(names, key) is not None
    return key in names or any(key.endswith(f".{n}") for n in names)


def _layer_index(key: str, layers_pattern: tuple[str, ...] | None) -> int | None:
    """The first numbered path segment (after one of layers_pattern if given), as peft does."""
    if not layers_pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        m = None
        for pattern in layers_pattern:
            m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if m is not None:
                break
    return None if m is None else int(m.group("idx"))


def _refuse_variants(cfg: dict, base: BaseShape | None) -> None:
    for field, (problem, allowed) in _REFUSED_VARIANTS.items():
        if cfg.get(field):
            raise AdapterIncompatible(field, problem.format(value=cfg[field]), allowed)
    if value := cfg.get("target_parameters"):
        # peft's LoRA on bare parameters: what it saves for a mixture-of-experts model's
        # fused experts (and router), which take no LoRA here.
        if base is None:
            on = f"{', '.join(MODULES)} (a dense base) or {_ATTENTION} (a mixture-of-experts one)"
        else:
            on = ", ".join(base.lora_modules) + (" (attention)" if base.num_experts else "")
        raise AdapterIncompatible(
            "target_parameters",
            f"{value!r} targets parameters (as peft does for mixture-of-experts expert "
            "weights), which this engine cannot adapt",
            f"null or []; LoRA through target_modules on {on}",
        )


def _int(cfg: dict, field: str, default: int) -> int:
    value = cfg.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterIncompatible(field, f"{field}={value!r}", "an integer >= 1")
    return value


def _number(cfg: dict, field: str, default: float) -> float:
    value = cfg.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise AdapterIncompatible(field, f"{field}={value!r}", "a number > 0")
    return float(value)


def _dropout(cfg: dict) -> float:
    value = cfg.get("lora_dropout") or 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise AdapterIncompatible("lora_dropout", f"lora_dropout={value!r}", "a number in [0, 1)")
    return float(value)


def _bool(cfg: dict, field: str) -> bool:
    value = cfg.get(field) or False
    if not isinstance(value, bool):
        raise AdapterIncompatible(field, f"{field}={value!r}", "true or false")
    return value


def _names(cfg: dict, field: str, *, allow_regex: bool) -> tuple[str, ...] | str | None:
    value = cfg.get(field)
    if value is None:
        return None
    if isinstance(value, str):
        if allow_regex:
            _check_regex(field, value)
            return value
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise AdapterIncompatible(field, f"{field}={value!r}", "a list of names or a regex string")


def _pattern(cfg: dict, field: str, kind: type) -> dict:
    value = cfg.get(field) or {}
    if not isinstance(value, dict):
        raise AdapterIncompatible(field, f"{field}={value!r}", "an object {pattern: value}")
    out = {}
    for pattern, v in value.items():
        _check_regex(f"{field}[{pattern!r}]", pattern)
        ok = (
            not isinstance(v, bool) and isinstance(v, int if kind is int else int | float) and v > 0
        )
        if not ok:
            what = "an integer >= 1" if kind is int else "a number > 0"
            raise AdapterIncompatible(f"{field}[{pattern!r}]", f"value {v!r}", what)
        out[pattern] = kind(v)
    return out


def _layers(cfg: dict) -> tuple[int, ...] | None:
    value = cfg.get("layers_to_transform")
    if value is None or value == []:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        return tuple(value)
    raise AdapterIncompatible(
        "layers_to_transform",
        f"layers_to_transform={value!r}",
        "null, an integer or a list of integers >= 0",
    )


def _check_regex(field: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise AdapterIncompatible(
            field, f"{pattern!r} is not a valid regex ({e})", "a valid regex"
        ) from e
