"""Tool calling on REST chat over a real CPU engine (the handlers, a Frontend and an
AsyncEngine, called as the replica deployment calls it; no Ray): a forced call ("required",
named) is HF transformers' greedy output under an independent xgrammar matcher of the same
grammar, read into calls; streamed deltas join into the whole response; "auto" reads
Hermes blocks; tools and earlier calls reach the chat template; bad tool bodies are 400s
naming the field."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import xgrammar as xgr

from lora_core.errors import InvalidRequest
from replica.structured_spec import StructuredOutput
from router.body_parse import parse_body
from router.frontend import Frontend
from router.openai_protocol import ChatCompletionRequest
from router.tools import plan_of
from tests.hf_reference import hf_greedy
from tests.unit.replica.engines import small_engine
from tests.unit.replica.test_structured_vs_hf import _GrammarMask
from tests.unit.router.served_engine import served_frontend
from tests.unit.router.test_rest_text_options import post
from tests.unit.router.test_tools import CLOCK, WEATHER

GREEDY = {"temperature": 0, "max_tokens": 48}
# a random model fills a free string until max_tokens: the forced calls' tool is bounded
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["oslo", "lima"]},
                "days": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "what is the weather in oslo"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def engine(llama_dir):
    return small_engine(llama_dir)


@pytest.fixture(scope="module")
def served(engine):
    with served_frontend(engine, tool_call_parser="hermes") as front:
        yield front


def message_of(result) -> tuple[dict, str]:
    """(message, finish_reason) of choice 0: a response's, or a stream's deltas joined
    as an OpenAI client joins them (tool call i's arguments appended by index)."""
    if isinstance(result, dict):
        choice = result["choices"][0]
        return choice["message"], choice["finish_reason"]
    content, calls, finish = "", [], None
    for chunk in result:
        for c in chunk["choices"]:
            delta = c["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    calls.append({k: v for k, v in call.items() if k != "index"})
                    calls[-1]["function"] = dict(call["function"])
                    assert call["index"] == len(calls) - 1
                else:
                    calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            finish = c["finish_reason"] or finish
    message = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message, finish


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls", ())
    ]


def hf_text(engine, llama_dir, prompt: list[int], spec: StructuredOutput) -> str:
    """HF's greedy output under an xgrammar matcher of spec, decoded (EOS dropped)."""
    grammar = xgr.Grammar.from_json_schema(spec.value, any_whitespace=False)  # xgrammar's own
    mask = _GrammarMask(engine, grammar, len(prompt))
    ids = hf_greedy(
        llama_dir, None, prompt, max_new_tokens=GREEDY["max_tokens"], logits_processor=[mask],
        eos_token_id=sorted(engine.eos_ids),
    )  # fmt: skip
    assert ids[-1] in engine.eos_ids, "the grammar did not close within max_tokens"
    return engine.tokenizer.decode(ids[:-1])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_is_hf_greedy_under_its_grammar(served, engine, llama_dir, choice, stream):
    tool_choice = NAMED if choice == "named" else "required"
    tools = [CITY, CLOCK]
    # one call: a random model would add calls to the array until max_tokens
    body = {"messages": MESSAGES, "tools": tools, "tool_choice": tool_choice, "stream": stream}
    status, result = post(served, "chat", {**body, "parallel_tool_calls": False, **GREEDY})
    assert status == 200
    message, finish = message_of(result)
    plan = plan_of(tools, tool_choice, False)
    prompt = engine.tokenizer.apply_chat_template(
        MESSAGES, tools=plan.template_tools(), add_generation_prompt=True, return_dict=False
    )
    text = hf_text(engine, llama_dir, prompt, plan.grammar())
    if choice == "named":
        want = [("get_weather", json.loads(text))]
        assert message["tool_calls"][0]["function"]["arguments"] == text
        assert finish == "stop"  # OpenAI's forced call
    else:
        want = [(c["name"], c["parameters"]) for c in json.loads(text)]
        assert finish == "tool_calls"
    assert message["content"] is None and calls_of(message) == want
    for name, arguments in want:  # the grammar held the schema
        assert name in ("get_weather", "now")
        assert name == "now" or (arguments["city"] in ("oslo", "lima") and arguments["days"] <= 9)


def test_choices_of_a_required_call_have_their_own_ids(served):
    body = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"}
    status, result = post(served, "chat", {**body, "n": 3, "temperature": 1.0, "seed": 5})
    assert status == 200
    ids = [c["id"] for ch in result["choices"] for c in ch["message"]["tool_calls"]]
    assert len(ids) >= 3 and len(set(ids)) == len(ids)
    for choice in result["choices"]:
        assert choice["finish_reason"] in ("tool_calls", "length")


# "auto" reads what the model writes; a random model writes no call, so a regex makes it
# write one (a structured output may go with "auto": the reader only reads the text)
HERMES_REGEX = (
    r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}"\}\}'
    r"</tool_call>"
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_hermes_calls(served, stream):
    body = {
        "messages": MESSAGES,
        "tools": [WEATHER, CLOCK],
        "structured_outputs": {"regex": HERMES_REGEX},
        "stream": stream,
        **GREEDY,
        "max_tokens": 160,
    }
    status, result = post(served, "chat", body)
    assert status == 200
    message, finish = message_of(result)
    assert message["content"] == "Sure. " and finish == "tool_calls"
    [(name, arguments)] = calls_of(message)
    assert name == "get_weather" and set(arguments) == {"city"}


def test_auto_without_a_call_is_text_and_stop(served):
    status, result = post(served, "chat", {"messages": MESSAGES, "tools": [WEATHER], **GREEDY})
    assert status == 200
    message, finish = message_of(result)
    assert "tool_calls" not in message and isinstance(message["content"], str)
    plain = post(served, "chat", {"messages": MESSAGES, **GREEDY})[1]
    assert finish == plain["choices"][0]["finish_reason"]


def test_tools_and_earlier_calls_reach_the_template(served, engine):
    turns = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"messages": turns, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 1}
    status, result = post(served, "chat", body)
    assert status == 200
    rendered = engine.tokenizer.apply_chat_template(
        [
            MESSAGES[0],
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "oslo"}}}
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ],
        tools=plan_of([WEATHER], None, None).template_tools(),
        add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "oslo"}}' in rendered
    assert '"name": "get_weather", "description"' in rendered  # the tools' list
    prompt = engine.tokenizer(rendered, add_special_tokens=False).input_ids
    assert result["usage"]["prompt_tokens"] == len(prompt)


