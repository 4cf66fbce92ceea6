"""Body checks beyond pydantic's types: Unicode text, unsupported fields, `param`."""

import pickle

import pytest

from lora_core.errors import InvalidRequest
from router.body_checks import TEXT_ALLOWED
from router.errors import openai_error_body
from router.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_body

LONE = "\ud800"
USER = [{"role": "user", "content": "x"}]


def completion(**fields) -> dict:
    return {"model": "a", "prompt": "x", **fields}


def chat(**fields) -> dict:
    return {"model": "a", "messages": USER, **fields}


@pytest.mark.parametrize(
    "model, body, param, index",
    [
        (CompletionRequest, completion(prompt=LONE), "prompt", 0),
        (CompletionRequest, completion(prompt=f"ok{LONE}", stream=True), "prompt", 2),
        (CompletionRequest, completion(stop=["a", f"b{LONE}"]), "stop.1", 1),
        (CompletionRequest, completion(user=LONE), "user", 0),
        (ChatCompletionRequest, chat(messages=[{"role": "user", "content": LONE}]), None, 0),
        (
            ChatCompletionRequest,
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
            "messages.0.content.0.text",
            0,
        ),
        (CompletionRequest, completion(**{f"k{LONE}": 1}), "body", 1),
    ],
)
def test_lone_surrogates_are_refused_where_they_are(model, body, param, index):
    param = "messages.0.content" if param is None else param
    with pytest.raises(InvalidRequest) as e:
        parse_body(model, body)
    assert str(e.value) == (
        f"{param}: not valid Unicode text (lone surrogate \\ud800 at index {index}); {TEXT_ALLOWED}"
    )
    assert e.value.param == param


def test_the_json_escape_of_a_lone_surrogate_is_refused_but_a_pair_is_text():
    with pytest.raises(InvalidRequest, match="^prompt: not valid Unicode text"):
        parse_body(CompletionRequest, b'{"model": "a", "prompt": "\\ud800", "max_tokens": 2}')
    req = parse_body(CompletionRequest, b'{"model": "a", "prompt": "\\ud83d\\ude00"}')
    assert req.prompt == "\U0001f600"


@pytest.mark.parametrize(
    "model, body, message",
    [
        (CompletionRequest, completion(logit_bias={"5": 1}), "logit_bias: {'5': 1.0}; allowed: {}"),
        (CompletionRequest, completion(presence_penalty=0.5), "presence_penalty: 0.5; allowed: 0"),
        (ChatCompletionRequest, chat(frequency_penalty=-2), "frequency_penalty: -2.0; allowed: 0"),
        (CompletionRequest, completion(presence_penalty=3), "presence_penalty: 3.0; allowed: 0"),
        (
            ChatCompletionRequest,
            chat(response_format={"type": "json_object"}),
            "response_format: {'type': 'json_object'}; allowed: {\"type\": \"text\"} or null",
        ),
        (
            ChatCompletionRequest,
            chat(tools=[{"type": "function", "function": {"name": "f"}}]),
            "tools: [{'type': 'function', 'function': {'name': 'f'}}]; allowed: [] or null",
        ),
        (ChatCompletionRequest, chat(tool_choice="required"), "tool_choice: 'required'; allowed"),
        (
            ChatCompletionRequest,
            chat(tool_choice="auto", tools=[{"type": "function"}]),
            "tools: ",
        ),
    ],
)
def test_fields_that_would_change_output_are_refused(model, body, message):
    with pytest.raises(InvalidRequest) as e:
        parse_body(model, body)
    assert str(e.value).startswith(message)
    assert str(e.value).endswith("(not supported)")
    assert e.value.param == message.split(":")[0]


@pytest.mark.parametrize(
    "model, body",
    [
        (CompletionRequest, completion(logit_bias={}, presence_penalty=0, frequency_penalty=0.0)),
        (CompletionRequest, completion(logit_bias=None, presence_penalty=None)),
        (ChatCompletionRequest, chat(response_format={"type": "text"}, tools=[])),
        (ChatCompletionRequest, chat(response_format={}, tools=None, tool_choice="none")),
        (ChatCompletionRequest, chat(tool_choice="auto")),
        (ChatCompletionRequest, chat(tool_choice=None, response_format=None)),
    ],
)
def test_neutral_values_clients_send_by_default_are_accepted(model, body):
    parse_body(model, body)


@pytest.mark.parametrize(
    "body, param",
    [
        (completion(max_tokens="x"), "max_tokens"),
        (completion(prompt=["a"]), "prompt"),
        ({"prompt": "x"}, "model"),
        (completion(stream_options={}), "stream_options"),
        (b"{not json", None),
    ],
)
def test_param_names_the_field(body, param):
    with pytest.raises(InvalidRequest) as e:
        parse_body(CompletionRequest, body)
    assert openai_error_body(e.value)["error"]["param"] == param


def test_param_survives_pickling():
    err = pickle.loads(pickle.dumps(InvalidRequest("top_p: bad", "top_p")))
    assert (type(err), str(err), err.param) == (InvalidRequest, "top_p: bad", "top_p")
    assert openai_error_body(err)["error"]["param"] == "top_p"
