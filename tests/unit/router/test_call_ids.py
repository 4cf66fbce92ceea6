"""Tool call ids (router.call_ids), pure logic: a Mistral cluster's readers, forced ones
included, give 9 letters and digits, unique in the choice, and keep a model-written id
only when it is such; ids a client sends back map to such ids deterministically (the same
id to the same value, in any process), and only for the mistral parser."""

from __future__ import annotations

import copy
import json
import re
import string

import pytest

from router.call_ids import CallIds, mistral_call_id, template_call_ids
from router.chat_reader import joined
from router.tools import PARSERS, plan_of
from tests.unit.router.test_tools import CLOCK, WEATHER

MISTRAL_ID = re.compile("[A-Za-z0-9]{9}")
OPENAI_ID = re.compile("call_[0-9a-f]{24}")
FORCED = {  # tool_choice -> an answer its grammar admits, of two calls where it may
    "required": '[{"name": "get_weather", "parameters": {"city": "a"}}, '
    '{"name": "now", "parameters": {}}]',
    "named": '{"city": "a"}',
}


def _ids(choice: str, parser: str) -> list[str]:
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_of([WEATHER, CLOCK], tool_choice if choice == "named" else choice, None)
    reader = plan.stream(parser)
    message = joined(reader.feed(FORCED[choice]) + reader.end())
    return [c["id"] for c in message["tool_calls"]]


@pytest.mark.parametrize("choice", sorted(FORCED))
def test_forced_calls_take_the_parsers_id_shape(choice):
    # old code: "call_..." ids whatever the parser
    for parser in PARSERS:
        ids = _ids(choice, parser)
        shape = MISTRAL_ID if parser == "mistral" else OPENAI_ID
        assert all(shape.fullmatch(i) for i in ids), (parser, ids)
        assert len(set(ids)) == len(ids) == (2 if choice == "required" else 1)


def test_fresh_mistral_ids_are_random_letters_and_digits_unique_in_the_choice():
    # old code: the mistral reader's fresh ids were lowercase hex digits only
    reader = plan_of([CLOCK], "auto", None).stream("mistral")
    message = joined(reader.feed("[TOOL_CALLS]now{}" * 300) + reader.end())
    got = [c["id"] for c in message["tool_calls"]]
    assert len(got) == 300 and all(MISTRAL_ID.fullmatch(i) for i in got)
    assert len(set(got)) == len(got)
    seen = set("".join(got))  # 2700 characters: one of the 62 missing: p < 1e-16
    for kind in (string.ascii_lowercase, string.ascii_uppercase, string.digits):
        assert seen >= set(kind)


@pytest.mark.parametrize(
    "written, kept",
    [
        ("a1B2c3D4e", True),
        ("a1B2c3D4", False),  # 8
        ("a1B2c3D4e5", False),  # 10
        ("a1B2c3D4_", False),
        ("", False),
        ("given0001", False),  # an earlier call's
    ],
)
def test_a_written_mistral_id_is_kept_only_when_it_fits_and_is_new(written, kept):
    ids = CallIds(mistral=True, given={"given0001"})
    got = ids.next(written)
    assert (got == written) == kept
    assert MISTRAL_ID.fullmatch(got) and got != "given0001" and got in ids.given


def test_a_client_id_maps_to_nine_letters_and_digits_the_same_everywhere():
    # pinned values: a conversation's turns reach any router replica, after restarts too
    # (Python's hash() is salted per process; the map must not be)
    assert mistral_call_id("call_abc123") == "HIRFpb2pt"
    assert mistral_call_id("call-1") == "EnPlVupXO"
    assert mistral_call_id("a1B2c3D4e") == "a1B2c3D4e"  # already one: as sent
    sent = [f"call_{i}" for i in range(5000)] + ["", "x" * 200, "ü1", "a1B2c3D4e5"]
    mapped = [mistral_call_id(s) for s in sent]
    assert all(MISTRAL_ID.fullmatch(m) for m in mapped)
    assert len(set(mapped)) == len(mapped)


def _conversation(call_ids: list[str], answered: str) -> list[dict]:
    arguments = {"city": "oslo"}
    calls = [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        for i in call_ids
    ]
    return [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": answered},
    ]


def test_returned_ids_map_for_mistral_alike_in_calls_and_tool_messages():
    sent = _conversation(["call_abc123", "a1B2c3D4e"], "call_abc123")
    before = copy.deepcopy(sent)
    mapped = template_call_ids(sent, "mistral")
    assert sent == before  # the request's messages are left as they were
    assert mapped == _conversation(["HIRFpb2pt", "a1B2c3D4e"], "HIRFpb2pt")


@pytest.mark.parametrize("parser", [None, *(p for p in PARSERS if p != "mistral")])
def test_other_parsers_send_ids_back_as_given(parser):
    sent = _conversation(["call_abc123", "x"], "call_abc123")
    assert json.dumps(template_call_ids(sent, parser)) == json.dumps(sent)
