"""A reasoning model's chat with a structured output (a JSON schema, a forced tool call)
thinks first, as in vLLM: over a real CPU engine with a tiny model whose "</think>" is one
token, the thinking is free and the answer after "</think>" is held to the grammar, equal
to HF's greedy output under a processor written in the tests (free until "</think>", then
an xgrammar matcher's mask); REST whole, REST streamed and gRPC streamed agree. A prompt
that closed the thinking (Qwen 3's enable_thinking false) is held from its first token; a
model that never closes its thinking ends at max_tokens with no answer."""

from __future__ import annotations

import json

import pytest
import torch

from replica.sampling_params import SamplingParams
from replica.structured_spec import StructuredOutput
from router.chat_reader import joined
from router.proto import lorafleet_pb2 as pb
from router.tools import plan_of
from tests.hf_reference import hf_greedy, hf_model
from tests.unit.replica.engines import small_engine
from tests.unit.replica.test_structured_after_vs_hf import AfterMarker, after_marker
from tests.unit.replica.test_structured_vs_hf import SCHEMA
from tests.unit.router.served_engine import served_frontend
from tests.unit.router.test_frontend_auth import BASE
from tests.unit.router.test_grpc_tools import generate, grpc_deltas, ids_masked, rest_deltas
from tests.unit.router.test_rest_text_options import post
from tests.unit.router.test_rest_tools import CITY, MESSAGES, NAMED

MAX_NEW = 40
FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}
CASES = {  # the body's structured output -> the grammar and the reader's finish reason
    "schema": ({"response_format": FORMAT}, StructuredOutput("json", json.dumps(SCHEMA)), "stop"),
    "named": ({"tools": [CITY], "tool_choice": NAMED}, plan_of([CITY], NAMED, None).grammar(),
              "stop"),
}  # fmt: skip


@pytest.fixture(scope="module")
def engine(think_dir):
    return small_engine(think_dir)


@pytest.fixture(scope="module")
def think_end(engine) -> int:
    [token] = engine.tokenizer.encode("</think>", add_special_tokens=False)
    return token


def prompt_of(engine, fields: dict) -> list[int]:
    """The rendered chat of MESSAGES, with the body's tools."""
    tools = plan_of(fields.get("tools"), fields.get("tool_choice"), None).template_tools()
    return engine.tokenizer.apply_chat_template(
        MESSAGES, tools=tools, add_generation_prompt=True, return_dict=False
    )


def bias_for(think_dir, prompt: list[int], think_end: int) -> float:
    """A logit bias on </think> under which greedy writes at least 2 free tokens, then
    </think>: between the smallest margin (top logit - </think>'s) of the steps before and
    the margin of the first step whose margin is smaller (HF's float32 logits)."""
    model, ids, margins = hf_model(think_dir), list(prompt), []
    with torch.no_grad():
        for _ in range(10):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            margins.append(float(logits.max() - logits[think_end]))
            ids.append(int(logits.argmax()))
    for k in range(2, len(margins)):
        if margins[k] < min(margins[:k]) - 0.05:
            return (margins[k] + min(margins[:k])) / 2
    raise AssertionError(f"no step to close the thinking at: margins {margins}")


class Bias:
    def __init__(self, token: int, bias: float):
        self.token, self.bias = token, bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.token] += self.bias
        return scores


def hf_split(engine, think_dir, prompt, grammar: StructuredOutput, think_end, bias):
    """(thinking, answer) of HF's greedy output under the bias, free until </think> and
    held to grammar after it (EOS dropped)."""
    mask = AfterMarker(engine.tokenizer, engine.vocab_size, engine.eos_ids, grammar.grammar(),
                       len(prompt), [think_end])  # fmt: skip
    ids = hf_greedy(think_dir, None, prompt, max_new_tokens=MAX_NEW,
                    logits_processor=[Bias(think_end, bias), mask],
                    eos_token_id=sorted(engine.eos_ids))  # fmt: skip
    k = after_marker(ids, [think_end])
    assert k is not None and k >= 3 and ids[-1] in engine.eos_ids, ids
    return engine.tokenizer.decode(ids[: k - 1]), engine.tokenizer.decode(ids[k:-1])


def grpc_request(fields: dict, bias: dict[int, float]) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        model=BASE,
        messages=[pb.ChatTurn(role=m["role"], content=m["content"]) for m in MESSAGES],
        max_tokens=MAX_NEW,
        temperature=0.0,
        logit_bias=bias,
    )
    if "tools" in fields:
        req.tools_json, req.tool_choice = json.dumps(fields["tools"]), json.dumps(NAMED)
    else:
        req.structured_json_schema = json.dumps(SCHEMA)
    return req


