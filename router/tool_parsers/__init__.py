"""The readers of tool_choice "auto": the cluster's `tool_call_parser` names the format
its model writes calls in. Each reads a choice's text into content and calls
(`router.tool_calls.AutoCalls`); text that does not read as a call of the request's
tools stays content.

    hermes        <tool_call>{"name", "arguments"}</tool_call> blocks
    llama3_json   an answer of ";"-separated {"name", "parameters"} objects
    mistral       [TOOL_CALLS] then a JSON array of {"name", "arguments"}, or (v11+
                  tokenizers) name{...}, name[ARGS]{...} or name[CALL_ID]id[ARGS]{...},
                  one [TOOL_CALLS] a call
    pythonic      an answer that is a Python list of calls, [f(a=1), g()]; each call
                  sent once the , or ] after it arrives

The JSON formats' calls stream as they are generated (`json_call`): the name once read,
then the arguments' JSON text as written, as it arrives.
"""

from __future__ import annotations

from router.tool_calls import AutoCalls
from router.tool_parsers.hermes import HermesCalls
from router.tool_parsers.llama3_json import Llama3Calls
from router.tool_parsers.mistral import MistralCalls
from router.tool_parsers.pythonic import PythonicCalls

READERS: dict[str, type[AutoCalls]] = {
    "hermes": HermesCalls,
    "llama3_json": Llama3Calls,
    "mistral": MistralCalls,
    "pythonic": PythonicCalls,
}
SPECIAL_MARKERS = ("mistral",)
"""Parsers whose marker is a special token: their requests keep special tokens in text."""

__all__ = [
    "READERS",
    "SPECIAL_MARKERS",
    "HermesCalls",
    "Llama3Calls",
    "MistralCalls",
    "PythonicCalls",
]
