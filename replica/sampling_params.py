"""Per-request sampling parameters, validated once at construction.

These checks are the one rule set for sampling fields: REST, gRPC and the offline
runner all build a `SamplingParams`, so every front door accepts the same ranges and
answers with the same messages. The limits and shared checks live in
`replica.sampling_checks`, logit_bias's in `replica.logit_bias` and
truncate_prompt_tokens' in `replica.prompt_truncation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from lora_core.errors import InvalidRequest
from replica.logit_bias import checked_bias
from replica.prompt_truncation import Seq, check_truncate, kept_prompt
from replica.sampling_checks import (
    ALLOWED_TOKEN_IDS_ALLOWED,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRUCTURED_AFTER,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    SHORT,
    STOP_TOKEN_IDS_ALLOWED,
    checked_min_p,
    checked_penalty,
    checked_repetition_penalty,
    checked_stop,
    is_int,
    token_ids,
)
from replica.structured_spec import StructuredOutput


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    max_tokens: tokens to generate at most (>= 1; 0 runs only the prompt, e.g. to score
        it with prompt_logprobs, and finishes with "length").
    temperature: 0 means greedy; otherwise logits are divided by it (0 <= t <= 2, OpenAI's range).
    top_p: nucleus mass kept (0 < p <= 1).
    top_k: keep the k most likely tokens (0 = off; -1, vLLM's "off", is read as 0).
    min_p: vLLM / HF's (0 <= p <= 1, 0 = off): a non-greedy row drops the tokens whose
        probability (after temperature) is below min_p x its most likely token's, before
        top_k and top_p (vLLM v1's order); greedy rows ignore it.
    seed: per-request seed (signed 64-bit); the same seed and inputs reproduce the same tokens.
    stop: strings that end generation (the stop string is not included in the text,
        unless include_stop_str_in_output).
    stop_token_ids: token ids that end generation (besides the tokenizer's EOS); at most
        MAX_STOP_TOKEN_IDS (the engine checks them against its vocabulary).
    min_tokens: tokens to generate at least (0 <= min_tokens <= max_tokens, vLLM's): until
        then EOS and stop_token_ids are not sampled (their logits are -inf) and stop
        strings are not looked for.
    ignore_eos: keep going past EOS (benchmarks).
    logprobs: return the log-probability of each sampled token.
    top_logprobs: also return the k most likely tokens at each sampled position
        (0 <= k <= MAX_TOP_LOGPROBS; k > 0 needs logprobs).
    prompt_logprobs: None (off), or k (0 <= k <= MAX_TOP_LOGPROBS): return the logprob of
        every prompt token after the first under the model's raw distribution at the
        position before it, with the k most likely tokens there (vLLM's prompt_logprobs;
        what OpenAI's echo + logprobs shows). The request then computes its whole prompt
        itself: prefix-cache hits carry no logits.
    presence_penalty, frequency_penalty: OpenAI's penalties (-2 <= x <= 2), on the tokens
        generated so far: logit[j] -= presence * (count_j > 0) + frequency * count_j.
    repetition_penalty: vLLM / HF's (0 < p <= MAX_REPETITION_PENALTY, 1 = off), on every
        token of the prompt or the output: a positive logit is divided by p, another
        multiplied by it.
    logit_bias: ((token id, bias), ...) sorted by id, each id once; logit[id] += bias
        (-100 <= bias <= 100, at most 300 ids; the engine checks ids against its vocabulary).
    allowed_token_ids: None (off), or vLLM's: the only tokens the row may sample (greedy
        or not; every other logit is -inf), as sorted distinct ids (repeats in the given
        list are dropped, as vLLM accepts them; at most MAX_ALLOWED_TOKEN_IDS given; the
        engine checks ids against its vocabulary).
    See replica/logits_processors.py for the order they apply in.
    structured_outputs: None, or what the output must match (a JSON schema, a regular
        expression, ...: `replica.structured`); its mask applies after all of the above.
        Not with min_tokens or ignore_eos (the grammar ends the output).
    structured_after: () (the grammar applies from the first generated token), or token
        ids (at most MAX_STRUCTURED_AFTER; needs structured_outputs) after which it starts:
        the output is free until the generated ids first end with them (a reasoning
        model's "</think>", `router.frontend.Frontend.thinking_first`), and the grammar
        holds every token after them. An output that never writes them is never held to
        the grammar (vLLM's rule for reasoning models).
    include_stop_str_in_output: vLLM's: the text keeps what ended it, up to the end of
        the first stop string to complete (not only up to the start of the first stop
        string), and the text of a last stop token (a stop_token_id, or EOS, whose text
        is "" unless skip_special_tokens is off); streamed text then holds nothing back.
    skip_special_tokens: vLLM's: False keeps special tokens (EOS generated with
        ignore_eos, ...) in the text, as the tokenizer's decode(skip_special_tokens=False)
        spells them. A last stop token's text is still left out without
        include_stop_str_in_output, as in vLLM.
    truncate_prompt_tokens: vLLM's left truncation: None (off), or k >= 1, keep only the
        prompt's last k tokens (after tokenization and any chat template; a BOS the
        tokenizer added is cut like any other token), or -1 for k = the model's context
        length; everything after it (usage, echo, prompt_logprobs) sees the kept tokens
        only (`kept_prompt`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] | None = None
    structured_outputs: StructuredOutput | None = None
    structured_after: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 0:
            raise InvalidRequest(
                f"max_tokens={self.max_tokens!r}; allowed: an integer >= 1, or 0 to run only "
                "the prompt",
                "max_tokens",
            )
        if not 0.0 <= float(self.temperature) <= MAX_TEMPERATURE:
            allowed = f"0 <= temperature <= {MAX_TEMPERATURE:g}"
            raise InvalidRequest(
                f"temperature={self.temperature!r}; allowed: {allowed}", "temperature"
            )
        if not 0.0 < float(self.top_p) <= 1.0:
            raise InvalidRequest(f"top_p={self.top_p!r}; allowed: 0 < top_p <= 1", "top_p")
        if not is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequest(
                f"top_k={self.top_k!r}; allowed: an integer >= 0 (0 = off), or -1 (off, as "
                "in vLLM)",
                "top_k",
            )
        object.__setattr__(self, "top_k", max(self.top_k, 0))
        if self.seed is not None and not (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequest(
                f"seed={self.seed!r}; allowed: null or an integer in {SEED_MIN} .. {SEED_MAX}"
                " (signed 64-bit)",
                "seed",
            )
        object.__setattr__(self, "stop", checked_stop(self.stop))
        self._check_stop_token_ids()
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                f"min_tokens={self.min_tokens!r} with max_tokens={self.max_tokens!r}; "
                "allowed: an integer 0 <= min_tokens <= max_tokens",
                "min_tokens",
            )
        self._check_top_logprobs()
        for name in ("presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, checked_penalty(name, getattr(self, name)))
        rep = checked_repetition_penalty(self.repetition_penalty)
        object.__setattr__(self, "repetition_penalty", rep)
        object.__setattr__(self, "logit_bias", checked_bias(self.logit_bias))
        object.__setattr__(self, "min_p", checked_min_p(self.min_p))
        self._check_allowed_token_ids()
        self._check_structured()
        check_truncate(self.truncate_prompt_tokens)

    def kept_prompt(self, ids: Seq, max_model_len: int) -> Seq:
        """The prompt ids the request runs with (`kept_prompt`)."""
        return kept_prompt(ids, self.truncate_prompt_tokens, max_model_len)

    def _check_structured(self) -> None:
        self._check_structured_after()
        spec = self.structured_outputs
        if spec is None:
            return
        if not isinstance(spec, StructuredOutput):
            raise InvalidRequest(
                f"structured_outputs: got {type(spec).__name__}; allowed: null or a StructuredOutput",
                "structured_outputs",
            )
        # the grammar decides where the output ends: EOS is its end, allowed only there
        if self.min_tokens:
            raise InvalidRequest(
                f"min_tokens={self.min_tokens} with structured outputs; allowed: 0 (the "
                "grammar decides where the output ends)",
                "min_tokens",
            )
        if self.ignore_eos:
            raise InvalidRequest(
                "ignore_eos: true with structured outputs; allowed: false (the grammar "
                "ends the output with EOS)",
                "ignore_eos",
            )

    def _check_structured_after(self) -> None:
        ids = token_ids(self.structured_after, MAX_STRUCTURED_AFTER)
        if ids is None:
            raise InvalidRequest(
                f"structured_after: got {SHORT.repr(self.structured_after)}; allowed: a list "
                f"of at most {MAX_STRUCTURED_AFTER} token ids (integers >= 0)",
                "structured_after",
            )
        if ids and self.structured_outputs is None:
            raise InvalidRequest(
                "structured_after: given without structured_outputs; allowed: empty (it "
                "says where a structured output starts)",
                "structured_after",
            )
        object.__setattr__(self, "structured_after", ids)

    def _check_stop_token_ids(self) -> None:
        ids = token_ids(self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        if ids is None:
            raise InvalidRequest(
                f"stop_token_ids: {STOP_TOKEN_IDS_ALLOWED}; got {SHORT.repr(self.stop_token_ids)}",
                "stop_token_ids",
            )
        object.__setattr__(self, "stop_token_ids", ids)

    def _check_top_logprobs(self) -> None:
        k = self.top_logprobs
        if not is_int(k) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs={k!r}; allowed: an integer 0 <= top_logprobs <= {MAX_TOP_LOGPROBS}",
                "top_logprobs",
            )
        if k and not self.logprobs:
            raise InvalidRequest(
                f"top_logprobs={k} needs logprobs; allowed: top_logprobs 0 without logprobs",
                "top_logprobs",
            )
        k = self.prompt_logprobs
        if k is not None and not (is_int(k) and 0 <= k <= MAX_TOP_LOGPROBS):
            raise InvalidRequest(
                f"prompt_logprobs={k!r}; allowed: null (off) or an integer 0 <= "
                f"prompt_logprobs <= {MAX_TOP_LOGPROBS}",
                "prompt_logprobs",
            )

    def _check_allowed_token_ids(self) -> None:
        ids = self.allowed_token_ids
        if ids is None or isinstance(ids, _CheckedIds):
            return
        problem = None
        if not isinstance(ids, list | tuple):
            problem = f"got {type(ids).__name__}"
        elif not ids:
            problem = "an empty list allows no token"
        elif len(ids) > MAX_ALLOWED_TOKEN_IDS:
            problem = f"{len(ids)} token ids"
        else:
            bad = [t for t in ids if not (is_int(t) and t >= 0)][:1]
            if bad:
                problem = f"token id {SHORT.repr(bad[0])}"
        if problem is not None:
            raise InvalidRequest(
                f"allowed_token_ids: {problem}; {ALLOWED_TOKEN_IDS_ALLOWED}", "allowed_token_ids"
            )
        object.__setattr__(self, "allowed_token_ids", _CheckedIds(sorted(set(ids))))

    @cached_property
    def allowed_array(self) -> np.ndarray:
        """int64 [k]: allowed_token_ids, converted once per request (the logits processor
        reads them every step); empty when they are off."""
        return np.asarray(self.allowed_token_ids or (), dtype=np.int64)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether a penalty needs the request's token history."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def processes_logits(self) -> bool:
        """Whether any of logit_bias, the penalties and allowed_token_ids changes this
        request's logits."""
        return bool(self.logit_bias) or self.penalised or self.allowed_token_ids is not None


class _CheckedIds(tuple):
    """allowed_token_ids checked and normalised once: `dataclasses.replace` (once per
    choice of n) hands them back to __post_init__, which then skips the check (about
    35 ms for 262144 ids, on the ingress's event loop)."""

    __slots__ = ()
