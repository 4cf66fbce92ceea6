"""Tool calling on /v1/chat/completions (and gRPC's chat: `router.grpc_chat`): OpenAI's
`tools`, `tool_choice` and `parallel_tool_calls`, read into a `ToolPlan`.

    tool_choice "none"      the model answers in text (the tools still reach the template)
    tool_choice {"type": "function", "function": {"name": N}}
                            the output is N's arguments: a JSON object its `parameters`
                            schema admits, forced by a grammar (`replica.structured`)
    tool_choice "required"  the output is one or more calls, forced by a grammar: the JSON
                            array [{"name": ..., "parameters": {...}}, ...] (one element
                            when parallel_tool_calls is false), as vLLM's "required" asks
    tool_choice "auto"      the model decides; its text is read by the cluster's
                            `tool_call_parser` (`router.tool_parsers`: "hermes",
                            "llama3_json", "mistral", "pythonic"). OpenAI's default when
                            tools are given; refused when the cluster has no parser

A grammar-forced output always parses (a length cut aside), so a "required" or named
request never falls back to text silently. `router.tool_calls` reads the generated text
into the chat message's deltas: text as `content`, each call as a `tool_calls` entry with
an id of its own, in the shape the cluster's parser's model takes (`router.call_ids`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from lora_core.errors import InvalidRequest
from replica.structured_spec import StructuredOutput, checked, parse_json_schema
from router.call_ids import CallIds, mistral_style
from router.tool_calls import CallArray, NamedCall, ToolStream
from router.tool_parsers import READERS, SPECIAL_MARKERS

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NAME_ALLOWED = "allowed: 1 to 64 letters, digits, '_' or '-'"
MAX_TOOLS = 128
CHOICES_ALLOWED = (
    'allowed: "none", "auto", "required" or {"type": "function", "function": {"name": ...}} '
    "naming one of tools"
)
PARSERS = tuple(READERS)
"""The tool-call parsers a cluster may name (`tool_call_parser`) for tool_choice "auto"."""
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """One function of `tools`. parameters: the JSON schema of its arguments object."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates take it (`tools=` of apply_chat_template)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def tools_of(value: object, field: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's `tools` list -> Tools; ValueError naming the field at fault (`field`:
    the request's name of the list, gRPC's "tools_json"). Example:
    [{"type": "function", "function": {"name": "f"}}] -> (Tool("f", NO_PARAMETERS),)."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        size = f"{len(value)} tools" if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{field}: got {size}; allowed: a list of at most {MAX_TOOLS} tools")
    tools = tuple(_tool(item, f"{field}[{i}]") for i, item in enumerate(value))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise ValueError(f"{field}[{i}].function.name: {tool.name!r} is named twice")
        seen.add(tool.name)
    return tools


def _tool(item: object, at: str) -> Tool:
    if not isinstance(item, dict) or item.get("type") != "function":
        raise ValueError(f'{at}: allowed: {{"type": "function", "function": {{...}}}}')
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise ValueError(
            f'{at}.function: allowed: an object with "name", "description", "parameters"'
        )
    extra = set(item) - {"type", "function"}
    extra |= set(fn) - {"name", "description", "parameters", "strict"}
    if extra:
        raise ValueError(f"{at}: unknown field {sorted(extra)[0]!r}")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ValueError(f"{at}.function.name: got {json.dumps(name)[:80]}; {NAME_ALLOWED}")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{at}.function.description: allowed: a string")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise ValueError(f"{at}.function.parameters: allowed: a JSON schema (an object)")
    return Tool(name, parameters, description)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools. choice: "none", "auto", "required" or
    "function" (then `name` is the function)."""

    tools: tuple[Tool, ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.template_dict() for t in self.tools] or None

    def grammar(self) -> StructuredOutput | None:
        """The structured output that forces the call ("required", named), else None."""
        if self.choice == "function":
            tool = next(t for t in self.tools if t.name == self.name)
            return StructuredOutput("json", parse_json_schema(tool.parameters))
        if self.choice != "required":
            return None
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": []}}
        if not self.parallel:
            calls["maxItems"] = 1
        for tool in self.tools:
            calls["items"]["anyOf"].append(
                {
                    "type": "object",
                    "properties": {"name": {"const": tool.name}, "parameters": tool.parameters},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        return StructuredOutput("json", parse_json_schema(calls))

    def stream(self, parser: str | None) -> ToolStream | None:
        """A reader of one choice's generated text (None: plain text). parser: the
        cluster's tool_call_parser, which tool_choice "auto" needs (`check_parser`) and
        whose model's template the calls' ids are made for, forced calls' too
        (`router.call_ids`)."""
        ids = CallIds(mistral=mistral_style(parser))
        if self.choice == "function":
            return NamedCall(ids=ids, name=self.name or "")
        if self.choice == "required":
            return CallArray(ids=ids)
        if self.choice == "auto" and self.tools and parser in READERS:
            names = {t.name for t in self.tools}
            return READERS[parser](ids=ids, names=names, parallel=self.parallel)
        return None

    def keeps_special_tokens(self, parser: str | None) -> bool:
        """Whether the request's text must keep special tokens (skip_special_tokens
        off) for parser to see the calls: Mistral's [TOOL_CALLS] is one, and vLLM turns
        skip_special_tokens off for it too."""
        return self.choice == "auto" and bool(self.tools) and parser in SPECIAL_MARKERS

    def check_parser(self, parser: str | None) -> None:
        """InvalidRequest when tool_choice "auto" (with tools) meets a cluster without a
        parser: answering in text the client cannot tell from a refusal to call is the
        silent fallback users of other servers complain of."""
        if self.choice == "auto" and self.tools and parser is None:
            raise InvalidRequest(
                'tool_choice: "auto" (the default when tools are given) needs a tool-call '
                "parser, and this cluster has none (cluster arg tool_call_parser); allowed: "
                '"none", "required" or a named function',
                "tool_choice",
            )


def plan_of(
    tools: object, choice: object, parallel: object, tools_field: str = "tools"
) -> ToolPlan:
    """The ToolPlan of a body's tools / tool_choice / parallel_tool_calls (None = not
    sent); ValueError naming the field (tools_field: the request's name of the tools,
    gRPC's "tools_json"). The forcing grammar is checked here, on the ingress, so a
    schema xgrammar does not support is a 400 naming its tool."""
    parsed = tools_of(tools, tools_field) if tools is not None else ()
    if parallel is not None and not isinstance(parallel, bool):
        raise ValueError("parallel_tool_calls: allowed: true or false")
    if choice is None:
        choice = "auto" if parsed else "none"
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if (
            choice.get("type") != "function"
            or not isinstance(name, str)
            or set(choice)
            != {
                "type",
                "function",
            }
        ):
            raise ValueError(f"tool_choice: got {json.dumps(choice)[:200]}; {CHOICES_ALLOWED}")
        if name not in {t.name for t in parsed}:
            raise ValueError(f"tool_choice.function.name: {name!r} is not one of tools")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice: got {json.dumps(choice)[:200]}; {CHOICES_ALLOWED}")
    elif choice == "required" and not parsed:
        raise ValueError('tool_choice: "required" with no tools; allowed: "none" or "auto"')
    plan = ToolPlan(parsed, choice, name, parallel is not False)
    if plan.choice == "function":
        at = next(i for i, t in enumerate(parsed) if t.name == name)
        where = f"{tools_field}[{at}].function.parameters"
        checked(where, _grammar_or_raise(plan, where))
    elif plan.choice == "required":
        for i, tool in enumerate(parsed):
            one = ToolPlan((tool,), "function", tool.name)
            where = f"{tools_field}[{i}].function.parameters"
            checked(where, _grammar_or_raise(one, where))
        checked(tools_field, _grammar_or_raise(plan, tools_field))
    return plan


def _grammar_or_raise(plan: ToolPlan, where: str) -> StructuredOutput:
    try:
        grammar = plan.grammar()
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    assert grammar is not None
    return grammar


def forcing_grammar(
    plan: ToolPlan, choice: object, structured: StructuredOutput | None, structured_fields: str
) -> StructuredOutput | None:
    """The grammar that forces plan's call (None: not forced); ValueError when the
    request also asks for a structured output of its own (structured: it, None when it
    asks none; structured_fields: the fields that ask one, for the message), as one
    output cannot follow two grammars. choice: tool_choice as sent."""
    grammar = plan.grammar()
    if grammar is not None and structured is not None:
        raise ValueError(
            f"tool_choice: {json.dumps(choice)[:80]} forces a call, given with a structured "
            f"output ({structured_fields}); allowed: one of them, or tool_choice "
            '"none" / "auto"'
        )
    return grammar


def template_renders_tools(template: object) -> bool:
    """Whether a chat template (HF's chat_template: a string, or named templates) can
    show the model its tools: one that never reads `tools` renders a request's tools as
    nothing, and the model calls blind. Example: "{{ messages }}" -> False."""
    if isinstance(template, dict):
        return any(template_renders_tools(t) for t in template.values())
    return isinstance(template, str) and "tools" in template
