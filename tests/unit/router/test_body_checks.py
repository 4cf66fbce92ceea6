"""Body checks beyond pydantic's types: Unicode text, unsupported fields, `param`."""

import pickle
from types import UnionType
from typing import Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from lora_core.errors import AdapterLoadFailed, InvalidRequest
from replica.structured_spec import too_deep
from router.admin_bodies import LoadAdapterRequest
from router.body_checks import (
    CONTENT_ALLOWED,
    DEPTH_ALLOWED,
    MAX_DEPTH,
    NUMBER_TOO_LONG,
    STOP_ALLOWED,
    TEXT_ALLOWED,
)
from router.body_parse import parse_body
from router.errors import openai_error_body
from router.openai_protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

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
        (CompletionRequest, completion(suffix="tail"), 'suffix: got "tail"; allowed: "" or null'),
        (ChatCompletionRequest, chat(echo=True), "echo: got true; allowed: false or null"),
        (CompletionRequest, completion(best_of=2), "best_of: 2 with n = 1; allowed: null or 1"),
        (
            CompletionRequest,
            completion(best_of=1, n=3),
            "best_of: 1 with n = 3; allowed: null or 3",
        ),
        (ChatCompletionRequest, chat(best_of=2), "best_of: 2 with n = 1; allowed: null or 1"),
        (CompletionRequest, completion(use_beam_search=True), "use_beam_search: got true"),
        (
            CompletionRequest,
            completion(return_tokens_as_token_ids=True),
            "return_tokens_as_token_ids: got",
        ),
        (ChatCompletionRequest, chat(bad_words=["x"]), 'bad_words: got ["x"]'),
        (ChatCompletionRequest, chat(functions=[{"name": "f"}]), "functions: got [{"),
        (ChatCompletionRequest, chat(function_call={"name": "f"}), "function_call: got {"),
        (ChatCompletionRequest, chat(modalities=["text", "audio"]), "modalities: got ["),
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
        (CompletionRequest, completion(echo=False, suffix="", best_of=1, n=1)),
        (CompletionRequest, completion(echo=None, suffix=None, best_of=None, n=None)),
        (CompletionRequest, completion(best_of=3, n=3)),
        (ChatCompletionRequest, chat(response_format={"type": "text"}, tools=[])),
        (ChatCompletionRequest, chat(best_of=2, n=2)),
        (ChatCompletionRequest, chat(best_of=None, n=1)),
        (ChatCompletionRequest, chat(response_format={}, tools=None, tool_choice="none")),
        (ChatCompletionRequest, chat(tool_choice="auto")),
        (ChatCompletionRequest, chat(tool_choice=None, response_format=None)),
        (CompletionRequest, completion(min_p=0, use_beam_search=False, skip_special_tokens=True)),
        (CompletionRequest, completion(min_p=0.0, prompt_logprobs=None, response_format=None)),
        (CompletionRequest, completion(bad_words=[], guided_json=None, structured_outputs=None)),
        (ChatCompletionRequest, chat(functions=[], function_call="none", modalities=["text"])),
        (ChatCompletionRequest, chat(add_generation_prompt=True, continue_final_message=False)),
        (ChatCompletionRequest, chat(chat_template_kwargs={}, include_stop_str_in_output=False)),
    ],
)
def test_neutral_values_clients_send_by_default_are_accepted(model, body):
    parse_body(model, body)


