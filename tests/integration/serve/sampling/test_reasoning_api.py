"""Reasoning end to end, through the OpenAI client and gRPC: with the cluster's
reasoning_parser (deepseek_r1: the `thinking` app) a chat answer's thinking is
`reasoning_content` and the rest `content` (gRPC: `reasoning_content` and `text`), whole
and streamed; thinking cut by max_tokens is all reasoning; without a parser (the
package's app) the same output is all content; usage counts every generated token either
way. How the reader splits text pieces is tests/unit/router/test_reasoning.py's.

The random demo model writes no tags unless made to: the prompt closes a thinking itself
(its turn ends "<think>x</think>", which the demo tokenizer encodes as it encodes the
tags alone), so a regex holds the output from its first token and may spell the tags
(docs/api.md, Reasoning models): the answer is exactly the regex's text.

REST and gRPC share this module so that the second app starts once (it takes about as
long as the rest of the module).
"""

from __future__ import annotations

import openai
import pytest

from router.proto import lorafleet_pb2 as pb
from tests.integration.serve.cluster_fixture import start_app_beside, stop_app_beside

pytestmark = pytest.mark.integration
CLOSED = "what is lorafleet<think>x</think>"
THOUGHT = "<think>plan</think>answer"
UNCLOSED = "<think>" + "plan " * 20  # more than MAX_TOKENS tokens: cut open
MAX_TOKENS = 24
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def thinking(cluster):
    """The package's cluster with a second app whose reasoning_parser is deepseek_r1 (one
    replica, auth off), removed once this module ran: some other modules' gRPC calls
    name no app, which Serve's proxy takes only while one runs."""
    app = start_app_beside(cluster, "thinking", num_replicas=1, reasoning_parser="deepseek_r1")
    yield app
    stop_app_beside(cluster, "thinking")


def chat(cluster, regex: str, **kw):
    """The chat of CLOSED, its output held to `regex`, greedy, on `cluster`'s base model."""
    client = openai.OpenAI(
        base_url=f"{cluster.http}/v1", api_key=cluster.keys["ops"], max_retries=0, timeout=60
    )
    return client.chat.completions.create(
        model=cluster.base,
        messages=[{"role": "user", "content": CLOSED}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"structured_outputs": {"regex": regex}},
        **kw,
    )


def streamed(cluster, regex: str) -> tuple[str, str, str | None, object]:
    """A streamed chat's deltas joined: (reasoning_content, content, finish, usage)."""
    thought, text, finish, usage = "", "", None, None
    for chunk in chat(cluster, regex, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            thought += getattr(c.delta, "reasoning_content", None) or ""
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return thought, text, finish, usage


def grpc_chat(cluster, regex: str) -> tuple[str, str, pb.GenerateChunk, int]:
    """`chat` over gRPC, its chunks joined: (reasoning_content, text, the last chunk,
    how many token ids they carried)."""
    req = pb.GenerateRequest(
        model=cluster.base,
        messages=[pb.ChatTurn(role="user", content=CLOSED)],
        max_tokens=MAX_TOKENS,
        temperature=0,
        structured_regex=regex,
    )
    chunks = list(cluster.grpc_stub().Generate(req, metadata=cluster.grpc_auth(), timeout=60))
    thought = "".join(c.reasoning_content for c in chunks)
    text = "".join(c.text for c in chunks)
    return thought, text, chunks[-1], sum(len(c.token_ids) for c in chunks)


def test_the_thinking_is_reasoning_content_and_the_rest_content(cluster, thinking):
    on = chat(thinking, THOUGHT, logprobs=True)
    [choice] = on.choices
    assert choice.message.reasoning_content == "plan" and choice.message.content == "answer"
    assert choice.finish_reason == "stop"
    # logprobs and usage count the tags and the thinking too
    tokens = [t.token for t in choice.logprobs.content]
    assert "".join(tokens) == THOUGHT + EOS and len(tokens) == on.usage.completion_tokens
    assert on.usage.total_tokens == on.usage.prompt_tokens + on.usage.completion_tokens
    # without a reasoning_parser the same greedy output is all content
    off = chat(cluster, THOUGHT, logprobs=True)
    assert off.choices[0].message.content == THOUGHT
    assert "reasoning_content" not in off.choices[0].message.model_dump()
    assert [t.token for t in off.choices[0].logprobs.content] == tokens
    assert off.usage == on.usage


def test_a_stream_joins_into_the_whole_answer(cluster, thinking):
    whole = chat(thinking, THOUGHT)
    assert streamed(thinking, THOUGHT) == ("plan", "answer", "stop", whole.usage)
    assert streamed(cluster, THOUGHT) == ("", THOUGHT, "stop", whole.usage)


def test_thinking_cut_by_max_tokens_is_all_reasoning(cluster, thinking):
    off = chat(cluster, UNCLOSED)
    cut = off.choices[0].message.content
    assert off.choices[0].finish_reason == "length" and off.usage.completion_tokens == MAX_TOKENS
    assert cut.startswith("<think>plan") and UNCLOSED.startswith(cut)
    on = chat(thinking, UNCLOSED)
    message = on.choices[0].message
    assert message.reasoning_content == cut.removeprefix("<think>") and message.content == ""
    assert on.choices[0].finish_reason == "length" and on.usage == off.usage
    assert streamed(thinking, UNCLOSED) == (message.reasoning_content, "", "length", on.usage)


def test_grpc_chunks_carry_the_thinking_and_the_answer(cluster, thinking):
    rest = chat(thinking, THOUGHT).usage
    for app, want in ((thinking, ("plan", "answer")), (cluster, ("", THOUGHT))):
        thought, text, last, n_ids = grpc_chat(app, THOUGHT)
        assert (thought, text, last.finish_reason) == (*want, "stop")
        usage = (last.usage.prompt_tokens, last.usage.completion_tokens)
        assert usage == (rest.prompt_tokens, rest.completion_tokens) == (usage[0], n_ids)


def test_grpc_thinking_cut_by_max_tokens_is_all_reasoning(cluster, thinking):
    thought, cut, last, n_ids = grpc_chat(cluster, UNCLOSED)
    assert thought == "" and cut.startswith("<think>plan") and UNCLOSED.startswith(cut)
    assert last.finish_reason == "length" and last.usage.completion_tokens == n_ids == MAX_TOKENS
    thought, text, last, n_ids = grpc_chat(thinking, UNCLOSED)
    assert (thought, text) == (cut.removeprefix("<think>"), "")
    assert last.finish_reason == "length" and last.usage.completion_tokens == n_ids == MAX_TOKENS
