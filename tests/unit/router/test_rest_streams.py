"""REST stream framing over a real Frontend (fake registry, scripted dispatch): every
chunk of one stream repeats the same `id`, `model` and `created` (OpenAI: "each chunk
has the same timestamp"), also when the stream outlives a second."""

import asyncio
import json

import pytest

from replica.outputs import RequestOutput
from router import rest
from router.auth import AdapterResolver
from router.body_parse import parse_body
from router.frontend import Frontend
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.unit.router.test_frontend_auth import BASE, FakeRegistry, tokenizer

__all__ = ["tokenizer"]  # the module fixture, shared


class SlowDispatch:
    """Two outputs with `pause_s` between them (the stream crosses a second boundary)."""

    def __init__(self, pause_s: float):
        self.pause_s = pause_s

    async def __call__(self, call):
        yield RequestOutput(call.request_id, [5], "x", num_prompt_tokens=2, num_output_tokens=1)
        await asyncio.sleep(self.pause_s)
        yield RequestOutput(
            call.request_id,
            [6],
            "y",
            finish_reason="length",
            num_prompt_tokens=2,
            num_output_tokens=2,
        )


def events(tokenizer, handler, model, body, dispatch=None) -> list[dict]:
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=False, admin_key="")
    front = Frontend(tokenizer, resolver, dispatch or SlowDispatch(1.05), 64)

    async def go():
        response = await handler(front, None, parse_body(model, body))
        return [chunk async for chunk in response.body_iterator]

    raw = b"".join(asyncio.run(go())).decode()
    datas = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


STREAM = {"model": "a2", "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    "handler, model, body, n",
    [
        (rest.completions, CompletionRequest, {**STREAM, "prompt": "hi"}, 3),
        (
            rest.chat_completions,
            ChatCompletionRequest,
            {**STREAM, "messages": [{"role": "user", "content": "hi"}]},
            4,  # the role chunk first
        ),
    ],
)
def test_every_chunk_of_a_stream_has_the_same_id_and_created(tokenizer, handler, model, body, n):
    chunks = events(tokenizer, handler, model, body)
    assert len(chunks) == n
    assert {(c["id"], c["model"], c["created"]) for c in chunks} == {
        (chunks[0]["id"], "a2", chunks[0]["created"])
    }
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 4


class SplitCharDispatch:
    """ "é" (two UTF-8 bytes) over two outputs: the first one's text is still empty."""

    async def __call__(self, call):
        yield RequestOutput(call.request_id, [7], "", num_prompt_tokens=2, num_output_tokens=1)
        yield RequestOutput(
            call.request_id,
            [8],
            "é",
            finish_reason="length",
            num_prompt_tokens=2,
            num_output_tokens=2,
        )


def test_a_chat_chunk_without_text_yet_has_empty_content_as_vllm(tokenizer):
    """A token ending inside a UTF-8 character adds no text: its chunk's delta is
    {"content": ""} (vLLM's), not {} (which clients reading delta.content trip over)."""
    body = {**STREAM, "messages": [{"role": "user", "content": "hi"}]}
    chunks = events(
        tokenizer, rest.chat_completions, ChatCompletionRequest, body, SplitCharDispatch()
    )
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": ""}, {"content": "é"}]