@pytest.mark.parametrize(
    "body, param",
    [
        (completion(max_tokens="x"), "max_tokens"),
        (completion(prompt=[["a"]]), "prompt"),
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


def test_any_error_can_name_the_field_at_fault():
    err = AdapterLoadFailed("path='/x' does not exist")
    assert openai_error_body(err)["error"]["param"] is None
    err.param = "lora_path"
    err = pickle.loads(pickle.dumps(err))
    assert openai_error_body(err)["error"] == {
        "message": "path='/x' does not exist", "type": "invalid_request_error",
        "param": "lora_path", "code": "adapter_load_failed",
    }  # fmt: skip


def user(content) -> dict:
    return chat(messages=[{"role": "user", "content": content}])


IMAGE = {"type": "image_url", "image_url": {"url": "http://x"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}


@pytest.mark.parametrize(
    "body, param, problem",
    [
        (user([IMAGE]), "messages.0.content.0.type", 'a part of type "image_url"'),
        (user([{"type": "text", "text": "a"}, AUDIO]), "messages.0.content.1.type", None),
        (user([{"text": "a"}]), "messages.0.content.0.type", "a part without a type"),
        (user(["a"]), "messages.0.content.0", "got a string, not a part"),
        (user(5), "messages.0.content", "got a number"),
        (user({"type": "text", "text": "a"}), "messages.0.content", "got an object"),
    ],
)
def test_content_is_text_only_and_says_so(body, param, problem):
    with pytest.raises(InvalidRequest) as e:
        parse_body(ChatCompletionRequest, body)
    problem = problem or 'a part of type "input_audio"'
    assert str(e.value) == f"{param}: {problem}; {CONTENT_ALLOWED}"
    assert CONTENT_ALLOWED == (
        'allowed: content as a string or a list of {"type": "text", "text": "..."} parts '
        "(only text: image, audio and file parts are not supported)"
    )
    assert openai_error_body(e.value)["error"]["param"] == param


@pytest.mark.parametrize(
    "part, message",
    [
        ({"type": "text"}, "messages.0.content.0.text: missing; allowed: a string"),
        ({"type": "text", "text": 3}, "messages.0.content.0.text: got a number; allowed: a string"),
    ],
)
def test_a_text_part_needs_its_text(part, message):
    with pytest.raises(InvalidRequest) as e:
        parse_body(ChatCompletionRequest, user([part]))
    assert (str(e.value), e.value.param) == (message, message.split(":")[0])


@pytest.mark.parametrize(
    "model, body, message",
    [
        (CompletionRequest, completion(stop=5), f"stop: got a number; {STOP_ALLOWED}"),
        (CompletionRequest, completion(stop=["a", 5]), f"stop.1: got a number; {STOP_ALLOWED}"),
        (ChatCompletionRequest, chat(stop={"a": 1}), f"stop: got an object; {STOP_ALLOWED}"),
        (ChatCompletionRequest, chat(tool_choice=5), 'tool_choice: got 5; allowed: "none"'),
        (
            ChatCompletionRequest,
            chat(messages=["hi"]),
            "messages.0: got a string; allowed: an object",
        ),
        (
            CompletionRequest,
            completion(stream_options=1),
            "stream_options: got a number; allowed: an",
        ),
    ],
)
def test_union_and_object_fields_say_what_is_allowed(model, body, message):
    with pytest.raises(InvalidRequest) as e:
        parse_body(model, body)
    assert str(e.value).startswith(message)
    assert e.value.param == message.split(":")[0]


def _union_fields(model: type[BaseModel]) -> list[str]:
    """Fields whose type is a union of several non-null types (str | list[...], ...)."""
    unions = {
        name: get_args(field.annotation)
        for name, field in model.model_fields.items()
        if get_origin(field.annotation) in (Union, UnionType)
    }
    return [name for name, members in unions.items() if len(set(members) - {type(None)}) > 1]


VALID = {
    CompletionRequest: completion(),
    ChatCompletionRequest: chat(),
    ChatMessage: {"role": "user", "content": "x"},
    LoadAdapterRequest: {"lora_name": "a", "lora_path": "/x"},
}


@pytest.mark.parametrize("model, field", [(m, f) for m in VALID for f in _union_fields(m)], ids=str)
def test_no_union_field_leaks_pydantic_member_names(model, field):
    # a float fits none of these unions: the refusal must name the field, not its members
    with pytest.raises(InvalidRequest) as e:
        parse_body(model, {**VALID[model], field: 0.5})
    message = str(e.value)
    assert e.value.param == field and message.startswith(f"{field}: ")
    assert "allowed: " in message and "more)" not in message and f"{field}." not in message


def test_every_union_field_is_covered():
    assert {(m.__name__, f) for m in VALID for f in _union_fields(m)} == {
        ("CompletionRequest", "stop"),
        ("CompletionRequest", "prompt"),
        ("ChatCompletionRequest", "stop"),
        ("ChatMessage", "content"),
    }


@pytest.mark.parametrize(
    "value, limit, deep",
    [({"a": [[1]]}, 3, False), ({"a": [[1]]}, 2, True), ([], 1, False), ("x" * 9, 0, False)],
)
def test_too_deep_counts_arrays_and_objects(value, limit, deep):
    assert too_deep(value, limit) is deep


@pytest.mark.parametrize("model", [CompletionRequest, LoadAdapterRequest])
@pytest.mark.parametrize(
    "depth, message",
    [
        (63, None),  # the body object + 63 arrays: 64 levels
        (64, f"body: nested more than {MAX_DEPTH} levels; {DEPTH_ALLOWED}"),
        (500, f"body: nested more than {MAX_DEPTH} levels; {DEPTH_ALLOWED}"),
        (200_000, f"body: nested too deeply; {DEPTH_ALLOWED}"),  # json's own recursion limit
    ],
)
def test_deeply_nested_bodies_are_400_not_500(model, depth, message):
    fields = '"model": "m", "prompt": "x", "lora_name": "a", "lora_path": "/x"'
    body = f'{{{fields}, "extra": {"[" * depth}{"]" * depth}}}'.encode()
    if message is None:
        parse_body(model, body)
        return
    with pytest.raises(InvalidRequest) as e:
        parse_body(model, body)
    assert (str(e.value), e.value.param) == (message, None)


@pytest.mark.parametrize("field", ["n", "max_tokens", "extra"])
def test_a_number_too_long_for_python_is_400_not_500(field):
    # json.loads raises a plain ValueError (no JSONDecodeError) for an integer of more than
    # sys.get_int_max_str_digits() digits: it was a 500 "internal error (ValueError)"
    body = f'{{"model": "m", "prompt": "x", "{field}": {"1" * 5000}}}'.encode()
    with pytest.raises(InvalidRequest) as e:
        parse_body(CompletionRequest, body)
    assert (str(e.value), e.value.param) == (f"body: {NUMBER_TOO_LONG}", None)


@pytest.mark.parametrize(
    "model, body", [(CompletionRequest, completion()), (ChatCompletionRequest, chat())]
)
def test_min_p_and_allowed_token_ids_reach_sampling_params(model, body):
    """vLLM's min_p and allowed_token_ids (refused as unsupported before) are honoured:
    null is off, repeats in the list count once."""

    def params(**fields):
        request = parse_body(model, {**body, **fields})
        return (
            request.to_sampling_params(16)
            if model is ChatCompletionRequest
            else (request.to_sampling_params())
        )

    p = params(min_p=0.1, allowed_token_ids=[9, 2, 9])
    assert (p.min_p, p.allowed_token_ids) == (0.1, (2, 9))
    p = params(min_p=None, allowed_token_ids=None)
    assert (p.min_p, p.allowed_token_ids) == (0.0, None)
    for fields, param, message in [
        ({"min_p": 1.5}, "min_p", "min_p=1.5; allowed: a number 0 <= min_p <= 1 (0 = off)"),
        ({"min_p": -0.1}, "min_p", "min_p=-0.1; allowed"),
        ({"min_p": "0.1"}, "min_p", "min_p: got a string; allowed: a number"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids: an empty list"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids", "allowed_token_ids: token id -2; "),
        ({"allowed_token_ids": [True]}, "allowed_token_ids.0", "allowed_token_ids.0: got a"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            params(**fields)
        assert str(e.value).startswith(message) and e.value.param == param, fields
