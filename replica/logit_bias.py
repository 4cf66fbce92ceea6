"""logit_bias: its limits, the check of `SamplingParams.logit_bias`, and the reading of
OpenAI's JSON object (token ids as decimal strings -> bias) into its pairs."""

from __future__ import annotations

import re
from collections.abc import Mapping

from lora_core.errors import InvalidRequest
from replica.sampling_checks import is_int, is_number

MAX_LOGIT_BIAS_ENTRIES = 300
"""Tokens one request may bias (OpenAI's limit)."""
MAX_BIAS = 100.0
"""|bias| at most (OpenAI's range): -100 forbids a token, +100 all but forces it."""
LOGIT_BIAS_ALLOWED = (
    f"allowed: at most {MAX_LOGIT_BIAS_ENTRIES} token ids (integers >= 0, each once) "
    f"mapped to a bias, a number -{MAX_BIAS:g} <= bias <= {MAX_BIAS:g}"
)
_TOKEN_KEY = re.compile(r"[0-9]+")
MAX_TOKEN_ID_DIGITS = 19
"""Significant digits of a logit_bias key at most (no vocabulary nears 10**19 ids).
Python refuses to convert a decimal string of more than 4300 digits (a ValueError): an
unbounded key was a 500 on REST."""
KEY_ALLOWED = 'allowed: keys that are token ids written as decimal integers ("50256")'


def checked_bias(pairs: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as given (pairs, or a mapping token id -> bias) -> ((id, bias), ...)
    sorted by id; refuses what LOGIT_BIAS_ALLOWED does not allow."""
    if not isinstance(pairs, Mapping | tuple | list):
        raise InvalidRequest(
            f"logit_bias: got {type(pairs).__name__}; {LOGIT_BIAS_ALLOWED}", "logit_bias"
        )
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(
            f"logit_bias: {len(pairs)} token ids; {LOGIT_BIAS_ALLOWED}", "logit_bias"
        )
    out: dict[int, float] = {}
    for pair in pairs.items() if isinstance(pairs, Mapping) else pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise InvalidRequest(
                f"logit_bias: {pair!r} is no (token id, bias) pair; {LOGIT_BIAS_ALLOWED}",
                "logit_bias",
            )
        token, bias = pair
        if not is_int(token) or token < 0:
            raise InvalidRequest(
                f"logit_bias: token id {token!r}; {LOGIT_BIAS_ALLOWED}", "logit_bias"
            )
        if token in out:
            raise InvalidRequest(
                f"logit_bias: token id {token} given twice; {LOGIT_BIAS_ALLOWED}", "logit_bias"
            )
        if not (is_number(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
            raise InvalidRequest(
                f"logit_bias: bias {bias!r} for token {token}; {LOGIT_BIAS_ALLOWED}", "logit_bias"
            )
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _shown_key(key: str) -> str:
    return repr(key) if len(key) <= 40 else f"'{key[:20]}...' ({len(key)} characters)"


def bad_token_key(bias: Mapping[str, object]) -> str | None:
    """What is wrong with the first key of an OpenAI logit_bias object that is no token id
    written as a decimal integer ("50256"), or the first that names the same id as an
    earlier one ("5" and "05"); None when every key is one of its own."""
    ids: dict[str, str] = {}
    for key in bias:
        if not _TOKEN_KEY.fullmatch(key):
            return f"key {_shown_key(key)} is no token id; {KEY_ALLOWED}"
        token = key.lstrip("0") or "0"
        if len(token) > MAX_TOKEN_ID_DIGITS:
            return (
                f"key '{key[:20]}...' ({len(key)} digits) is no token id of any vocabulary; "
                f"{KEY_ALLOWED}"
            )
        if token in ids:
            return (
                f"keys {_shown_key(ids[token])} and {_shown_key(key)} are both token id {token}; "
                f"{LOGIT_BIAS_ALLOWED}"
            )
        ids[token] = key
    return None


def logit_bias_of_json(bias: Mapping[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias object (token ids as decimal strings -> bias) -> pairs for
    `SamplingParams.logit_bias`. Example: {"50256": -100} -> ((50256, -100),)."""
    problem = bad_token_key(bias)
    if problem is not None:
        raise InvalidRequest(f"logit_bias: {problem}", "logit_bias")
    # leading zeros stripped first: "0" * 5000 + "5" is token 5, too long for int()
    return tuple((int(k.lstrip("0") or "0"), v) for k, v in bias.items())