@pytest.mark.parametrize("case", CASES)
def test_the_answer_is_held_after_the_thinking(engine, think_dir, think_end, case):
    fields, grammar, finish = CASES[case]
    prompt = prompt_of(engine, fields)
    bias = bias_for(think_dir, prompt, think_end)
    thinking, answer = hf_split(engine, think_dir, prompt, grammar, think_end, bias)
    body = {**fields, "messages": MESSAGES, "temperature": 0, "max_tokens": MAX_NEW,
            "logit_bias": {str(think_end): bias}}  # fmt: skip
    with served_frontend(engine, reasoning_parser="deepseek_r1") as front:
        status, whole = post(front, "chat", body)
        _, stream = post(front, "chat", {**body, "stream": True})
        grpc = grpc_deltas(generate(front, grpc_request(fields, {think_end: bias})))
    assert status == 200
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == thinking and thinking
    if case == "named":
        [call] = message["tool_calls"]
        assert call["function"]["arguments"] == answer and message["content"] is None
        assert json.loads(answer)["city"] in ("oslo", "lima")
    else:
        assert message["content"] == answer and set(json.loads(answer)) == {"color", "n"}
    assert whole["choices"][0]["finish_reason"] == finish
    streamed = rest_deltas(stream)
    joined_stream = joined([d for d, _ in streamed])
    for part in ("reasoning_content", "content"):
        assert joined_stream.get(part) == message.get(part)
    if case == "named":
        got = [c["function"]["arguments"] for c in joined_stream["tool_calls"]]
        assert got == [answer]
    assert streamed[-1][1] == finish
    assert ids_masked(grpc)[0] == ids_masked(streamed)[0]  # each call has an id of its own


def test_a_prompt_that_closed_the_thinking_is_held_from_the_first_token(
    engine, think_dir, think_end
):
    grammar = CASES["schema"][1]
    closed = engine.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_dict=False, enable_thinking=False
    )
    want = hf_greedy(think_dir, None, closed, max_new_tokens=MAX_NEW,
                     logits_processor=[AfterMarker(engine.tokenizer, engine.vocab_size,
                                                   engine.eos_ids, grammar.grammar(), len(closed), [])],
                     eos_token_id=sorted(engine.eos_ids))  # fmt: skip
    body = {"response_format": FORMAT, "messages": MESSAGES, "temperature": 0,
            "max_tokens": MAX_NEW, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    with served_frontend(engine, reasoning_parser="qwen3") as front:
        status, whole = post(front, "chat", body)
    assert status == 200 and want[-1] in engine.eos_ids
    message = whole["choices"][0]["message"]
    assert message["content"] == engine.tokenizer.decode(want[:-1])
    assert "reasoning_content" not in message and whole["choices"][0]["finish_reason"] == "stop"


def test_a_model_that_never_closes_its_thinking_never_answers(engine):
    body = {"response_format": FORMAT, "messages": MESSAGES, "temperature": 0, "max_tokens": 12}
    with served_frontend(engine, reasoning_parser="deepseek_r1") as front:
        status, whole = post(front, "chat", body)
        _, stream = post(front, "chat", {**body, "stream": True})
    assert status == 200
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"]  # free text, not JSON: all thinking
    streamed = rest_deltas(stream)
    assert (
        joined([d for d, _ in streamed])["reasoning_content"]
        == (choice["message"]["reasoning_content"])
    )
    assert streamed[-1][1] == "length"


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_thinking_first_sets_the_grammar_after_think_end(engine, think_end, parser):
    spec = CASES["schema"][1]
    tok = engine.tokenizer
    opened = tuple(tok.encode("<|user|>hi<|end|><|assistant|><think>\n"))
    plain = tuple(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False))
    closed = tuple(tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                           return_dict=False, enable_thinking=False))  # fmt: skip
    with served_frontend(engine, reasoning_parser=parser) as front:
        after = SamplingParams(max_tokens=4, structured_outputs=spec)
        got = {
            name: front.thinking_first(ids, after).structured_after
            for name, ids in [("opened", opened), ("plain", plain), ("closed", closed)]
        }
        free = front.thinking_first(plain, SamplingParams(max_tokens=4))
    assert got == {"opened": (think_end,), "plain": (think_end,), "closed": ()}
    assert free.structured_after == ()
    with served_frontend(engine) as front:  # no reasoning parser: from the first token
        assert front.thinking_first(plain, after).structured_after == ()


class DecodeCounter:
    """The frontend's tokenizer copy, counting its decode calls."""

    def __init__(self, inner):
        self.inner, self.decodes = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self.inner.decode(*args, **kwargs)


def test_thinking_first_reads_the_prompt_ids_without_decoding_them(engine):
    """REST and gRPC chats with a structured output, thinking closed or not: whether the
    prompt closed the thinking is read off its ids, never by decoding the prompt again."""
    body = {"response_format": FORMAT, "messages": MESSAGES, "temperature": 0, "max_tokens": 4}
    with served_frontend(engine, reasoning_parser="qwen3") as front:
        front._encoder = DecodeCounter(front._encoder)
        for kwargs in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
            assert post(front, "chat", {**body, **kwargs})[0] == 200
        for kwargs in ("", '{"enable_thinking": false}'):
            req = grpc_request({}, {})
            req.max_tokens, req.chat_template_kwargs_json = 4, kwargs
            assert generate(front, req)[-1].finish_reason
        assert front._encoder.decodes == 0
