"""Mistral call ids end to end over a real CPU engine (a Frontend and an AsyncEngine, REST
handlers and an in-process gRPC server; no Ray): on a cluster whose tool_call_parser is
mistral every call's id is 9 letters and digits ("required", named and "auto" calls,
whole and streamed, REST and gRPC), and a conversation that sends back OpenAI-style ids
renders under a chat template that enforces Mistral's rule, as Mistral's templates do
(`raise_exception` when an id's length is not 9), the call's and its answer's ids mapped
alike; a hermes cluster sends the ids as given (that template refuses them)."""

from __future__ import annotations

import asyncio
import copy
import json
import re

import pytest

from router import tokenize
from router.call_ids import mistral_call_id
from router.proto import lorafleet_pb2 as pb
from router.tools import plan_of
from tests.unit.replica.engines import small_engine
from tests.unit.router.served_engine import served_frontend
from tests.unit.router.test_frontend_auth import BASE
from tests.unit.router.test_grpc_tools import generate
from tests.unit.router.test_rest_text_options import post
from tests.unit.router.test_rest_tools import CITY, GREEDY, MESSAGES, NAMED, message_of
from tests.unit.router.test_tools import CLOCK, WEATHER

MISTRAL_ID = re.compile("[A-Za-z0-9]{9}")
REFUSED = "Tool call IDs should be alphanumeric strings with length 9!"
# Mistral 7B Instruct v0.3's checks of call ids, in a template of its shape; it also
# refuses a tool message that answers no earlier call (the ids must map alike)
TEMPLATE = (
    "{%- set ns = namespace(ids=[]) %}"
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{%- for c in m.tool_calls %}"
    "{%- if c.id is not defined or c.id | length != 9 %}{{ raise_exception('" + REFUSED + "') }}"
    "{%- endif %}{%- set ns.ids = ns.ids + [c.id] %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, '
    '"id": "{{ c.id }}"}{{ ", " if not loop.last }}{%- endfor %}]{{ eos_token }}'
    "{%- elif m.role == 'tool' %}"
    "{%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}"
    "{{ raise_exception('" + REFUSED + "') }}{%- endif %}"
    "{%- if m.tool_call_id not in ns.ids %}{{ raise_exception('answers no call') }}{%- endif %}"
    '[TOOL_RESULTS]{"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}'
    "[/TOOL_RESULTS]"
    "{%- else %}[INST]{{ m.content }}[/INST]{%- endif %}"
    "{%- endfor %}"
)
SENT_IDS = ["call_abc123", "a1B2c3D4e"]  # OpenAI's shape (mapped), Mistral's (as sent)
AUTO_REGEX = (  # two calls in Mistral's array
    r'Sure\. \[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}"\}\}, '
    r'\{"name": "now", "arguments": \{\}\}\]'
)
CASES = {  # the request's fields, and how many calls the answer has
    "required": ({"tools": [CITY, CLOCK], "tool_choice": "required",
                  "parallel_tool_calls": False, **GREEDY}, 1),
    "named": ({"tools": [CITY, CLOCK], "tool_choice": NAMED, **GREEDY}, 1),
    "auto": ({"tools": [WEATHER, CLOCK], "structured_outputs": {"regex": AUTO_REGEX},
              "temperature": 0, "max_tokens": 160}, 2),
}  # fmt: skip


@pytest.fixture(scope="module")
def engine(llama_dir):
    return small_engine(llama_dir)


@pytest.fixture(scope="module")
def strict(engine):
    """The engine's tokenizer, its chat template Mistral's checks of call ids."""
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def conversation(ids: list[str]) -> list[dict]:
    """A user turn, an assistant turn calling get_weather under each id, a tool turn
    answering each call (a body's messages)."""
    calls = [
        {"id": i, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'}}
        for i in ids
    ]  # fmt: skip
    answers = [{"role": "tool", "content": "sunny", "tool_call_id": i} for i in ids]
    return [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls}, *answers]


def rendered(tokenizer, ids: list[str], tools: list[dict]) -> list[int]:
    """The token ids of `conversation(ids)` and tools rendered by the chat template, the
    messages and tools in the shape templates take them."""
    messages = conversation(ids)
    for c in messages[1]["tool_calls"]:
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    messages[1]["content"] = ""
    return tokenizer.apply_chat_template(
        messages,
        tools=plan_of(tools, "none", None).template_tools(),
        add_generation_prompt=True,
        return_dict=False,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_mistral_clusters_calls_have_mistral_ids(engine, stream):
    # old code: the forced ("required", named) calls had "call_..." ids
    with served_frontend(engine, tool_call_parser="mistral") as front:
        for case, (fields, count) in CASES.items():
            body = {"messages": MESSAGES, **fields, "stream": stream}
            status, result = post(front, "chat", body)
            assert status == 200
            message, _ = message_of(result)
            ids = [c["id"] for c in message["tool_calls"]]
            assert len(set(ids)) == len(ids) == count, case
            assert all(MISTRAL_ID.fullmatch(i) for i in ids), (case, ids)


def test_returned_ids_render_under_mistrals_template(engine, strict):
    # old code: the template refused "call_abc123" (a 400)
    body = {"messages": conversation(SENT_IDS), "tools": [WEATHER], "tool_choice": "none"}
    body |= {"max_tokens": 1}
    want = rendered(strict, [mistral_call_id(i) for i in SENT_IDS], [WEATHER])
    assert mistral_call_id(SENT_IDS[1]) == SENT_IDS[1]
    with served_frontend(engine, tool_call_parser="mistral", tokenizer=strict) as front:
        status, result = post(front, "chat", body)
        assert status == 200, result
        assert result["usage"]["prompt_tokens"] == len(want)
        raw = json.dumps({"model": BASE, **{k: body[k] for k in ("messages", "tools")}})
        response = asyncio.run(tokenize.tokenize(front, None, raw.encode()))
        assert response.status_code == 200
        assert json.loads(response.body)["tokens"] == want  # /tokenize renders as chat
    with served_frontend(engine, tool_call_parser="hermes", tokenizer=strict) as front:
        status, result = post(front, "chat", body)  # other parsers: the ids as sent
    assert status == 400 and REFUSED in result["error"]["message"]


def test_grpc_chat_maps_returned_ids_and_calls_under_mistral_ids(engine, strict):
    # old code: the template refused the returned ids (INVALID_ARGUMENT), and the
    # "required" call's id was "call_..."
    turns = [pb.ChatTurn(role="user", content=MESSAGES[0]["content"])]
    calls = [pb.ToolCall(id=i, name="get_weather", arguments='{"city": "oslo"}') for i in SENT_IDS]
    turns.append(pb.ChatTurn(role="assistant", tool_calls=calls))
    turns += [pb.ChatTurn(role="tool", content="sunny", tool_call_id=i) for i in SENT_IDS]
    req = pb.GenerateRequest(
        model=BASE, messages=turns, tools_json=json.dumps([CITY]), tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=160,
    )  # fmt: skip
    with served_frontend(engine, tool_call_parser="mistral", tokenizer=strict) as front:
        chunks = generate(front, req)
    ids = [d.id for c in chunks for d in c.tool_calls if d.id]
    assert len(ids) == 1 and MISTRAL_ID.fullmatch(ids[0]), ids
    want = rendered(strict, [mistral_call_id(i) for i in SENT_IDS], [CITY])
    assert chunks[-1].usage.prompt_tokens == len(want)
