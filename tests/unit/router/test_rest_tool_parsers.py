"""tool_choice "auto" on REST chat over a real CPU engine (the handlers, a Frontend and an
AsyncEngine; no Ray), one Frontend per tool_call_parser: a regex makes the random model
write a call in the parser's format (the reader only reads the text); the stream's
deltas join into the whole response; a JSON call's (hermes, llama3_json, mistral) name
comes first, then its arguments in several deltas; a pythonic call comes whole; a Mistral
request keeps special tokens in its text."""

from __future__ import annotations

import pytest

from tests.unit.replica.engines import small_engine
from tests.unit.router.served_engine import served_frontend
from tests.unit.router.test_rest_text_options import post
from tests.unit.router.test_rest_tools import HERMES_REGEX, MESSAGES, calls_of, message_of
from tests.unit.router.test_tools import CLOCK, WEATHER, without_ids

CITY = r'"[a-z]{1,6}"'
REGEXES = {  # the call each parser's models write, and the content around it
    "hermes": (HERMES_REGEX, "Sure. "),
    "llama3_json": (r'\{"name": "get_weather", "parameters": \{"city": ' + CITY + r"\}\}", None),
    "mistral": (
        r'Sure\. \[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": '
        + CITY
        + r"\}\}\]",
        "Sure. ",
    ),
    "pythonic": (r"\[get_weather\(city=" + CITY + r"\)\]", None),
}


@pytest.fixture(scope="module")
def engine(llama_dir):
    return small_engine(llama_dir)


def _body(parser: str, **fields) -> dict:
    return {
        "messages": MESSAGES,
        "tools": [WEATHER, CLOCK],
        "structured_outputs": {"regex": REGEXES[parser][0]},
        "temperature": 0,
        "max_tokens": 160,
        **fields,
    }


@pytest.mark.parametrize("parser", sorted(REGEXES))
def test_auto_reads_each_parsers_calls_streamed_as_whole(engine, parser):
    with served_frontend(engine, tool_call_parser=parser) as front:
        status, whole = post(front, "chat", _body(parser))
        assert status == 200
        status, chunks = post(front, "chat", _body(parser, stream=True))
        assert status == 200
    message, finish = message_of(whole)
    assert without_ids(message_of(chunks)[0]) == without_ids(message)
    assert message["content"] == REGEXES[parser][1] and finish == "tool_calls"
    [(name, arguments)] = calls_of(message)
    assert name == "get_weather" and set(arguments) == {"city"}
    deltas = [c for k in chunks for ch in k["choices"] for c in ch["delta"].get("tool_calls", ())]
    assert deltas[0]["function"]["name"] == "get_weather"
    if parser == "pythonic":  # each call whole, once the ] after it arrived
        assert len(deltas) == 1
    else:  # the name first, then the arguments as they are generated
        assert deltas[0]["function"]["arguments"] == "" and len(deltas) > 2


def test_mistral_requests_keep_special_tokens_in_their_text(engine):
    # EOS is spelled in the text with include_stop_str_in_output once special tokens are
    # kept: after the array, it is content
    eos = engine.tokenizer.eos_token
    for parser, tail in (("mistral", eos), ("hermes", "")):
        with served_frontend(engine, tool_call_parser=parser) as front:
            status, whole = post(front, "chat", _body(parser, include_stop_str_in_output=True))
        assert status == 200
        assert message_of(whole)[0]["content"] == "Sure. " + tail


def test_a_mistral_named_call_keeps_the_id_it_wrote(engine):
    # [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}: the call's id is the one the model wrote, in
    # the response and on the stream's first delta of the call alike
    regex = r"\[TOOL_CALLS\]get_weather\[CALL_ID\]a1B2c3D4e\[ARGS\]\{\"city\": " + CITY + r"\}"
    body = {**_body("mistral"), "structured_outputs": {"regex": regex}}
    with served_frontend(engine, tool_call_parser="mistral") as front:
        status, whole = post(front, "chat", body)
        assert status == 200
        status, chunks = post(front, "chat", {**body, "stream": True})
        assert status == 200
    for message, finish in (message_of(whole), message_of(chunks)):
        [call] = message["tool_calls"]
        assert call["id"] == "a1B2c3D4e" and finish == "tool_calls"
        assert message["content"] is None and call["function"]["name"] == "get_weather"
