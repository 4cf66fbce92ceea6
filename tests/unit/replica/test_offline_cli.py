"""`lorafleet generate` as users run it: a real subprocess, exit codes, one-line errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploy.cli import build_parser
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.offline import adapter_ref
from replica.offline_cli import ASKING_FIELDS, NULL_IS_DEFAULT
from replica.sampling_params import SamplingParams
from replica.structured_spec import FREE_WHITESPACE, StructuredOutput
from tests.tiny import run_requests

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


def _generate(tmp_path: Path, model: Path, adapter: Path, rows: list[dict], *extra: str):
    inp = tmp_path / "in.jsonl"
    text = "".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows)
    inp.write_bytes(text.encode("utf-8", "surrogateescape"))  # "\udcff": a raw 0xff byte
    out = tmp_path / "out.jsonl"
    res = _cli(
        "generate", "--model", str(model), "--adapter", f"qv8={adapter}", "--device", "cpu",
        "--input", str(inp), "--output", str(out), "--quiet", *extra,
    )  # fmt: skip
    return res, out


MIXED = [
    {"prompt": "hello world", "adapter": "qv8", "max_tokens": 4, "logprobs": True, "top_logprobs": 3},
    {"prompt": "the cat sat", "max_tokens": 3},
    {"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": True, "id": "ids"},
    {"prompt": "hello world", "adapter": "qv8", "max_tokens": 4, "logprobs": False},
    {"prompt": [9], "adapter": "qv8", "max_tokens": 2, "logprobs": True, "top_logprobs": 20},
]  # fmt: skip


def _engine_reference(llama_dir: Path, adapter: Path, rows: list[dict]) -> dict[str, dict]:
    """The same requests, in the same order, straight through an LLMEngine (greedy)."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu"))
    ref = adapter_ref("qv8", adapter, max_rank=64)
    for i, r in enumerate(rows):
        ids = (
            r["prompt"]
            if isinstance(r["prompt"], list)
            else engine.tokenizer(r["prompt"]).input_ids
        )
        params = SamplingParams(
            max_tokens=r["max_tokens"],
            temperature=0.0,
            logprobs=r.get("logprobs", False),
            top_logprobs=r.get("top_logprobs", 0),
        )
        engine.add_request(str(i), ids, params, ref if r.get("adapter") else None)
    got = {str(i): {"token_ids": [], "logprobs": [], "top": []} for i in range(len(rows))}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id]["token_ids"] += o.new_token_ids
            got[o.request_id]["logprobs"] += o.new_logprobs
            got[o.request_id]["top"] += [
                [
                    {"token_id": t, "token": engine.tokenizer.decode([t]), "logprob": lp}
                    for t, lp in pos
                ]
                for pos in o.new_top_logprobs
            ]
    return got


def test_logprobs_and_top_logprobs_equal_the_engine(tmp_path, llama_dir, llama_adapters):
    res, out = _generate(tmp_path, llama_dir, llama_adapters["qv8"], MIXED)
    assert res.returncode == 0, res.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    want = _engine_reference(llama_dir, llama_adapters["qv8"], MIXED)
    for i, (row, g) in enumerate(zip(MIXED, got, strict=True)):
        w = want[str(i)]
        echoed = {k: v for k, v in row.items() if k not in ("logprobs", "top_logprobs")}
        assert {k: g[k] for k in echoed} == echoed
        assert g["token_ids"] == w["token_ids"] and len(w["token_ids"]) == row["max_tokens"]
        if row.get("logprobs"):
            assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-5)
            assert len(g["logprobs"]) == row["max_tokens"]
        else:
            assert "logprobs" not in g
        k = row.get("top_logprobs", 0)
        if k:
            assert [len(pos) for pos in g["top_logprobs"]] == [k] * row["max_tokens"]
            assert [[e["token_id"] for e in pos] for pos in g["top_logprobs"]] == [
                [e["token_id"] for e in pos] for pos in w["top"]
            ]
            assert [[e["token"] for e in pos] for pos in g["top_logprobs"]] == [
                [e["token"] for e in pos] for pos in w["top"]
            ]
            flat = [e["logprob"] for pos in g["top_logprobs"] for e in pos]
            assert flat == pytest.approx([e["logprob"] for pos in w["top"] for e in pos], abs=1e-5)
            # greedy: the sampled token is the most likely one
            assert [pos[0]["token_id"] for pos in g["top_logprobs"]] == g["token_ids"]
        else:
            assert "top_logprobs" not in g


