"""vLLM's include_stop_str_in_output, skip_special_tokens and truncate_prompt_tokens end
to end (the OpenAI client with extra_body, raw SSE and gRPC against the package's shared
cluster): a kept stop string ends the text, streamed or not, with n choices; kept special
tokens are text; a truncated prompt bills and answers as its last k tokens sent alone;
bad values are refused naming the field."""

from __future__ import annotations

import grpc
import openai
import pytest

from replica.prompt_truncation import TRUNCATE_ALLOWED
from router.proto import lorafleet_pb2 as pb
from router.proto import lorafleet_pb2_grpc as pb_grpc
from tests.integration.serve.sampling.test_prompt_logprobs_api import post, tokenizer
from tests.integration.serve.sampling.test_sampling_api import (
    KINDS,
    MESSAGES,
    PROMPT,
    create,
    sse_events,
    texts,
)

pytestmark = pytest.mark.integration
GREEDY = {"temperature": 0, "max_tokens": 12}
EOS = "<|endoftext|>"  # the demo tokenizer's EOS (id 0), a special token
EOS_ALWAYS = {"ignore_eos": True, "logit_bias": {"0": 100}}


def stub_and_meta(cluster):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.grpc))
    return stub, (("authorization", f"Bearer {cluster.keys['ops']}"),)


def streamed_texts(cluster, kind: str, body: dict, n: int) -> list[str]:
    """Each choice's text of a raw SSE stream, its chunks joined."""
    body = {"model": "demo-poet", **body, "stream": True, "n": n}
    if kind == "completions":
        events = sse_events(cluster, "/v1/completions", {**body, "prompt": PROMPT})
    else:
        events = sse_events(cluster, "/v1/chat/completions", {**body, "messages": MESSAGES})
    parts = [""] * n
    for event in events[:-1]:
        for c in event["choices"]:
            text = c["text"] if kind == "completions" else c["delta"].get("content")
            parts[c["index"]] += text or ""
    return parts


@pytest.mark.parametrize("kind", KINDS)
def test_a_kept_stop_string_ends_the_text_streamed_or_not(cluster, kind):
    full = texts(create(cluster, kind, **GREEDY, extra_body={"ignore_eos": True}))[0]
    stop = full[4:6]
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = create(cluster, kind, n=2, stop=[stop], **GREEDY, extra_body=extra)
    left_out = create(cluster, kind, n=2, stop=[stop], **GREEDY, extra_body={"ignore_eos": True})
    at = full.find(stop)
    assert texts(kept) == [full[: at + len(stop)]] * 2
    assert texts(left_out) == [full[:at]] * 2
    assert [c.finish_reason for c in kept.choices] == ["stop", "stop"]
    body = {**GREEDY, **extra, "stop": [stop]}
    assert streamed_texts(cluster, kind, body, 2) == texts(kept)


def test_grpc_keeps_the_stop_string_as_rest_does(cluster):
    full = texts(create(cluster, "completions", **GREEDY, extra_body={"ignore_eos": True}))[0]
    stop = full[4:6]
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    rest = create(cluster, "completions", stop=[stop], **GREEDY, extra_body=extra)
    stub, meta = stub_and_meta(cluster)
    req = pb.GenerateRequest(
        model="demo-poet", prompt=PROMPT, max_tokens=12, stop=[stop],
        include_stop_str_in_output=True,
    )  # fmt: skip
    chunks = list(stub.Generate(req, metadata=meta))
    assert "".join(c.text for c in chunks) == texts(rest)[0] and texts(rest)[0].endswith(stop)
    assert chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("kind", KINDS)
