"""An adapter directory's files: where they are, reading them once, and their hash.

A PEFT adapter directory holds adapter_config.json and adapter_model.safetensors; only
local directories are read (no URLs, no hub ids) and pickles are never loaded.
`lora_core.validate` checks what the files hold.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from lora_core.errors import AdapterLoadFailed

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
_PATH_ALLOWED = f"an existing local directory holding {CONFIG_FILE} and {WEIGHTS_FILE}"


def resolve_adapter_dir(path: str | Path) -> Path:
    """The resolved local directory; AdapterLoadFailed for URLs, hub ids, files, missing paths."""
    text = str(path)
    if "://" in text:
        raise AdapterLoadFailed(
            f"path={text!r}: URLs are not loaded here; allowed: {_PATH_ALLOWED}"
        )
    try:
        resolved = Path(text).expanduser().resolve(strict=True)
    except (OSError, RuntimeError) as e:
        raise AdapterLoadFailed(f"path={text!r} does not exist; allowed: {_PATH_ALLOWED}") from e
    if not resolved.is_dir():
        raise AdapterLoadFailed(f"path={text!r} is not a directory; allowed: {_PATH_ALLOWED}")
    return resolved


def require_files(root: Path) -> None:
    """AdapterLoadFailed unless root holds both files (naming a lone pickle as refused)."""
    if not (root / CONFIG_FILE).is_file():
        raise AdapterLoadFailed(f"{root}: {CONFIG_FILE} is missing; allowed: {_PATH_ALLOWED}")
    if not (root / WEIGHTS_FILE).is_file():
        if (root / PICKLE_FILE).exists():
            raise AdapterLoadFailed(
                f"{root}: only {PICKLE_FILE} (pickle) is present; pickles are never loaded, "
                f"safetensors only: allowed: {WEIGHTS_FILE} (save_pretrained(safe_serialization=True))"
            )
        raise AdapterLoadFailed(f"{root}: {WEIGHTS_FILE} is missing; allowed: {_PATH_ALLOWED}")


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter directory's two files, read once: the bytes that were validated are the
    bytes that get loaded, and they are hashed once.

    root: the resolved directory. config / weights: the files' bytes.
    content_hash: sha256 hex of config + weights (as `content_hash`).
    """

    root: Path
    config: bytes
    weights: bytes
    content_hash: str


def read_adapter_files(path: str | Path) -> AdapterFiles:
    """Read and hash both files of an adapter directory; AdapterLoadFailed names a problem."""
    root = resolve_adapter_dir(path)
    require_files(root)
    try:
        config = (root / CONFIG_FILE).read_bytes()
        weights = (root / WEIGHTS_FILE).read_bytes()
    except OSError as e:
        raise AdapterLoadFailed(f"cannot read adapter {root}: {e}") from e
    digest = hashlib.sha256(config)
    digest.update(weights)
    return AdapterFiles(root, config, weights, digest.hexdigest())


def content_hash(path: str | Path) -> str:
    """sha256 hex over adapter_config.json bytes then adapter_model.safetensors bytes."""
    root = resolve_adapter_dir(path)
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            with (root / name).open("rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        except OSError as e:
            raise AdapterLoadFailed(f"cannot read {root / name}: {e}") from e
    return digest.hexdigest()


__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "AdapterFiles",
    "content_hash",
    "read_adapter_files",
    "require_files",
    "resolve_adapter_dir",
]