def test_null_sampling_fields_mean_their_defaults(tmp_path, llama_dir, llama_adapters):
    """As in a REST body, `"temperature": null` is "not given": every sampling field null
    answers like the line without them (the flags' defaults: greedy, --max-tokens)."""
    plain = {"prompt": "hello world", "adapter": "qv8"}
    nulls = {**plain, **dict.fromkeys(NULL_IS_DEFAULT)}
    res, out = _generate(
        tmp_path, llama_dir, llama_adapters["qv8"], [plain, nulls], "--max-tokens", "5"
    )
    assert res.returncode == 0, res.stderr
    a, b = (json.loads(line) for line in out.read_text().splitlines())
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 5
    assert {k: b[k] for k in nulls if k not in ASKING_FIELDS} == {
        k: v for k, v in nulls.items() if k not in ASKING_FIELDS
    }


def test_min_p_and_allowed_token_ids_lines_equal_the_engine(tmp_path, llama_dir, llama_adapters):
    rows = [
        {"prompt": "hello world", "adapter": "qv8", "max_tokens": 5, "allowed_token_ids": [7, 9, 30]},
        {"prompt": "the cat sat", "max_tokens": 5, "temperature": 1.0, "seed": 3, "min_p": 0.3},
    ]  # fmt: skip
    res, out = _generate(tmp_path, llama_dir, llama_adapters["qv8"], rows)
    assert res.returncode == 0, res.stderr
    got = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    engine = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu"))
    ref = adapter_ref("qv8", llama_adapters["qv8"], max_rank=64)
    params = [
        SamplingParams(max_tokens=5, temperature=0.0, allowed_token_ids=(7, 9, 30)),
        SamplingParams(max_tokens=5, temperature=1.0, seed=3, min_p=0.3),
    ]
    want = run_requests(engine, [("0", rows[0]["prompt"], params[0], ref),
                                 ("1", rows[1]["prompt"], params[1], None)])  # fmt: skip
    assert got == [want["0"], want["1"]] and set(got[0]) <= {7, 9, 30}


def test_structured_outputs_lines_take_free_whitespace(tmp_path, llama_dir, llama_adapters):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    rows = [
        {"prompt": "the cat sat", "max_tokens": 12,
         "structured_outputs": {"json": schema, "disable_any_whitespace": False}},
        {"prompt": "the cat sat", "max_tokens": 12, "structured_outputs": {"json": schema}},
    ]  # fmt: skip
    res, out = _generate(tmp_path, llama_dir, llama_adapters["qv8"], rows)
    assert res.returncode == 0, res.stderr
    got = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    engine = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu"))
    text = json.dumps(schema)
    specs = [StructuredOutput("json", text, FREE_WHITESPACE), StructuredOutput("json", text)]
    want = run_requests(engine, [
        (str(i), "the cat sat", SamplingParams(max_tokens=12, temperature=0.0,
                                               structured_outputs=spec), None)
        for i, spec in enumerate(specs)
    ])  # fmt: skip
    assert got == [want["0"], want["1"]] and got[0] != got[1]


