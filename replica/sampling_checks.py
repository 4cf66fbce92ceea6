"""Limits and value checks for sampling fields, shared by `SamplingParams` and the front
doors (REST and gRPC bodies, the offline runner's arguments), so each accepts the same
ranges and refuses with the same `allowed:` text."""

from __future__ import annotations

import reprlib

from lora_core.errors import InvalidRequest

MAX_TEMPERATURE = 2.0
# Signed 64-bit: gRPC's seed is an int64, and torch.Generator.manual_seed, which also
# takes [2**63, 2**64), maps a negative seed s to 2**64 + s, so the wider range would
# let two seeds name one stream.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def is_int(x: object) -> bool:
    """An int that is not a bool (JSON's true is no integer here)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """An int or float that is not a bool (NaN fails every range check after it)."""
    return isinstance(x, int | float) and not isinstance(x, bool)


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
SHORT = reprlib.Repr()
"""Refused values are echoed shortened by it: a 1M-token list must not become a
megabyte-long error message (here and in the offline runner's)."""
SHORT.maxlist = SHORT.maxtuple = 8
SHORT.maxstring = SHORT.maxother = SHORT.maxlong = 60
MAX_STOP_TOKEN_IDS = 64
"""Stop token ids per request (each is banned from sampling below min_tokens)."""
STOP_TOKEN_IDS_ALLOWED = (
    f"allowed: a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)"
)
MAX_PENALTY = 2.0
"""|presence_penalty| and |frequency_penalty| at most (OpenAI's range)."""
MAX_REPETITION_PENALTY = 2.0
"""repetition_penalty at most. vLLM only asks for > 0; the CTRL paper's 1.2 and HF's
advice of about 1.0-1.3 sit far below 2, which already halves every positive repeated
logit, so a larger value is almost surely a typo (20 for 1.2) and is refused."""
MAX_STRUCTURED_AFTER = 16
"""structured_after's token ids at most (a reasoning model's "</think>" is one)."""
MAX_ALLOWED_TOKEN_IDS = 262_144
"""allowed_token_ids entries per request at most: as many as the largest vocabularies
in use have tokens (Gemma 3's 262144); the engine refuses ids past its own vocabulary."""
ALLOWED_TOKEN_IDS_ALLOWED = (
    f"allowed: null (off) or a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} token ids "
    "(integers >= 0; a repeated id counts once)"
)


def checked_penalty(name: str, value: object) -> float:
    """presence_penalty or frequency_penalty (`name`) as a float; refuses one outside
    -MAX_PENALTY .. MAX_PENALTY."""
    if not (is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
        allowed = f"a number -{MAX_PENALTY:g} <= {name} <= {MAX_PENALTY:g} (0 = off)"
        raise InvalidRequest(f"{name}={value!r}; allowed: {allowed}", name)
    return float(value)


def checked_repetition_penalty(p: object) -> float:
    """repetition_penalty as a float; refuses one outside (0, MAX_REPETITION_PENALTY]."""
    if not (is_number(p) and 0.0 < p <= MAX_REPETITION_PENALTY):
        allowed = f"a number 0 < repetition_penalty <= {MAX_REPETITION_PENALTY:g} (1 = off)"
        raise InvalidRequest(f"repetition_penalty={p!r}; allowed: {allowed}", "repetition_penalty")
    return float(p)


def checked_min_p(p: object) -> float:
    """min_p as a float; refuses one outside [0, 1]."""
    if not (is_number(p) and 0.0 <= p <= 1.0):
        raise InvalidRequest(f"min_p={p!r}; allowed: a number 0 <= min_p <= 1 (0 = off)", "min_p")
    return float(p)


def checked_stop(stop: object) -> tuple[str, ...]:
    """stop as given (a string or a list of strings) -> a tuple of strings; refuses what
    STOP_ALLOWED does not allow. Example: "\\n" -> ("\\n",)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(s, str) or not s for s in stops):
        raise InvalidRequest(f"stop: {STOP_ALLOWED}", "stop")
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"stop: {len(stops)} strings; {STOP_ALLOWED}", "stop")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise InvalidRequest(f"stop: a string of {len(longest)} characters; {STOP_ALLOWED}", "stop")
    return stops


def token_ids(value: object, limit: int) -> tuple[int, ...] | None:
    """value as a tuple of at most `limit` token ids (integers >= 0); None when it is not.
    Example: [3, 4] -> (3, 4); (1.5,) -> None."""
    ids = tuple(value) if isinstance(value, list | tuple) else None
    if ids is None or len(ids) > limit or not all(is_int(t) and t >= 0 for t in ids):
        return None
    return ids
