"""truncate_prompt_tokens: vLLM's left truncation of a prompt, checked and applied."""

from __future__ import annotations

from typing import TypeVar

from lora_core.errors import InvalidRequest
from replica.sampling_checks import is_int

TRUNCATE_ALLOWED = (
    "allowed: null (off), an integer k >= 1 (keep the prompt's last k tokens, k at most "
    "the model's context length) or -1 (keep at most the model's context length)"
)
Seq = TypeVar("Seq", list[int], tuple[int, ...])


def check_truncate(k: object) -> None:
    """Refuse a truncate_prompt_tokens that TRUNCATE_ALLOWED does not allow."""
    if k is not None and not (is_int(k) and (k >= 1 or k == -1)):
        raise InvalidRequest(
            f"truncate_prompt_tokens={k!r}; {TRUNCATE_ALLOWED}", "truncate_prompt_tokens"
        )


def kept_prompt(ids: Seq, k: int | None, max_model_len: int) -> Seq:
    """The prompt ids a request with truncate_prompt_tokens k runs with: all (None), the
    last k, or the last max_model_len (-1); k is checked, and one above max_model_len is
    refused, as vLLM refuses it. Example: k = 2, [5, 6, 7] -> [6, 7]."""
    check_truncate(k)
    if k is None:
        return ids
    if k > max_model_len:
        raise InvalidRequest(
            f"truncate_prompt_tokens={k}: more than the model's context of {max_model_len} "
            f"tokens; {TRUNCATE_ALLOWED}",
            "truncate_prompt_tokens",
        )
    k = max_model_len if k == -1 else k
    return ids[-k:] if len(ids) > k else ids