OK = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    "rows,message",
    [
        ([{"prompt": "a", "temperature": "0.5"}],
         "line 1: temperature='0.5'; allowed: a number 0 <= temperature <= 2"),
        ([OK, {"prompt": "a", "max_tokens": True}], "line 2: max_tokens=True; allowed: an integer >= 1"),
        ([OK, {"prompt": "a", "max_tokens": "3"}], "line 2: max_tokens='3'; allowed: an integer >= 1"),
        ([{"prompt": "a", "seed": 1.5}], "line 1: seed=1.5; allowed: null or an integer"),
        ([{"prompt": "a", "logprobs": 1}], "line 1: logprobs=1; allowed: true or false"),
        ([{"prompt": "a", "logprobs": True, "top_logprobs": "2"}],
         "line 1: top_logprobs='2'; allowed: an integer 0 <= top_logprobs <= 20 (needs logprobs)"),
        ([{"prompt": "a", "logprobs": True, "top_logprobs": 21}],
         "line 1: top_logprobs=21; allowed: an integer 0 <= top_logprobs <= 20"),
        ([{"prompt": "a", "top_logprobs": 2}], "line 1: top_logprobs=2 needs logprobs"),
        ([{"prompt": [5, True]}], "line 1: prompt=[5, True]; allowed: a string or a list of token ids"),
        ([{"prompt": 5}], "line 1: prompt=5; allowed: a string or a list of token ids"),
        ([OK, "\n", {"prompt": "a", "adapter": "nope"}],
         "line 3: adapter 'nope' not found; allowed: null or one of qv8"),
        ([OK, {"prompt": ""}], "line 2: prompt is empty; allowed: at least one token"),
        ([{"prompt": [5, 99999]}], "line 1: prompt: token id 99999 out of range; allowed: 0 <= id < "),
        ([{"prompt": "a", "max_tokens": 100000}], "line 1: prompt (1 tokens) + max_tokens (100000)"),
        (["not json\n"], "line 1: not JSON"),
        ([OK, '{"prompt": "a", "seed": ' + "1" * 5000 + "}\n"],
         "line 2: a number of more than 4300 digits; allowed: numbers of at most 4300 digits"),
        ([OK, '{"prompt": "\udcff"}\n'], "line 2: not UTF-8 (byte 13 of the line)"),
        ([OK, '{"prompt": ' + "[" * 100000 + "]" * 100000 + "}\n"], "line 2: JSON nested too deeply"),
        ([{"prompt": [5] * 100000 + [True]}],
         "line 1: prompt=[5, 5, 5, 5, 5, 5, 5, 5, ...]; allowed: a string or a list of token ids"),
        ([{"text": "a"}], 'line 1: each line must be an object with a "prompt"'),
        ([{"prompt": "a", "presence_penalty": "1"}],
         "line 1: presence_penalty='1'; allowed: a number -2 <= presence_penalty <= 2 (0 = off)"),
        ([OK, {"prompt": "a", "repetition_penalty": 0}],
         "line 2: repetition_penalty=0; allowed: a number 0 < repetition_penalty <= 2 (1 = off)"),
        ([{"prompt": "a", "logit_bias": {"x1": 5}}],
         "line 1: logit_bias: key 'x1' is no token id; allowed: keys that are token ids written"),
        ([{"prompt": "a", "logit_bias": {"99999": 5}}],
         "line 1: logit_bias: token id 99999 out of range; allowed: token ids 0 <= id < "),
        ([{"prompt": "a", "logit_bias": {"5": "1"}}],
         "line 1: logit_bias={'5': '1'}; allowed: an object of token ids as decimal strings"),
        ([{"prompt": "a", "logit_bias": {"1" * 5000: 5}}],
         "line 1: logit_bias: key '11111111111111111111...' (5000 digits) is no token id"),
        ([{"prompt": "a", "top_k": -2}], "line 1: top_k=-2; allowed: an integer >= 0 (0 = off), or -1"),
        ([{"prompt": "a", "min_p": 1.5}], "line 1: min_p=1.5; allowed: a number 0 <= min_p <= 1 (0 = off)"),
        ([{"prompt": "a", "allowed_token_ids": []}],
         "line 1: allowed_token_ids: an empty list allows no token; allowed: null (off) or"),
        ([{"prompt": "a", "allowed_token_ids": [5, 99999]}],
         "line 1: allowed_token_ids: token id 99999 out of range; allowed: token ids 0 <= id < "),
        ([{"prompt": "a", "allowed_token_ids": "5"}],
         "line 1: allowed_token_ids='5'; allowed: a non-empty list of token ids"),
        ([{"prompt": None}], "line 1: prompt=None; allowed: a string or a list of token ids"),
        ([{"prompt": "a", "logit_bias": {"x" * 5000: 5}}],
         "line 1: logit_bias: key 'xxxxxxxxxxxxxxxxxxxx...' (5000 characters) is no token id"),
        ([{"prompt": "a", "truncate_prompt_tokens": 0}],
         "line 1: truncate_prompt_tokens=0; allowed: null (off), an integer k >= 1"),
        ([{"prompt": "a", "skip_special_tokens": 1}],
         "line 1: skip_special_tokens=1; allowed: true or false"),
        ([{"prompt": "a", "structured_outputs": {"choice": ["x"], "disable_any_whitespace": False}}],
         "line 1: structured_outputs.disable_any_whitespace: false applies to json and json_object only"),
    ],
)  # fmt: skip
def test_bad_line_exits_1_naming_the_line(tmp_path, llama_dir, llama_adapters, rows, message):
    res, out = _generate(tmp_path, llama_dir, llama_adapters["qv8"], rows)
    _one_line_error(res, "lorafleet generate: " + message)
    assert "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_unwritable_output_fails_before_running(tmp_path, llama_dir, llama_adapters):
    (tmp_path / "adir").mkdir()
    for output, message in (
        ("/nonexist/dir/o.jsonl", "--output /nonexist/dir/o.jsonl: directory /nonexist/dir does not exist"),
        (str(tmp_path / "adir"), f"--output {tmp_path / 'adir'} is a directory; allowed: a file path"),
    ):  # fmt: skip
        res, _ = _generate(tmp_path, llama_dir, llama_adapters["qv8"], [OK], "--output", output)
        _one_line_error(res, "lorafleet generate: " + message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "in.jsonl"]
    assert list((tmp_path / "adir").iterdir()) == []


def test_generate_help_gives_every_option_help_and_default():
    sub = build_parser()._subparsers._group_actions[0].choices["generate"]
    for action in sub._actions:
        assert action.help, action.dest
        if action.default not in (None, False, [], argparse.SUPPRESS) and action.dest != "help":
            assert "(default %(default)s)" in action.help, action.dest
    assert "default None" not in sub.format_help()  # --seed's default reads "unseeded"


