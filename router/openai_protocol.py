"""OpenAI-compatible request bodies, validated once; every problem is an `InvalidRequest`.

Unknown fields are ignored (clients send many optional ones); fields we cannot honour
(best_of other than n, suffix, and the vLLM fields of
`body_checks.UNHONOURED_*`: use_beam_search, bad_words, ...) are refused unless they hold
their neutral value, with a message naming what is allowed. response_format,
structured_outputs and guided_* ask for structured outputs (`router.structured_request`);
chat's tools, tool_choice and parallel_tool_calls for tool calls (`router.tools`). logit_bias and the
presence / frequency penalties are OpenAI's; top_k, min_p, repetition_penalty,
allowed_token_ids and prompt_logprobs are vLLM's extensions (top_k -1 = off, as 0), as are
include_stop_str_in_output, skip_special_tokens and truncate_prompt_tokens; n is
1 to MAX_N choices. Strings must be Unicode text
(no lone surrogates). Types are strict: "2" is not an integer and "yes" is not a boolean.
Ranges of the sampling fields are `SamplingParams`'s, shared with gRPC and the offline
runner.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from replica.logit_bias import bad_token_key, logit_bias_of_json
from replica.sampling_params import SamplingParams
from replica.structured_spec import StructuredOutput
from router.body_checks import (
    COMPLETION_MAX_TOKENS,
    UNHONOURED_CHAT,
    UNHONOURED_COMPLETION,
    check_cache_salt,
    check_content,
    check_max_tokens,
    check_prompt_count,
    check_stop,
    check_top_count,
    only_neutral,
    refuse_unhonoured,
)
from router.chat_options import ChatTemplateFields
from router.choices import batch_of, check_fan_out, check_n, check_prompt
from router.structured_request import STRUCTURED_FIELDS, StructuredBody
from router.tools import ToolPlan, forcing_grammar, plan_of

# A JSON integer still fits a float field; nothing else is coerced.
BODY_CONFIG = ConfigDict(extra="ignore", strict=True)


TopCount = Annotated[int | None, AfterValidator(check_top_count)]
"""How many most likely tokens to return per position (0..MAX_TOP_LOGPROBS)."""
PromptCount = Annotated[int | None, AfterValidator(check_prompt_count)]
"""prompt_logprobs k: TopCount, with vLLM's -1 (the whole vocabulary) refused by name."""


def _token_keys(bias: dict[str, float]) -> dict[str, float]:
    problem = bad_token_key(bias)
    if problem is not None:
        raise ValueError(problem)
    return bias


LogitBias = Annotated[dict[str, float], AfterValidator(_token_keys)]
"""OpenAI's logit_bias: token ids as decimal strings -> bias (ranges: SamplingParams)."""


class StreamOptions(BaseModel):
    model_config = BODY_CONFIG

    include_usage: bool = False
    """Send a last chunk with usage counts (and no choices)."""


