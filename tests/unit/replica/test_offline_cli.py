"""`lorafleet generate` as users run it: a real subprocess, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_success_writes_rows_in_order_with_progress(tmp_path, llama_dir, llama_adapters):
    rows = [
        {
            "prompt": f"hello world {i}",
            "adapter": ["qv8", None][i % 2],
            "max_tokens": 3 + i % 3,
            "id": i,
        }
        for i in range(6)
    ]
    inp, out = _write(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    res = _cli(
        "generate",
        "--model",
        str(llama_dir),
        "--adapter",
        f"qv8={llama_adapters['qv8']}",
        "--input",
        str(inp),
        "--output",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == list(range(6))
    for r, g in zip(rows, got, strict=True):
        assert {k: g[k] for k in r} == r
        assert g["finish_reason"] in ("stop", "length") and isinstance(g["text"], str)
        assert 1 <= len(g["token_ids"]) <= r["max_tokens"]
    assert "generate" in res.stderr and "6/6" in res.stderr  # the progress bar


def _one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 1
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_unknown_adapter_name(tmp_path, llama_dir, llama_adapters):
    inp = _write(tmp_path / "in.jsonl", [{"prompt": "hi", "adapter": "nope"}])
    res = _cli(
        "generate",
        "--model",
        str(llama_dir),
        "--adapter",
        f"qv8={llama_adapters['qv8']}",
        "--input",
        str(inp),
        "--output",
        str(tmp_path / "o"),
    )
    _one_line_error(res, "adapter 'nope' not found")


def test_invalid_adapter_and_unreadable_model(tmp_path, llama_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{}")
    inp = _write(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    res = _cli(
        "generate",
        "--model",
        str(llama_dir),
        "--adapter",
        f"bad={bad}",
        "--input",
        str(inp),
        "--output",
        str(tmp_path / "o"),
    )
    _one_line_error(res, "lorafleet generate:")
    res = _cli(
        "generate",
        "--model",
        str(tmp_path / "missing"),
        "--input",
        str(inp),
        "--output",
        str(tmp_path / "o"),
    )
    _one_line_error(res, "missing")


def test_usage_error_exits_2(tmp_path):
    assert _cli("generate", "--input", "x").returncode == 2
