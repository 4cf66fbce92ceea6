"""vLLM's include_stop_str_in_output, skip_special_tokens and truncate_prompt_tokens on
REST over a real CPU engine (the handlers, a Frontend and an AsyncEngine, called as the
replica deployment calls it; no Ray): a kept stop string streams as it answers, with
logprobs and n choices; kept special tokens are text and count in text offsets; a
truncated prompt answers, counts and echoes as its kept tokens sent alone; bad values
are 400s naming the field."""

from __future__ import annotations

import asyncio
import json

import pytest

from replica.prompt_truncation import TRUNCATE_ALLOWED
from router import rest
from router.body_parse import parse_body
from router.frontend import Frontend
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.unit.replica.engines import small_engine
from tests.unit.router.served_engine import served_frontend
from tests.unit.router.test_frontend_auth import BASE

PROMPT = "hello world how are you today"
MESSAGES = [{"role": "user", "content": "what is lorafleet"}]
EOS = "<|endoftext|>"  # the demo tokenizer's EOS (id 0), a special token


@pytest.fixture(scope="module")
def served(llama_dir):
    with served_frontend(small_engine(llama_dir)) as front:
        yield front


def post(front: Frontend, kind: str, body: dict):
    """(status, the JSON body or a stream's chunks) of one request."""
    body = {"model": BASE, **body}
    if kind == "completions":
        body.setdefault("prompt", PROMPT)
        handler, model = rest.completions, CompletionRequest
    else:
        body.setdefault("messages", MESSAGES)
        handler, model = rest.chat_completions, ChatCompletionRequest

    async def go():
        response = await handler(front, None, parse_body(model, body))
        if not body.get("stream") or response.status_code != 200:
            return response.status_code, json.loads(response.body)
        raw = b"".join([c async for c in response.body_iterator]).decode()
        datas = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        assert datas[-1] == "[DONE]"
        return 200, [json.loads(d) for d in datas[:-1]]

    return asyncio.run(go())


def choices(kind: str, result) -> dict[int, dict]:
    """index -> (text, finish_reason, logprobs) of a response, a stream's chunks joined."""
    if isinstance(result, dict):
        return {
            c["index"]: {
                "text": c["text"] if kind == "completions" else c["message"]["content"],
                "finish_reason": c["finish_reason"],
                "logprobs": c["logprobs"],
            }
            for c in result["choices"]
        }
    got: dict[int, dict] = {}
    for chunk in result:
        for c in chunk["choices"]:
            whole = got.setdefault(c["index"], {"text": "", "logprobs": None})
            text = c["text"] if kind == "completions" else c["delta"].get("content")
            whole["text"] += text or ""
            whole["finish_reason"] = c["finish_reason"]
            lp = c.get("logprobs")
            if lp is not None:
                if kind == "completions":
                    old = whole["logprobs"] or {k: [] for k in lp}
                    whole["logprobs"] = {k: old[k] + v for k, v in lp.items()}
                else:
                    old = whole["logprobs"] or {"content": []}
                    whole["logprobs"] = {"content": old["content"] + lp["content"]}
    return got


def text_of(kind: str, body: dict) -> str:
    return choices(kind, body)[0]["text"]


