import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from lora_core.errors import AdapterLoadFailed
from lora_core.safetensors_header import read_safetensors_header


def _write(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_reads_names_dtypes_shapes(tmp_path: Path) -> None:
    tensors = {
        "a": torch.zeros(3, 5, dtype=torch.float32),
        "b": torch.zeros(7, dtype=torch.bfloat16),
        "c": torch.zeros(2, 0, 4, dtype=torch.float16),
        "d": torch.zeros((), dtype=torch.int64),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    assert read_safetensors_header(tmp_path / "x.safetensors") == {
        "a": ("F32", (3, 5)),
        "b": ("BF16", (7,)),
        "c": ("F16", (2, 0, 4)),
        "d": ("I64", ()),
    }


@pytest.mark.parametrize("keep", [0, 4, 8, 20])
def test_truncated_file_refused(tmp_path: Path, keep: int) -> None:
    save_file({"a": torch.ones(16, 16)}, str(tmp_path / "x.safetensors"))
    raw = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(raw[:keep])
    with pytest.raises(AdapterLoadFailed, match="corrupt safetensors"):
        read_safetensors_header(tmp_path / "x.safetensors")


def test_truncated_data_refused(tmp_path: Path) -> None:
    save_file({"a": torch.ones(16, 16)}, str(tmp_path / "x.safetensors"))
    raw = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(raw[:-1])
    with pytest.raises(AdapterLoadFailed, match="beyond the 1023 data bytes"):
        read_safetensors_header(tmp_path / "x.safetensors")


def test_huge_length_refused(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    with pytest.raises(AdapterLoadFailed, match="header length"):
        read_safetensors_header(tmp_path / "x.safetensors")


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe", b"[1, 2]"])
def test_bad_json_refused(tmp_path: Path, header: bytes) -> None:
    with pytest.raises(AdapterLoadFailed, match="corrupt safetensors"):
        read_safetensors_header(_write(tmp_path / "x.safetensors", header))


@pytest.mark.parametrize(
    "entry, why",
    [
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}, "beyond"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "needs 12"),
        ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}, "unknown dtype"),
        ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "bad shape"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8]}, "bad data_offsets"),
        ([1, 2], "not an object"),
    ],
)
def test_bad_entries_refused(tmp_path: Path, entry: object, why: str) -> None:
    header = json.dumps({"w": entry}).encode()
    with pytest.raises(AdapterLoadFailed, match=why):
        read_safetensors_header(_write(tmp_path / "x.safetensors", header, b"\0" * 8))


def test_missing_file_refused(tmp_path: Path) -> None:
    with pytest.raises(AdapterLoadFailed, match="cannot read"):
        read_safetensors_header(tmp_path / "nope.safetensors")


@pytest.mark.parametrize(
    "entries, data, why",
    [
        ({"a": [0, 8]}, 12, "cover 8 of the 12 data bytes"),
        ({"a": [0, 8], "b": [12, 20]}, 20, "gap at data byte 8"),
        ({"a": [0, 8], "b": [4, 12]}, 12, "overlap at data byte 8"),
        ({"a": [4, 12]}, 12, "gap at data byte 0"),
    ],
)
def test_data_not_tiled_exactly_refused(tmp_path: Path, entries: dict, data: int, why: str):
    """What safetensors' own loader refuses ("incomplete metadata, file not fully
    covered", "invalid offset"), so admission refuses it too."""
    header = json.dumps(
        {n: {"dtype": "F32", "shape": [(e - b) // 4], "data_offsets": [b, e]}
         for n, (b, e) in entries.items()}
    ).encode()  # fmt: skip
    path = _write(tmp_path / "x.safetensors", header, b"\0" * data)
    with pytest.raises(SafetensorError):
        safe_open(str(path), "pt")
    with pytest.raises(AdapterLoadFailed, match=why):
        read_safetensors_header(path)


def test_zero_size_tensors_tile(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2), "e": torch.zeros(0), "z": torch.ones(3)},
              str(tmp_path / "x.safetensors"))  # fmt: skip
    assert set(read_safetensors_header(tmp_path / "x.safetensors")) == {"a", "e", "z"}