def test_kept_special_tokens_are_text_on_rest_and_grpc(cluster, kind):
    body = {"max_tokens": 3, **EOS_ALWAYS}
    skipped = create(cluster, kind, max_tokens=3, extra_body=EOS_ALWAYS)
    kept = create(
        cluster, kind, max_tokens=3, extra_body={**EOS_ALWAYS, "skip_special_tokens": False}
    )
    assert texts(skipped) == [""] and texts(kept) == [EOS * 3]
    assert streamed_texts(cluster, kind, {**body, "skip_special_tokens": False}, 1) == [EOS * 3]
    # gRPC has no ignore_eos: the first EOS ends the choice, its text left out unless
    # include_stop_str_in_output keeps it, and then spelled only with special tokens kept
    stub, meta = stub_and_meta(cluster)
    for skip, keep, want in [
        (None, False, ""),
        (False, False, ""),
        (None, True, ""),
        (True, True, ""),
        (False, True, EOS),
    ]:
        req = pb.GenerateRequest(
            model="demo-poet", prompt=PROMPT, max_tokens=3, logit_bias={0: 100.0},
            skip_special_tokens=skip, include_stop_str_in_output=keep,
        )  # fmt: skip
        chunks = list(stub.Generate(req, metadata=meta))
        assert "".join(c.text for c in chunks) == want, (skip, keep)
        assert [t for c in chunks for t in c.token_ids] == [0]


@pytest.mark.parametrize("k", [2, 4])
def test_a_truncated_prompt_bills_and_answers_as_its_last_k_tokens(cluster, k):
    ids = tokenizer(cluster)(PROMPT).input_ids
    assert len(ids) > k
    cut = create(cluster, "completions", **GREEDY, extra_body={"truncate_prompt_tokens": k})
    alone = openai.OpenAI(
        base_url=f"{cluster.http}/v1", api_key=cluster.keys["ops"], max_retries=0, timeout=60
    ).completions.create(model="demo-poet", prompt=ids[-k:], **GREEDY)
    whole = create(cluster, "completions", **GREEDY)
    assert cut.usage.prompt_tokens == alone.usage.prompt_tokens == k
    assert texts(cut) == texts(alone) != texts(whole)
    body = {"model": "demo-poet", "prompt": PROMPT, **GREEDY, "truncate_prompt_tokens": k}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(cluster, "/v1/completions", body)
    assert "".join(c["text"] for e in events[:-2] for c in e["choices"]) == texts(cut)[0]
    assert events[-2]["usage"]["prompt_tokens"] == k
    stub, meta = stub_and_meta(cluster)
    req = pb.GenerateRequest(
        model="demo-poet", prompt=PROMPT, max_tokens=12, truncate_prompt_tokens=k,
        prompt_logprobs=0,
    )  # fmt: skip
    chunks = list(stub.Generate(req, metadata=meta))
    assert "".join(c.text for c in chunks) == texts(cut)[0]
    assert list(chunks[0].prompt_token_ids) == ids[-k:] and len(chunks[0].prompt_logprobs) == k - 1


def test_a_truncated_chat_keeps_the_last_tokens_of_its_template(cluster):
    tok = tokenizer(cluster)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    chat = create(cluster, "chat", **GREEDY, extra_body={"truncate_prompt_tokens": 5})
    alone = post(cluster, "/v1/completions", {"model": "demo-poet", "prompt": ids[-5:], **GREEDY})
    assert chat.usage.prompt_tokens == 5
    assert texts(chat) == [alone.json()["choices"][0]["text"]]


@pytest.mark.parametrize("k", [0, -2, 100000])
def test_a_bad_truncation_is_refused_naming_the_field(cluster, k):
    for kind in KINDS:
        with pytest.raises(openai.BadRequestError) as e:
            create(cluster, kind, extra_body={"truncate_prompt_tokens": k})
        err = e.value.body
        assert err["param"] == "truncate_prompt_tokens" and TRUNCATE_ALLOWED in err["message"]
    stub, meta = stub_and_meta(cluster)
    with pytest.raises(grpc.RpcError) as e:
        list(
            stub.Generate(
                pb.GenerateRequest(model="demo-poet", prompt=PROMPT, truncate_prompt_tokens=k),
                metadata=meta,
            )
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"truncate_prompt_tokens={k}")