def test_prompt_logprobs_equal_hf_peft(tmp_path, llama_dir, llama_adapters):
    """`prompt_logprobs` k: one entry per prompt token, the first null, equal to an HF +
    PEFT forward's log_softmax; with max_tokens 0 nothing is generated."""
    from tests.hf_reference import hf_logp

    rows = [
        {"prompt": "hello world again", "adapter": "qv8", "max_tokens": 0, "prompt_logprobs": 2},
        {"prompt": [5, 6, 7, 8], "max_tokens": 2, "prompt_logprobs": 0, "logprobs": True},
    ]
    res, out = _generate(tmp_path, llama_dir, llama_adapters["qv8"], rows)
    assert res.returncode == 0, res.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(llama_dir))(rows[0]["prompt"]).input_ids
    for g, prompt, adapter, k in [
        (got[0], ids, llama_adapters["qv8"], 2),
        (got[1], rows[1]["prompt"], None, 0),
    ]:
        logp = hf_logp(llama_dir, adapter, prompt)[:-1]
        want = logp[torch.arange(len(prompt) - 1), prompt[1:]].tolist()
        assert g["prompt_logprobs"][0] is None
        assert g["prompt_logprobs"][1:] == pytest.approx(want, abs=1e-4)
        if k:
            assert g["prompt_top_logprobs"][0] is None
            top_ids = [[e["token_id"] for e in pos] for pos in g["prompt_top_logprobs"][1:]]
            assert top_ids == logp.topk(k, dim=-1).indices.tolist()
        else:
            assert "prompt_top_logprobs" not in g
    assert (got[0]["token_ids"], got[0]["finish_reason"]) == ([], "length")
    assert len(got[1]["token_ids"]) == 2 and len(got[1]["logprobs"]) == 2


def test_an_output_that_cannot_be_created_fails_before_running(tmp_path, llama_dir, llama_adapters):
    """/proc passes the writable check for root, yet no file can be made there: the run
    fails at once naming --output (before, after generating everything, with a raw
    errno message about a temporary file)."""
    import os

    if os.geteuid() != 0 or not os.access("/proc", os.W_OK):
        pytest.skip("needs a directory that os.access calls writable but refuses files")
    res, _ = _generate(
        tmp_path, llama_dir, llama_adapters["qv8"], [OK], "--output", "/proc/o.jsonl"
    )
    _one_line_error(
        res, "lorafleet generate: --output /proc/o.jsonl: cannot create a file beside it"
    )


def test_truncation_and_kept_special_tokens_and_stops(tmp_path, llama_dir, llama_adapters):
    """vLLM's truncate_prompt_tokens (the line answers as its prompt's last k tokens),
    skip_special_tokens and include_stop_str_in_output on input lines."""
    prompt = "hello world how are you today"
    ids = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu")).tokenizer(prompt).input_ids
    eos = {"logit_bias": {"0": 100}, "skip_special_tokens": False}
    rows = [
        {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "truncate_prompt_tokens": 2},
        {"prompt": ids[-2:], "max_tokens": 4, "ignore_eos": True},
        {"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True, **eos},
        {"prompt": [5, 6], "max_tokens": 2, "include_stop_str_in_output": True, **eos},
        {"prompt": [5, 6], "max_tokens": 2, **eos},
    ]
    res, out = _generate(tmp_path, llama_dir, llama_adapters["qv8"], rows)
    assert res.returncode == 0, res.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert got[0]["token_ids"] == got[1]["token_ids"] and got[0]["text"] == got[1]["text"]
    assert [(g["text"], g["finish_reason"]) for g in got[2:]] == [
        ("<|endoftext|>" * 2, "length"),
        ("<|endoftext|>", "stop"),
        ("", "stop"),
    ]


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ((), {"kernel_warmup": True, "dense_prompt_min": 1024, "enable_prefix_caching": True}),
        (("--no-kernel-warmup", "--dense-prompt-min", "0", "--no-prefix-caching"),
         {"kernel_warmup": False, "dense_prompt_min": 0, "enable_prefix_caching": False}),
    ],
)  # fmt: skip
def test_engine_flags_reach_the_engine_config(monkeypatch, llama_dir, flags, want):
    """The engine settings `generate` takes land in the EngineConfig it builds (the engine
    itself replaced: only the config is under test)."""
    from replica import offline

    built = []

    def engine(config):
        built.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(offline, "LLMEngine", engine)
    args = build_parser().parse_args(
        ["generate", "--model", str(llama_dir), "--input", "in", "--output", "out", *flags]
    )
    with pytest.raises(SystemExit):
        offline.OfflineJob.from_args(args, {})
    assert {k: getattr(built[0], k) for k in want} == want
