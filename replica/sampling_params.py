"""Per-request sampling parameters, validated once at construction.

These checks are the one rule set for sampling fields: REST, gRPC and the offline
runner all build a `SamplingParams`, so every front door accepts the same ranges and
answers with the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lora_core.errors import InvalidRequest

MAX_TEMPERATURE = 2.0
# Signed 64-bit: gRPC's seed is an int64, and torch.Generator.manual_seed, which also
# takes [2**63, 2**64), maps a negative seed s to 2**64 + s, so the wider range would
# let two seeds name one stream.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def is_int(x: object) -> bool:
    """An int that is not a bool (JSON's true is no integer here)."""
    return isinstance(x, int) and not isinstance(x, bool)


MAX_TOP_LOGPROBS = 20
"""Most alternatives returned per sampled token (OpenAI's chat limit, vLLM's default)."""
MAX_STOPS, MAX_STOP_CHARS = 16, 256
"""Stop strings per request and characters per stop string (OpenAI allows 4 strings).
The detokenizer checks every stop string against the text's tail on every step, under
the engine lock: unbounded, one request's stops (1000 of 2000 characters: 0.3 s a step)
stalled every request on its replica."""
STOP_ALLOWED = (
    f"allowed: a non-empty string or a list of at most {MAX_STOPS} non-empty strings, "
    f"each of at most {MAX_STOP_CHARS} characters"
)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    max_tokens: tokens to generate at most (>= 1).
    temperature: 0 means greedy; otherwise logits are divided by it (0 <= t <= 2, OpenAI's range).
    top_p: nucleus mass kept (0 < p <= 1).
    top_k: keep the k most likely tokens (0 = off).
    seed: per-request seed (signed 64-bit); the same seed and inputs reproduce the same tokens.
    stop: strings that end generation (the stop string is not included in the text).
    stop_token_ids: token ids that end generation (besides the tokenizer's EOS).
    ignore_eos: keep going past EOS (benchmarks).
    logprobs: return the log-probability of each sampled token.
    top_logprobs: also return the k most likely tokens at each sampled position
        (0 <= k <= MAX_TOP_LOGPROBS; k > 0 needs logprobs).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequest(
                f"max_tokens={self.max_tokens!r}; allowed: an integer >= 1", "max_tokens"
            )
        if not 0.0 <= float(self.temperature) <= MAX_TEMPERATURE:
            allowed = f"0 <= temperature <= {MAX_TEMPERATURE:g}"
            raise InvalidRequest(
                f"temperature={self.temperature!r}; allowed: {allowed}", "temperature"
            )
        if not 0.0 < float(self.top_p) <= 1.0:
            raise InvalidRequest(f"top_p={self.top_p!r}; allowed: 0 < top_p <= 1", "top_p")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequest(
                f"top_k={self.top_k!r}; allowed: an integer >= 0 (0 = off)", "top_k"
            )
        if self.seed is not None and not (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequest(
                f"seed={self.seed!r}; allowed: null or an integer in {SEED_MIN} .. {SEED_MAX}"
                " (signed 64-bit)",
                "seed",
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest(f"stop: {STOP_ALLOWED}", "stop")
        if len(self.stop) > MAX_STOPS:
            raise InvalidRequest(f"stop: {len(self.stop)} strings; {STOP_ALLOWED}", "stop")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"stop: a string of {len(longest)} characters; {STOP_ALLOWED}", "stop"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._check_top_logprobs()

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
