"""Prompts to token ids (and ids back to text) for the ingress, off the event loop.

A prompt (text or token ids) and a chat (messages rendered by the model's chat template)
become the token ids a request runs with. The work runs in one worker thread on a copy
of the tokenizer, so a long prompt does not stall every other request on the ingress,
and text that no tokenization could fit in the model's context is refused before any of
it (`PromptEncoder.check_prompt_chars`). `router.frontend.Frontend` is a PromptEncoder.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jinja2 import TemplateError

from lora_core.errors import InvalidRequest
from replica.serve_protocol import check_prompt_ids


def longest_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: its vocabulary piece (for byte-level
    BPE one character per byte, never fewer than the text's characters) or an added
    token's content. Example: the demo tokenizer's longest is "<|endoftext|>" -> 13."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    added = (t.content for t in tokenizer.added_tokens_decoder.values())
    return max(1, *(len(p) for p in pieces if p), *(len(a) for a in added))


class PromptEncoder:
    """tokenizer: the base model's HF tokenizer (same files the replicas load);
    max_model_len: the model's context in tokens (prompt + output)."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.longest_token = longest_token_chars(tokenizer)
        # Tokenizing runs in one worker thread on its own copy of the tokenizer: HF fast
        # tokenizers release the GIL while encoding (the event loop keeps serving), but
        # one instance used from two threads fails with "Already borrowed".
        self._encoder = copy.deepcopy(tokenizer)
        self._encode_pool = ThreadPoolExecutor(1, thread_name_prefix="lorafleet-tokenize")

    async def _off_loop(self, fn: Callable, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._encode_pool, functools.partial(fn, *args, **kwargs))

    def check_prompt_chars(self, chars: int, prompt_field: str) -> None:
        """Refuse, before tokenizing, text that no tokenization can fit in the context:
        tokenizing megabytes takes seconds of CPU for an answer known in advance."""
        limit = self.max_model_len * self.longest_token
        if chars > limit:
            raise InvalidRequest(
                f"{prompt_field}: {chars} characters cannot fit the model's context of "
                f"{self.max_model_len} tokens (no token spells more than {self.longest_token} "
                f"characters, so at most {limit}); allowed: a prompt of at most "
                f"{self.max_model_len - 1} tokens",
                prompt_field,
            )

    async def encode_prompt(self, prompt: str | list[int]) -> tuple[int, ...]:
        """A completion's prompt: text tokenized, or token ids checked against the
        vocabulary; empty is refused."""
        if isinstance(prompt, str):
            ids = await self.encode_text(prompt)
        else:
            ids = tuple(prompt)
            check_prompt_ids(ids, self.vocab_size)
        if not ids:
            raise InvalidRequest(
                "prompt: empty; allowed: a non-empty string or token id list", "prompt"
            )
        return ids

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """Tokenizes text (maybe empty) in the worker thread."""
        self.check_prompt_chars(len(text), "prompt")
        out = await self._off_loop(self._encoder, text, add_special_tokens=add_special_tokens)
        return tuple(out.input_ids)

    async def decode(self, ids: list[int]) -> str:
        """Token ids (checked to be in the vocabulary) -> text, in the worker thread."""
        return await self._off_loop(self._encoder.decode, ids)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[int, ...]:
        """Renders and tokenizes in the worker thread. tools: the request's tools as
        templates take them (`router.tools.Tool.template_dict`); options:
        apply_chat_template's keyword arguments (default: add_generation_prompt;
        `router.chat_options.ChatTemplateFields.template_options`)."""
        options = {"add_generation_prompt": True} if options is None else options
        chars = sum(len(m["content"]) for m in messages)
        chars += sum(len(json.dumps(t)) for t in tools or ())  # the template writes them too
        self.check_prompt_chars(chars, "messages")
        try:
            ids = await self._off_loop(
                self._encoder.apply_chat_template,
                messages,
                tools=tools,
                tokenize=True,
                return_dict=False,
                **options,
            )
        except TemplateError as e:  # the template's own checks (e.g. roles must alternate)
            raise InvalidRequest(
                f"messages: the chat template refused them ({e})", "messages"
            ) from None
        except Exception as e:  # anything else is the tokenizer's internals: name the type only
            why = type(e).__name__
            raise InvalidRequest(
                f"messages: the chat template refused them ({why})", "messages"
            ) from None
        return tuple(int(t) for t in ids)
