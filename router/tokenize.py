"""vLLM's `POST /tokenize` and `POST /detokenize`: the served tokenizer, for clients that
count a prompt's tokens or fit it to the context before sending it.

Bodies as vLLM's: /tokenize takes `prompt` (a string; `add_special_tokens`, default
true) or `messages` (rendered by the chat template as /v1/chat/completions renders them;
`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` and `tools` as
chat takes them), and `return_token_strs`; it answers
{"count", "max_model_len", "tokens", "token_strs"}. /detokenize takes `tokens` and
answers {"prompt"}. `model` is optional (the base model); when given it is resolved as on
the inference routes, so an unknown or forbidden adapter is the same 404. With auth on a
valid key is needed either way, and each call counts as one request against the tenant's
rate limit: both are checked (`Frontend.admit`) before the tokenizer runs, so a bad key
or a tenant past its limit costs no tokenizing. Every adapter shares the base model's
tokenizer.
"""

from __future__ import annotations

from typing import Annotated, Any, Self

from pydantic import BaseModel, Field, PrivateAttr, model_validator
from starlette.responses import JSONResponse, Response

from replica.serve_protocol import check_prompt_ids
from router.body_checks import only_neutral
from router.body_parse import parse_request
from router.chat_options import ChatTemplateFields
from router.frontend import Frontend
from router.openai_protocol import BODY_CONFIG, ChatMessage, chat_dicts
from router.rest import error_response, refusal
from router.tools import Tool, tools_of


class TokenizeRequest(ChatTemplateFields):
    """POST /tokenize: exactly one of prompt and messages."""

    model_config = BODY_CONFIG

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    """Default true for a prompt (vLLM's); a chat template adds its own special tokens,
    so with messages only false (the default) is taken."""
    return_token_strs: bool = False
    chat_template: Annotated[Any, only_neutral(lambda v: v is None, "null")] = None
    tools: Any = None
    """With messages: the tools the chat template renders, as chat's `tools`."""
    _tools: tuple[Tool, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _one_input(self) -> Self:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("body: give exactly one of prompt (a string) and messages")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError(
                "add_special_tokens: true with messages; allowed: false or absent (the chat "
                "template adds the model's special tokens itself)"
            )
        if self.tools is not None and self.messages is None:
            raise ValueError("tools: given with prompt; allowed: tools only with messages")
        self._tools = tools_of(self.tools) if self.tools is not None else ()
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.template_dict() for t in self._tools] or None


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = BODY_CONFIG

    model: str | None = None
    tokens: list[int]


async def tokenize(front: Frontend, api_key: str | None, body: bytes) -> Response:
    """The /tokenize answer for a raw body: the tokens, or the error JSON (a bad body
    answers 401 first when the key is bad too, as the inference routes do)."""
    try:
        req = await parse_request(TokenizeRequest, body)
    except Exception as e:
        return await refusal(front, api_key, e)
    try:
        await _admit(front, api_key, req.model)
        if req.messages is not None:
            ids = await front.encode_chat(
                chat_dicts(req.messages), req.template_tools(), req.template_options()
            )
        else:
            ids = await front.encode_text(req.prompt, req.add_special_tokens is not False)
    except Exception as e:
        return error_response(e)
    tokens = list(ids)
    strs = front.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
    return JSONResponse(
        {
            "count": len(tokens),
            "max_model_len": front.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }
    )


async def detokenize(front: Frontend, api_key: str | None, body: bytes) -> Response:
    """The /detokenize answer for a raw body: the text of the tokens, or the error JSON."""
    try:
        req = await parse_request(DetokenizeRequest, body)
    except Exception as e:
        return await refusal(front, api_key, e)
    try:
        await _admit(front, api_key, req.model)
        check_prompt_ids(req.tokens, front.vocab_size, "tokens")
        text = await front.decode(req.tokens)
    except Exception as e:
        return error_response(e)
    return JSONResponse({"prompt": text})


async def _admit(front: Frontend, api_key: str | None, model: str | None) -> None:
    """The key, the tenant's limit and `model` (the base model when absent), checked as
    inference checks them; `model`'s 404 too, at once (no length check comes after)."""
    admitted = await front.admit(api_key, front.resolver.base_name if model is None else model)
    admitted.resolution()