def test_auto_on_a_cluster_without_a_parser_is_a_400(llama_dir):
    with served_frontend(small_engine(llama_dir)) as front:
        status, body = post(front, "chat", {"messages": MESSAGES, "tools": [WEATHER]})
        assert status == 400 and body["error"]["param"] == "tool_choice"
        assert "cluster arg tool_call_parser" in body["error"]["message"]
        status, _ = post(front, "chat", {"messages": MESSAGES, "tools": [WEATHER],
                                         "tool_choice": "required", "max_tokens": 40})  # fmt: skip
        assert status == 200


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools",
         "tools[0].function.name: got"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "tool_choice.function.name: 'x' is not one of tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", 'tool_choice: "required" forces a call, given with a structured output'),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls",
         "parallel_tool_calls: allowed: true or false"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages",
         'tool_call_id: in a "user" message'),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "{"}}]}]}, "messages",
         "not the JSON text of an object"),
    ],
)  # fmt: skip
def test_bad_tool_bodies_are_400s_naming_the_field(fields, param, message):
    body = {"model": "m", "messages": MESSAGES, **fields}
    with pytest.raises(InvalidRequest) as e:
        parse_body(ChatCompletionRequest, body)
    assert message in str(e.value) and (e.value.param or "").startswith(param)


def test_a_parser_over_a_template_without_tools_is_warned_of(engine, caplog):
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with caplog.at_level(logging.WARNING, logger="lorafleet.router"):
        Frontend(tokenizer, None, None, 64, tool_call_parser="hermes")
    assert "never reads `tools`" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lorafleet.router"):
        Frontend(engine.tokenizer, None, None, 64, tool_call_parser="hermes")
    assert "never reads" not in caplog.text


def test_tools_count_toward_what_cannot_fit_the_context(llama_dir):
    engine = small_engine(llama_dir)
    with served_frontend(engine, max_model_len=64, tool_call_parser="hermes") as front:
        huge = {"type": "function", "function": {"name": "f", "description": "x" * 5000}}
        status, body = post(front, "chat", {"messages": MESSAGES, "tools": [huge]})
    assert status == 400 and body["error"]["param"] == "messages"
    assert "characters cannot fit the model's context of 64 tokens" in body["error"]["message"]