def same_answer(a: dict, b: dict) -> bool:
    """Two choices' text, finish reason and tokens are equal, their logprobs equal to
    float precision (a batch of other rows may change the last bits)."""
    la, lb = a.pop("logprobs"), b.pop("logprobs")
    if a != b:
        return False
    if "content" in la:
        la = {"tokens": [t["token"] for t in la["content"]], "lp": la["content"]}
        lb = {"tokens": [t["token"] for t in lb["content"]], "lp": lb["content"]}
        la["lp"] = [t["logprob"] for t in la["lp"]]
        lb["lp"] = [t["logprob"] for t in lb["lp"]]
        return la["tokens"] == lb["tokens"] and la["lp"] == pytest.approx(lb["lp"], abs=1e-5)
    same = la["tokens"] == lb["tokens"] and la["text_offset"] == lb["text_offset"]
    return same and la["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-5)


KINDS = ["completions", "chat"]
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.mark.parametrize("kind", KINDS)
def test_a_kept_stop_string_ends_the_text_streamed_or_not(served, kind):
    status, plain = post(served, kind, GREEDY)
    full = text_of(kind, plain)
    stop = full[3:5]
    end = full.find(stop) + len(stop)
    logprobs = {"logprobs": 1} if kind == "completions" else {"logprobs": True}
    body = {**GREEDY, **logprobs, "stop": [stop], "include_stop_str_in_output": True, "n": 2}
    status, whole = post(served, kind, body)
    assert status == 200
    _, dropped = post(served, kind, {**body, "include_stop_str_in_output": False})
    _, chunks = post(served, kind, {**body, "stream": True})
    got, streamed = choices(kind, whole), choices(kind, chunks)
    if kind == "completions":  # the tokens spelling the kept stop string start in the text
        offsets = got[0]["logprobs"]["text_offset"]
        assert offsets == sorted(offsets) and offsets[-1] < end
    for i in (0, 1):
        assert got[i]["text"] == full[:end] and got[i]["finish_reason"] == "stop"
        assert choices(kind, dropped)[i]["text"] == full[: full.find(stop)]
        assert same_answer(streamed[i], got[i])  # the chunks join to the whole answer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip", [True, False])
def test_kept_special_tokens_are_text_and_count_in_offsets(served, kind, skip):
    logprobs = {"logprobs": 1} if kind == "completions" else {"logprobs": True}
    body = {"max_tokens": 3, "ignore_eos": True, "logit_bias": {"0": 100}, **logprobs}
    body["skip_special_tokens"] = skip
    _, whole = post(served, kind, body)
    _, chunks = post(served, kind, {**body, "stream": True})
    got = choices(kind, whole)[0]
    assert got["text"] == ("" if skip else EOS * 3)
    if kind == "completions":
        assert got["logprobs"]["tokens"] == [EOS] * 3
        assert got["logprobs"]["text_offset"] == ([0, 0, 0] if skip else [0, 13, 26])
    assert same_answer(choices(kind, chunks)[0], got)


@pytest.mark.parametrize("skip", [True, False])
def test_a_token_id_echo_spells_special_tokens_unless_skipped(served, skip):
    tok = served.tokenizer
    ids = [0, *tok("hi there").input_ids]
    body = {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0}
    _, r = post(served, "completions", {**body, "skip_special_tokens": skip})
    (choice,) = r["choices"]
    assert choice["text"] == ("" if skip else EOS) + "hi there"
    assert choice["logprobs"]["text_offset"][:2] == [0, 0 if skip else 13]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_a_truncated_prompt_answers_as_its_last_k_tokens(served, k, stream):
    ids = served.tokenizer(PROMPT).input_ids
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    body = {**GREEDY, "stream": stream, **usage}
    _, alone = post(served, "completions", {**body, "prompt": ids[-k:]})
    _, cut = post(served, "completions", {**body, "truncate_prompt_tokens": k})
    _, whole = post(served, "completions", body)
    assert choices("completions", cut) == choices("completions", alone)
    assert text_of("completions", cut) != text_of("completions", whole)
    last = cut if not stream else cut[-1]
    assert last["usage"]["prompt_tokens"] == k


def test_a_truncated_prompt_echoes_and_scores_the_kept_tokens(served):
    tok = served.tokenizer
    prompts = [PROMPT, "the quick brown fox jumps"]
    body = {"prompt": prompts, "truncate_prompt_tokens": 3, "echo": True, "logprobs": 0}
    body |= {"max_tokens": 0, "prompt_logprobs": 0}
    _, r = post(served, "completions", body)
    assert r["usage"]["prompt_tokens"] == 6
    for choice, prompt in zip(r["choices"], prompts, strict=True):
        kept = tok(prompt).input_ids[-3:]
        assert choice["text"] == tok.backend_tokenizer.decode(kept)
        assert len(choice["logprobs"]["tokens"]) == len(choice["prompt_logprobs"]) == 3
    # a prompt the truncation leaves whole is echoed as sent
    _, r = post(served, "completions", {**body, "prompt": "hi", "truncate_prompt_tokens": 9})
    assert r["choices"][0]["text"] == "hi"


def test_a_truncated_chat_keeps_the_last_tokens_of_its_template(served):
    tok = served.tokenizer
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert len(ids) > 4
    _, chat = post(served, "chat", {**GREEDY, "truncate_prompt_tokens": 4})
    _, alone = post(served, "completions", {**GREEDY, "prompt": ids[-4:]})
    assert chat["usage"]["prompt_tokens"] == 4
    assert text_of("chat", chat) == text_of("completions", alone)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("truncate_prompt_tokens", 0, f"truncate_prompt_tokens=0; {TRUNCATE_ALLOWED}"),
        ("truncate_prompt_tokens", -3, f"truncate_prompt_tokens=-3; {TRUNCATE_ALLOWED}"),
        (
            "truncate_prompt_tokens",
            5000,
            "truncate_prompt_tokens=5000: more than the model's context of 1024 tokens; "
            + TRUNCATE_ALLOWED,
        ),
        (
            "truncate_prompt_tokens",
            "3",
            "truncate_prompt_tokens: got a string; allowed: an integer",
        ),
        (
            "include_stop_str_in_output",
            "yes",
            "include_stop_str_in_output: got a string; allowed: true or false",
        ),
        ("skip_special_tokens", 0, "skip_special_tokens: got a number (0); allowed: true or false"),
    ],
)
def test_bad_values_are_400s_naming_the_field(served, kind, field, value, message):
    from lora_core.errors import InvalidRequest

    try:
        status, r = post(served, kind, {field: value, "stream": True})
    except InvalidRequest as e:  # refused as the body is parsed (the ingress answers 400)
        assert (str(e), e.param) == (message, field)
        return
    assert status == 400
    assert (r["error"]["message"], r["error"]["param"]) == (message, field)