class _Sampling(StructuredBody):
    model_config = BODY_CONFIG

    model: str = Field(min_length=1)
    """Adapter name, or the base model's served name."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """Extension (as in vLLM): keep the k most likely tokens; 0 or -1 = off."""
    seed: int | None = None
    stop: Annotated[str | list[str] | None, BeforeValidator(check_stop)] = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, AfterValidator(check_n)] = 1
    """Choices to sample (1..MAX_N), each an engine request of its own (router/choices.py)."""
    cache_salt: Annotated[str | None, AfterValidator(check_cache_salt)] = None
    """Extension (as in vLLM): share prefix-cache blocks only with requests of this salt."""
    ignore_eos: bool = False
    """Extension (as in vLLM): keep generating past EOS (benchmarks)."""
    stop_token_ids: list[int] = []
    """Extension (as in vLLM): token ids that end the choice (its text leaves them out)."""
    min_tokens: int = 0
    """Extension (as in vLLM): tokens to generate before EOS, stop_token_ids or stop
    strings may end the choice."""
    logit_bias: LogitBias = {}
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """Extension (as in vLLM): penalise every token of the prompt and output; 1 = off."""
    min_p: float = 0.0
    """Extension (as in vLLM): drop tokens less likely than min_p x the most likely; 0 = off."""
    allowed_token_ids: list[int] | None = None
    """Extension (as in vLLM): the only token ids the choice may sample."""
    best_of: int | None = None
    """Samples to draw, of which the n best are returned: only n itself (or null). Chat
    takes it too, as vLLM's does: ignoring it would change what the client gets."""
    prompt_logprobs: PromptCount = None
    """Extension (as in vLLM): k, score the prompt: each prompt token's logprob given the
    tokens before it, its rank and the k most likely tokens there (`router.prompt_logprobs`).
    Not streamed, as in vLLM: k > 0 with stream is refused, 0 with stream returns nothing."""
    include_stop_str_in_output: bool = False
    """Extension (as in vLLM): the text keeps the stop string (or stop token) that ended
    it (`SamplingParams.include_stop_str_in_output`)."""
    skip_special_tokens: bool = True
    """Extension (as in vLLM): false keeps special tokens in the text (and a token-id or
    truncated prompt's echo)."""
    truncate_prompt_tokens: int | None = None
    """Extension (as in vLLM): keep only the prompt's last k tokens (-1: the model's
    context length), after tokenization and the chat template; usage, echo and
    prompt_logprobs then show the kept tokens (ranges: SamplingParams)."""

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> Self:
        if self.stream and self.prompt_logprobs:
            raise ValueError(
                f"prompt_logprobs: got {self.prompt_logprobs} with stream: true; allowed: "
                "null or 0 with stream: true (prompt logprobs are not streamed, as in vLLM)"
            )
        return self

    @property
    def returns_prompt_logprobs(self) -> bool:
        """Whether the response carries prompt_logprobs (never a stream's)."""
        return self.prompt_logprobs is not None and not self.stream

    def _scoring(self, params: SamplingParams, echo_k: int | None = None) -> SamplingParams:
        """params asking the engine for the prompt's scores when the response shows them:
        as prompt_logprobs and (echo_k) as an echo's logprobs, with the larger k."""
        shown = self.prompt_logprobs if self.returns_prompt_logprobs else None
        ks = [k for k in (echo_k, shown) if k is not None]
        return dataclasses.replace(params, prompt_logprobs=max(ks)) if ks else params

    @model_validator(mode="after")
    def _best_of_is_n(self) -> Self:
        if self.best_of is None or self.best_of == self.n:
            return self
        raise ValueError(
            f"best_of: {self.best_of} with n = {self.n}; allowed: null or {self.n}, the value "
            "of n (not supported)"
        )

    unhonoured: ClassVar[dict] = {}
    """Fields outside the model refused unless neutral (`body_checks.UNHONOURED_SAMPLING`)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unhonoured(cls, body: object) -> object:
        return refuse_unhonoured(body, cls.unhonoured)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, body: object) -> object:
        # OpenAI and vLLM read `"field": null` as "not given"
        if isinstance(body, dict):
            return {k: v for k, v in body.items() if v is not None}
        return body

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: allowed only with stream: true")
        return self

    def sampling_params(self, max_tokens: int, logprobs: bool, top: int) -> SamplingParams:
        stop = () if self.stop is None else self.stop
        allowed = None if self.allowed_token_ids is None else tuple(self.allowed_token_ids)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            logprobs=logprobs,
            top_logprobs=top,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids),
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=logit_bias_of_json(self.logit_bias),
            min_p=self.min_p,
            allowed_token_ids=allowed,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.structured,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def max_tokens_sent(self) -> bool:
        """Whether the body set max_tokens (chat: or max_completion_tokens); null is unset."""
        return bool({"max_tokens", "max_completion_tokens"} & self.model_fields_set)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    unhonoured: ClassVar[dict] = UNHONOURED_COMPLETION

    prompt: Annotated[str | list[int] | list[str] | list[list[int]], BeforeValidator(check_prompt)]
    """A string, a list of token ids, or a batch of them (`router.choices.batch_of`)."""
    max_tokens: int = COMPLETION_MAX_TOKENS
    """Tokens to generate at most: >= 1, or 0 with echo or prompt_logprobs (the prompt
    only, to score it)."""
    logprobs: TopCount = None
    """k: return each sampled token's logprob and the k most likely tokens per position
    (with echo, each prompt token's too: `SamplingParams.prompt_logprobs`)."""
    echo: bool = False
    """Return the prompt before the completion, in `text` and (with logprobs) in the
    logprobs, whose first prompt token has a null logprob (OpenAI's legacy semantics)."""
    suffix: Annotated[str, only_neutral(lambda s: s == "", '"" or null')] = ""

    @model_validator(mode="after")
    def _fan_out(self) -> Self:
        check_fan_out(len(batch_of(self.prompt)), self.n)
        return self

    @model_validator(mode="after")
    def _max_tokens_zero_needs_echo(self) -> Self:
        scores = self.echo or self.prompt_logprobs is not None
        check_max_tokens(self.max_tokens, scores, "echo: true or prompt_logprobs set")
        return self

    def to_sampling_params(self) -> SamplingParams:
        params = self.sampling_params(
            self.max_tokens, self.logprobs is not None, self.logprobs or 0
        )
        return self._scoring(params, self.logprobs if self.echo else None)


class TextPart(BaseModel):
    model_config = BODY_CONFIG

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = BODY_CONFIG

    name: str
    arguments: str
    """JSON text of an object, as OpenAI sends a call's arguments (a template gets it parsed)."""

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError("not the JSON text of an object; allowed: a JSON object as text")
        return arguments


class ToolCall(BaseModel):
    """A call of an earlier assistant turn, as a response returned it."""

    model_config = BODY_CONFIG

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = BODY_CONFIG

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(check_content)] = None
    """null only in an assistant turn (OpenAI allows it there), read as an empty string."""
    tool_calls: list[ToolCall] | None = None
    """An assistant turn's calls (only there)."""
    tool_call_id: str | None = None
    """A tool turn's answer to this call (only there)."""

    @model_validator(mode="after")
    def _role_fields(self) -> Self:
        role = json.dumps(self.role)
        if self.content is None and self.role != "assistant":
            raise ValueError(
                f"content: null or missing in a {role} message; allowed: a string or a list "
                'of text parts (null only for role "assistant")'
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f'tool_calls: in a {role} message; allowed only for role "assistant"')
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f'tool_call_id: in a {role} message; allowed only for role "tool"')
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # one line per part, as vLLM joins them for a template that takes string content
        return "\n".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it: calls' arguments parsed into objects
        (templates write them with tojson), as vLLM and HF's tool templates expect."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": json.loads(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(ChatTemplateFields, _Sampling):
    """POST /v1/chat/completions."""

    unhonoured: ClassVar[dict] = UNHONOURED_CHAT

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """Newer name of max_tokens; either may be given."""
    logprobs: bool = False
    top_logprobs: TopCount = None
    """k: the k most likely tokens at each position (needs logprobs: true)."""
    echo: Annotated[bool, only_neutral(lambda e: e is False, "false or null")] = False
    """vLLM's chat echo (the last message before the reply) is not supported: refused
    unless false, as ignoring it would change what the client gets."""
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    """tools / tool_choice / parallel_tool_calls: read into `tool_plan` (`router.tools`)."""
    _tool_plan: ToolPlan = PrivateAttr(default=ToolPlan((), "none"))
    _tool_grammar: StructuredOutput | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _read_tools(self) -> Self:
        plan = plan_of(self.tools, self.tool_choice, self.parallel_tool_calls)
        grammar = forcing_grammar(plan, self.tool_choice, super().structured, STRUCTURED_FIELDS)
        self._tool_plan, self._tool_grammar = plan, grammar
        return self

    @property
    def tool_plan(self) -> ToolPlan:
        return self._tool_plan

    @property
    def structured(self) -> StructuredOutput | None:
        """The body's structured output, or the grammar that forces its tool call."""
        return super().structured or self._tool_grammar

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """default_max_tokens: used when neither max_tokens field is given (as vLLM does,
        the room the prompt leaves in the model's context)."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        params = self.sampling_params(
            default_max_tokens if max_tokens is None else max_tokens,
            self.logprobs,
            self.top_logprobs or 0,
        )
        return self._scoring(params)

    def chat_dicts(self) -> list[dict[str, Any]]:
        """Messages as the tokenizer's chat template expects them."""
        return chat_dicts(self.messages)


def chat_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the tokenizer's chat template expects them (chat and /tokenize)."""
    return [m.template_dict() for m in messages]
