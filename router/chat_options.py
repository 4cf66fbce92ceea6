"""How chat messages are rendered: the chat-template fields of chat completions and
/tokenize (vLLM's), checked once.

    add_generation_prompt   true (default): end with the assistant turn's opening
    continue_final_message  true: leave the last message open, so the model continues it
                            (a prefilled answer); add_generation_prompt must not then be
                            sent true (both at once is vLLM's error too)
    chat_template_kwargs    extra variables of the template, e.g. {"enable_thinking": false}
                            for Qwen 3; at most MAX_KWARGS, named as template variables,
                            none of apply_chat_template's own parameters

A template that refuses its input (a role it does not take, a last message that is not
the assistant's for continue_final_message) is a 400 naming `messages`
(`router.prompt_encoder.PromptEncoder.encode_chat`).
"""

from __future__ import annotations

import json
from typing import Any, Self

from pydantic import BaseModel, model_validator

MAX_KWARGS = 32
RESERVED = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize", "padding",
        "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs",
    }
)  # fmt: skip
"""apply_chat_template's own parameters: set by the fields above or by lorafleet."""


class ChatTemplateFields(BaseModel):
    """Mixin of the bodies that render messages (its model_config is theirs)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = {}

    @model_validator(mode="after")
    def _template_fields(self) -> Self:
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise ValueError(
                    "add_generation_prompt: true with continue_final_message: true; allowed: "
                    "one of them (the last message is continued, or an answer begins)"
                )
            self.add_generation_prompt = False
        kwargs = self.chat_template_kwargs
        if len(kwargs) > MAX_KWARGS:
            raise ValueError(
                f"chat_template_kwargs: {len(kwargs)} keys; allowed: at most {MAX_KWARGS}"
            )
        for key in kwargs:
            if not key.isidentifier() or key in RESERVED:
                why = "a parameter of apply_chat_template" if key in RESERVED else "no name"
                raise ValueError(
                    f"chat_template_kwargs: key {json.dumps(key)[:80]} is {why}; allowed: "
                    "template variable names (e.g. enable_thinking) other than "
                    f"{', '.join(sorted(RESERVED))}"
                )
        return self

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of apply_chat_template for these fields."""
        return {
            **self.chat_template_kwargs,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }
