"""A structural tag over a real CPU engine behind the REST handlers and an in-process gRPC
server (no Ray): REST whole, REST streamed and gRPC give the engine's own constrained
output (itself equal to HF's: tests/unit/replica/test_structural_tag_vs_hf.py) for the
same tag in either form; a bad tag ends the gRPC call INVALID_ARGUMENT naming the part at
fault; a reasoning model's structural tag starts after "</think>", as every spec does."""

from __future__ import annotations

import json

import grpc
import pytest

from replica.sampling_params import SamplingParams
from replica.structured_forms import spec_from_json
from router.proto import lorafleet_pb2 as pb
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine
from tests.unit.replica.test_structural_tag_vs_hf import structures_of
from tests.unit.router.served_engine import served_frontend
from tests.unit.router.test_frontend_auth import BASE
from tests.unit.router.test_grpc_tools import generate
from tests.unit.router.test_rest_text_options import post
from tests.unit.router.test_rest_tools import MESSAGES
from tests.unit.router.test_structural_tag_request import BAD, BAD_BEGIN, WANT

PROMPT = "hello world"
MAX_NEW = 64


@pytest.fixture(scope="module")
def engine(llama_dir):
    return small_engine(llama_dir)


def test_rest_and_grpc_give_the_engines_output(engine):
    free = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    tag = structures_of(engine, run_requests(engine, [("f", PROMPT, free, None)])["f"])
    spec = spec_from_json("structural_tag", tag, "response_format")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, structured_outputs=spec)
    ids = run_requests(engine, [("s", PROMPT, params, None)])["s"]
    done = ids[-1] in engine.eos_ids
    want = engine.tokenizer.decode(ids, skip_special_tokens=True)  # as REST and gRPC send it
    assert tag["triggers"][0] in want
    fields = {"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0}
    with served_frontend(engine) as front:
        _, whole = post(front, "completions", {**fields, "response_format": tag})
        text_form = {"structured_outputs": {"structural_tag": json.dumps(tag)}, "stream": True}
        _, stream = post(front, "completions", {**fields, **text_form})
        req = grpc_request(structured_structural_tag=json.dumps(tag))
        chunks = generate(front, req)
    [choice] = whole["choices"]
    finish = "stop" if done else "length"
    assert (choice["text"], choice["finish_reason"]) == (want, finish)
    assert "".join(c["choices"][0]["text"] for c in stream) == want
    assert stream[-1]["choices"][0]["finish_reason"] == finish
    assert [t for c in chunks for t in c.token_ids] == ids
    assert "".join(c.text for c in chunks) == want and chunks[-1].finish_reason == finish


def grpc_request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model=BASE, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0.0, **fields
    )


@pytest.mark.parametrize(
    "fields, details",
    [
        ({"structured_structural_tag": json.dumps(BAD)}, f"structured_structural_tag.{BAD_BEGIN}"),
        ({"structured_structural_tag": "{"}, "structured_structural_tag: not valid JSON"),
        ({"structured_structural_tag": json.dumps(WANT.value), "structured_grammar": 'root ::= "a"'},
         "structured_structural_tag: given with structured_grammar"),
    ],
)  # fmt: skip
def test_a_bad_tag_is_invalid_argument_naming_its_part(engine, fields, details):
    with served_frontend(engine) as front:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            generate(front, grpc_request(**fields))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(details), e.value.details()


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_reasoning_models_structural_tag_starts_after_think_end(think_dir, parser):
    think = small_engine(think_dir)
    [think_end] = think.tokenizer.encode("</think>", add_special_tokens=False)
    prompt = tuple(
        think.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    )
    params = SamplingParams(max_tokens=4, structured_outputs=WANT)
    with served_frontend(think, reasoning_parser=parser) as front:
        after = front.thinking_first(prompt, params).structured_after
    assert after == (think_end,)
