"""gRPC Generate answers as REST answers the same body, over a real CPU engine (a Frontend
and an AsyncEngine, no Ray): a chat without max_tokens generates up to the room its prompt
leaves in the context (not 16) and a prompt up to 16, as REST's chat and completions do;
a chat that leaves no room (after truncate_prompt_tokens) is refused in REST's words;
ignore_eos is honoured; each choice's last chunk carries its usage, which sums to REST's. The differences gRPC keeps on purpose: docs/api.md."""

from __future__ import annotations

import grpc
import pytest

from router.chat_reader import reader_of
from router.grpc_chat import read_chunks
from router.proto import lorafleet_pb2 as pb
from router.tools import ToolPlan
from tests.unit.replica.engines import small_engine
from tests.unit.router.served_engine import served_frontend
from tests.unit.router.test_frontend_auth import BASE
from tests.unit.router.test_grpc_tools import generate
from tests.unit.router.test_rest_text_options import MESSAGES, PROMPT, post

ROOM = 24  # more than the completion default of 16


@pytest.fixture(scope="module")
def engine(llama_dir):
    return small_engine(llama_dir)


@pytest.fixture(scope="module")
def chat_len(engine) -> int:
    """Tokens of MESSAGES rendered by the chat template (the prompt of a chat)."""
    ids = engine.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_dict=False
    )
    return len(ids)


def grpc_request(chat: bool, **fields) -> pb.GenerateRequest:
    """REST's PROMPT or MESSAGES as a gRPC request, greedy and past EOS unless fields say."""
    req = pb.GenerateRequest(model=BASE, **{"temperature": 0.0, "ignore_eos": True, **fields})
    if chat:
        req.messages.extend(pb.ChatTurn(role=m["role"], content=m["content"]) for m in MESSAGES)
    else:
        req.prompt = PROMPT
    return req


def answer(chunks: list[pb.GenerateChunk]) -> tuple[str, int, str]:
    """(text, generated tokens, finish reason) of one choice's chunks."""
    text = "".join(c.text for c in chunks)
    return text, sum(len(c.token_ids) for c in chunks), chunks[-1].finish_reason


@pytest.mark.parametrize("kind, want", [("chat", ROOM), ("completions", 16)])
def test_unset_max_tokens_is_rests_default(engine, chat_len, kind, want):
    body = {"temperature": 0, "ignore_eos": True}
    with served_frontend(engine, max_model_len=chat_len + ROOM) as front:
        status, rest = post(front, kind, body)
        got = answer(generate(front, grpc_request(kind == "chat")))
    assert status == 200
    [choice] = rest["choices"]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    assert rest["usage"]["completion_tokens"] == want
    assert got == (text, want, "length") == (text, want, choice["finish_reason"])


@pytest.mark.parametrize(
    "cut, room",
    [
        (0, 5),  # the context holds the prompt and 5 more: 5 tokens, not a refusal
        (3, 3),  # truncate_prompt_tokens keeps all but 3: the room its kept tokens leave
        (0, 0),  # no room: refused, naming messages
        (5, 0),  # the kept tokens fill the context
    ],
)
def test_a_chats_room_is_its_prompts_as_rests(engine, chat_len, cut, room):
    """cut: the prompt's first tokens truncate_prompt_tokens leaves out (0: not sent);
    room: the context's tokens after the kept prompt."""
    max_len = chat_len - cut + room
    body = {"temperature": 0, "ignore_eos": True}
    req = grpc_request(True)
    if cut:
        body["truncate_prompt_tokens"] = req.truncate_prompt_tokens = chat_len - cut
    with served_frontend(engine, max_model_len=max_len) as front:
        status, rest = post(front, "chat", body)
        if room == 0:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                generate(front, req)
        else:
            got = answer(generate(front, req))
    if room == 0:
        assert status == 400 and rest["error"]["param"] == "messages"
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == rest["error"]["message"]
        assert "leaves no room to generate" in e.value.details()
        return
    assert status == 200 and rest["usage"]["completion_tokens"] == room
    assert got == (rest["choices"][0]["message"]["content"], room, "length")


@pytest.mark.parametrize("reasoning", [None, "deepseek_r1"])  # chunks as sent, or read
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_each_choices_last_chunk_carries_its_usage(engine, chat_len, kind, reasoning):
    """REST's usage is the prompt (its kept tokens) once and the choices' completion
    tokens summed; the chunks of a chat read for reasoning carry it on their last too."""
    body = {"temperature": 1.0, "seed": 3, "n": 3, "max_tokens": 12, "truncate_prompt_tokens": 5}
    req = grpc_request(
        kind == "chat", temperature=1.0, seed=3, n=3, max_tokens=12, ignore_eos=False
    )
    req.truncate_prompt_tokens = 5
    with served_frontend(engine, reasoning_parser=reasoning) as front:
        status, rest = post(front, kind, body)
        chunks = generate(front, req)
    assert status == 200
    per_choice = [[c for c in chunks if c.index == i] for i in range(3)]
    assert [[c.HasField("usage") for c in cs] for cs in per_choice] == [
        [False] * (len(cs) - 1) + [True] for cs in per_choice
    ]
    usages = [cs[-1].usage for cs in per_choice]
    assert all(cs[-1].finish_reason for cs in per_choice)
    assert [u.completion_tokens for u in usages] == [
        sum(len(c.token_ids) for c in cs) for cs in per_choice
    ]
    assert {u.prompt_tokens for u in usages} == {rest["usage"]["prompt_tokens"]} == {5}
    assert sum(u.completion_tokens for u in usages) == rest["usage"]["completion_tokens"]


def test_a_read_output_of_several_deltas_has_its_usage_on_the_last():
    reader = reader_of(ToolPlan((), "none"), None, None, "deepseek_r1")
    chunk = pb.GenerateChunk(text="a</think>b", token_ids=[4, 5, 6], finish_reason="stop")
    chunk.usage.prompt_tokens, chunk.usage.completion_tokens = 7, 3
    out = read_chunks(chunk, reader)
    assert [(c.reasoning_content, c.text, c.finish_reason) for c in out] == [
        ("a", "", ""),
        ("", "b", "stop"),
    ]
    assert [c.HasField("usage") for c in out] == [False, True] and out[-1].usage == chunk.usage
