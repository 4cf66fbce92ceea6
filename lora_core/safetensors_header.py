"""Read a `.safetensors` header in pure Python (torch-free, so `cluster` can validate adapters).

File layout: 8-byte little-endian header length n, then n bytes of JSON
`{name: {"dtype": "F32", "shape": [r, h], "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the tensor bytes; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lora_core.errors import AdapterLoadFailed

DTYPE_BYTES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
# The safetensors format itself refuses headers above 100 MB.
MAX_HEADER_BYTES = 100_000_000

TensorInfo = tuple[str, tuple[int, ...]]


def _header_of(
    path: Path, size: int, prefix: bytes, read: Callable[[int], bytes]
) -> tuple[int, bytes]:
    """(header length, header bytes) of a size-byte file starting with prefix (its first
    8 bytes); read(n) returns the n bytes after them."""
    if len(prefix) < 8:
        raise _corrupt(path, f"file is {size} bytes, shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", prefix)
    if length < 2 or length > MAX_HEADER_BYTES or 8 + length > size:
        raise _corrupt(path, f"header length {length} does not fit a {size}-byte file")
    return length, read(length)


def read_safetensors_header(path: str | Path, data: bytes | None = None) -> dict[str, TensorInfo]:
    """{tensor_name: (dtype_str, shape)} of a safetensors file; AdapterLoadFailed if corrupt.

    data: the file's bytes when already read (path then only names it in messages).
    """
    path = Path(path)
    try:
        if data is not None:
            size = len(data)
            length, raw = _header_of(path, size, data[:8], lambda n: data[8 : 8 + n])
        else:
            size = path.stat().st_size
            with path.open("rb") as f:  # the read after the prefix continues at byte 8
                length, raw = _header_of(path, size, f.read(8), f.read)
    except OSError as e:
        raise AdapterLoadFailed(f"cannot read {path}: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, f"header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    data_bytes = size - 8 - length
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    infos = {name: _tensor_info(path, name, entry, data_bytes) for name, entry in tensors.items()}
    _check_tiling(path, [entry["data_offsets"] for entry in tensors.values()], data_bytes)
    return infos


def _check_tiling(path: Path, offsets: list[list[int]], data_bytes: int) -> None:
    """The tensors must tile the data bytes exactly, in offset order: safetensors' loader
    (what replicas load with) refuses a gap, an overlap or trailing bytes, so a file that
    passed here without this check was registered and then failed every load.
    Example: [0, 8], [8, 20] tile 20 data bytes; [0, 8], [12, 20] leave a gap at 8."""
    end = 0
    for begin, stop in sorted(offsets):
        if begin != end:
            what = "gap" if begin > end else "overlap"
            raise _corrupt(path, f"tensor data has a {what} at data byte {end}")
        end = stop
    if end != data_bytes:
        raise _corrupt(path, f"tensors cover {end} of the {data_bytes} data bytes (trailing bytes)")


# Float formats: (unsigned view of one element, mask of its exponent bits). A value is
# NaN or +-inf exactly when every exponent bit is set.
_EXPONENT_MASKS: dict[str, tuple[type, int]] = {
    "F64": (np.uint64, 0x7FF0_0000_0000_0000),
    "F32": (np.uint32, 0x7F80_0000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
    "F8_E5M2": (np.uint8, 0x7C),
    # float8_e4m3fn has no infinities; its only NaNs are S.1111.111, so the mask covers
    # the mantissa too (0x7E, S.1111.110, is 448, the largest finite value).
    "F8_E4M3": (np.uint8, 0x7F),
}


def first_nonfinite(path: str | Path, data: bytes | None = None) -> str | None:
    """The name of the first float tensor (in file order) holding a NaN or an infinity,
    or None. Scans `data` (the file's bytes) when given, else the file through a memory
    map; call after read_safetensors_header has accepted the file."""
    path = Path(path)
    if data is None:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length).decode("utf-8"))
        if path.stat().st_size == 8 + length:
            return None
        body = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
    else:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length].decode("utf-8"))
        if len(data) == 8 + length:
            return None
        body = np.frombuffer(data, dtype=np.uint8, offset=8 + length)
    entries = sorted(
        (e["data_offsets"], name, e["dtype"])
        for name, e in header.items()
        if name != "__metadata__"
    )
    for (begin, end), name, dtype in entries:
        if dtype not in _EXPONENT_MASKS or begin == end:
            continue
        view, mask = _EXPONENT_MASKS[dtype]
        bits = body[begin:end].view(view)
        if np.any(bits & view(mask) == view(mask)):
            return name
    return None


def _tensor_info(path: Path, name: str, entry: object, data_bytes: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _corrupt(path, f"entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise _corrupt(path, f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _corrupt(path, f"tensor {name!r} has a bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
    ):
        raise _corrupt(path, f"tensor {name!r} has bad data_offsets {offsets!r}")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= begin <= end <= data_bytes:
        raise _corrupt(
            path, f"tensor {name!r} data_offsets {offsets} lie beyond the {data_bytes} data bytes"
        )
    if end - begin != numel * DTYPE_BYTES[dtype]:
        need = numel * DTYPE_BYTES[dtype]
        raise _corrupt(
            path, f"tensor {name!r} holds {end - begin} bytes; {dtype} {shape} needs {need}"
        )
    return dtype, tuple(shape)


def _corrupt(path: Path, why: str) -> AdapterLoadFailed:
    return AdapterLoadFailed(f"{path}: corrupt safetensors file: {why}")
