"""What a structured output asks for (`StructuredOutput`) and its grammar: the
request-side half of structured outputs, torch-free (`replica.structured` runs them).

A spec is parsed into an xgrammar `Grammar` without a tokenizer (`StructuredOutput.grammar`),
so the ingress refuses a schema xgrammar does not support, or a regular expression or
grammar that does not parse, before any replica sees it. Specs are read from their JSON
forms by `replica.structured_forms` (vLLM's `structured_outputs` object, one spec's value)
and `replica.structural_tag` (a structural tag's forms).

JSON is compact unless a request asks for free whitespace (`disable_any_whitespace: false`),
and then bounded (FREE_WHITESPACE characters per gap between tokens), so that a model can
never loop on newlines inside a JSON value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 65536
"""Longest schema, regular expression, grammar or structural tag taken (characters)."""
MAX_SPEC_DEPTH = 63
"""Nesting levels of arrays and objects a schema or structural tag may have, as a JSON
value inside a REST body may (`router.body_checks.MAX_DEPTH` - 1), also when it comes as
text (gRPC's fields, vLLM's string forms). xgrammar's compile time grows about with the
cube of a schema's depth, on the ingress and again on the replica: arrays nested 400 deep
(11 kB of text) took 4.2 s of CPU, 900 deep 44 s, against 0.015 s at 63
(`benchmarks/schema_depth_cpu.py`)."""
DEPTH_REFUSED = (
    f"nested more than {MAX_SPEC_DEPTH} levels; allowed: at most {MAX_SPEC_DEPTH} levels of "
    "nested arrays and objects"
)
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
WHITESPACE_KINDS = ("json", "json_object")
FREE_WHITESPACE = 20
"""The whitespace a request asking for free whitespace gets (vLLM's
`disable_any_whitespace: false`, gRPC's structured_any_whitespace): at most 20 of space,
newline, carriage return and tab in each gap between JSON tokens (after "{" / "[", on each
side of ":" and ",", before "}" / "]"; none before or after the value). Pretty-printed JSON
fits: a line break (CR LF too) and an indent of 4 spaces 4 levels deep, 2 spaces 9 deep or
18 tabs; deeper lines are kept shallower, still valid JSON. The bound is what lets a model
not loop: after 20 whitespace characters only a JSON token may follow, where an unbounded
gap lets a model spend all of max_tokens on newlines. The bound's size costs nothing: with
a 128k vocabulary a row's mask fill takes the same time for bounds of 4, 20 and 64; free
whitespace itself takes 5.5 us instead of 1.1 where a key starts and 265 us instead of
179 inside a string (`benchmarks/structured_fill_cpu.py`, one thread)."""
MAX_WHITESPACE = 64
"""The largest bound a StructuredOutput takes."""
TAG_GRAMMARS = 64
"""Structural tag texts whose grammars a process keeps (`tag_grammar`)."""


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    kind: "json" (value: a JSON schema, as JSON text), "json_object" (any JSON object;
    value ""), "regex" (value: the expression, matched whole), "choice" (value: a tuple of
    strings; the output is exactly one of them), "grammar" (value: EBNF, xgrammar's
    dialect of GBNF, with a `root` rule) or "structural_tag" (value: xgrammar's structural
    tag as JSON text, `{"type": "structural_tag", "format": {...}}`, such as free text
    with tool calls held to their schemas; `replica.structural_tag` reads vLLM's forms
    into it).

    whitespace (json and json_object only): 0 (compact: one space after ":" and ",", none
    elsewhere), or the most whitespace characters each gap between JSON tokens may hold
    (1 to MAX_WHITESPACE; requests get FREE_WHITESPACE). Part of the grammar cache's key.

    Example: StructuredOutput("choice", ("yes", "no")),
    StructuredOutput("json_object", whitespace=FREE_WHITESPACE).
    """

    kind: str
    value: str | tuple[str, ...] = ""
    whitespace: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind {self.kind!r}; allowed: {', '.join(KINDS)}")
        choices = f"allowed: 1 to {MAX_CHOICES} strings of 1 to {MAX_CHOICE_CHARS} characters"
        if self.kind == "choice":
            if not isinstance(self.value, tuple) or not 1 <= len(self.value) <= MAX_CHOICES:
                count = len(self.value) if isinstance(self.value, tuple) else "no list of"
                raise ValueError(f"{count} choices; {choices}")
            for c in self.value:
                if not isinstance(c, str) or not 1 <= len(c) <= MAX_CHOICE_CHARS:
                    size = len(c) if isinstance(c, str) else type(c).__name__
                    raise ValueError(f"a choice of {size} characters; {choices}")
        elif self.kind == "json_object":
            if self.value != "":
                raise ValueError("json_object takes no value")
        elif not isinstance(self.value, str) or not 1 <= len(self.value) <= MAX_SPEC_CHARS:
            size = len(self.value) if isinstance(self.value, str) else "no string of"
            raise ValueError(f"{size} characters; allowed: 1 to {MAX_SPEC_CHARS}")
        self._check_whitespace()

    def _check_whitespace(self) -> None:
        ws = self.whitespace
        if type(ws) is not int or not 0 <= ws <= MAX_WHITESPACE:
            raise ValueError(f"whitespace={ws!r}; allowed: an integer 0 to {MAX_WHITESPACE}")
        if ws and self.kind not in WHITESPACE_KINDS:
            raise ValueError(
                f"whitespace={ws} with a {self.kind} spec; allowed: 0 (free whitespace is for "
                "json and json_object only: a regex, choice, grammar or structural tag says "
                "its own)"
            )

    def grammar(self) -> Any:
        """The tokenizer-free `xgrammar.Grammar`; ValueError naming what is wrong (a
        schema xgrammar does not support, a regular expression or grammar that does not
        parse, a structural tag xgrammar refuses). Example: StructuredOutput("regex",
        "a(b").grammar() -> ValueError."""
        import xgrammar as xgr

        try:
            if self.kind in WHITESPACE_KINDS:
                # json_object is OpenAI's JSON mode: an object, not any value
                schema = self.value if self.kind == "json" else '{"type": "object"}'
                if self.whitespace:
                    grammar = xgr.Grammar.from_json_schema(
                        schema, any_whitespace=True, max_whitespace_cnt=self.whitespace
                    )
                else:
                    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
                return json_strings_escaped(grammar)
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.value)
            if self.kind == "choice":
                return xgr.Grammar.from_ebnf(choice_ebnf(self.value))
            if self.kind == "structural_tag":
                return structural_tag_grammar(self.value)
            return xgr.Grammar.from_ebnf(self.value)
        except RuntimeError as e:
            raise ValueError(xgrammar_reason(e)) from None


_BOUNDED_CHARACTER = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
"""The rule xgrammar 0.2.9 writes for one character of a JSON string with minLength or
maxLength (`root_prop_0_characters ::= (([^\"\\\r\n]))`): it lets raw control
characters through (a tab, U+0001), which JSON forbids (json.loads refuses the output),
and no escapes, so a bounded string could hold no quote. Its unbounded strings are right."""
_JSON_CHARACTER = r'(([^\0-\x1f\"\\]) | ("\\" ([\"\\/bfnrt] | "u" [A-Fa-f0-9]{4})))'
"""One character of a JSON string, as JSON defines it: any but the control characters, the
quote and the backslash, or an escape (counted as one character, as its decoded length;
an escaped surrogate pair, a character past U+FFFF written as two escapes, counts two)."""


def json_strings_escaped(grammar: Any) -> Any:
    """grammar (from a JSON schema) with each bounded string's character rule replaced by
    _JSON_CHARACTER, so its output is always JSON; grammar itself when it has none.
    Example: {"type": "string", "maxLength": 4} then takes "a\\tb" (an escaped tab) and
    refuses a raw tab."""
    import xgrammar as xgr

    ebnf, count = _BOUNDED_CHARACTER.subn(
        lambda m: f"{m.group(1)} ::= {_JSON_CHARACTER}", str(grammar)
    )
    return xgr.Grammar.from_ebnf(ebnf) if count else grammar


SCHEMA_FORMATS = ("json_schema", "qwen_xml_parameter")
"""A structural tag's formats that hold a JSON schema (and no formats)."""


def format_nodes(fmt: object, path: str = "") -> Iterator[tuple[str, dict]]:
    """Each format in a structural tag's format tree fmt (a dict with a "type"), parents
    first, with its path (path, then ".tags[0].content" and the like); the schema of a
    SCHEMA_FORMATS format is not entered. The formats are fmt's own dicts: a caller may
    change each one it is given. Example: {"type": "tag", "content": {"type": "any_text"},
    ...} -> ("", the tag), (".content", the any_text)."""
    stack = [(path, fmt)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, dict):
            enter = item.get("type") not in SCHEMA_FORMATS
            if "type" in item:
                yield where, item
            children = [(f"{where}.{k}", v) for k, v in item.items()] if enter else []
        elif isinstance(item, list):
            children = [(f"{where}[{i}]", v) for i, v in enumerate(item)]
        else:
            continue
        stack.extend(reversed(children))


@lru_cache(maxsize=TAG_GRAMMARS)
def tag_grammar(text: str) -> Any:
    """The `xgrammar.Grammar` of a structural tag's JSON text (RuntimeError where xgrammar
    refuses it), built once while kept. The ingress builds a tag's JSON schemas and the
    whole tag from their texts to check each (`replica.structural_tag`, naming the part at
    fault), then the request's grammar (`structural_tag_grammar`) from the same texts:
    each was built twice per request. A Grammar is immutable: callers share it."""
    import xgrammar as xgr

    return xgr.Grammar.from_structural_tag(text)


def structural_tag_grammar(text: str) -> Any:
    """The grammar of a structural tag's JSON text (the format form), its JSON schemas'
    bounded strings JSON: each schema format whose own grammar has them
    (`json_strings_escaped`) becomes a grammar format of its escaped grammar. Only the
    schemas' grammars are patched: a regex or grammar format in the same tag may hold a
    rule of the very text xgrammar writes for a bounded string's character, which must
    stay as written."""
    tag = json.loads(text)
    if not isinstance(tag, dict) or "format" not in tag:
        raise ValueError(
            'allowed: a structural tag\'s format form, {"type": "structural_tag", "format": '
            "{...}} (replica.structural_tag reads vLLM's forms into it)"
        )
    for _, node in format_nodes(tag["format"]):
        if node.get("type") == "json_schema":
            own = tag_grammar(json.dumps({"type": "structural_tag", "format": node}))
            escaped = json_strings_escaped(own)
            if escaped is not own:
                node.clear()
                node.update(type="grammar", grammar=str(escaped))
    return tag_grammar(json.dumps(tag))


def choice_ebnf(choices: Iterable[str]) -> str:
    """An EBNF grammar matching exactly one of choices.
    Example: ("a", 'b"') -> 'root ::= "a" | "b\\""'."""
    return "root ::= " + " | ".join(f'"{_escape(c)}"' for c in choices)


def _escape(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)


def xgrammar_reason(e: Exception) -> str:
    """xgrammar's message without its source location ("[05:07:12] /project/cpp/x.cc:94: ")."""
    text = str(e).strip()
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text) or type(e).__name__


def parse_json_schema(schema: object) -> str:
    """A JSON schema given as an object or as JSON text -> its JSON text; ValueError when
    it is neither an object nor the text of one, or nests more than MAX_SPEC_DEPTH levels."""
    if isinstance(schema, str):
        schema = load_spec_json(schema, "a JSON schema")
    elif too_deep(schema, MAX_SPEC_DEPTH):
        raise ValueError(DEPTH_REFUSED)
    if not isinstance(schema, dict):
        raise ValueError(f"got {type(schema).__name__}; allowed: a JSON schema object")
    # keys keep the client's order: a schema's properties are generated in that order
    # ("reasoning" before "answer" is why a client orders them), so sorting them changed
    # what a model wrote
    return json.dumps(schema)


def load_spec_json(text: str, allowed: str) -> object:
    """A structured output's JSON text (a schema, a structural tag) -> its value;
    ValueError when it is not JSON (allowed: what it should be) or nests more than
    MAX_SPEC_DEPTH levels, refused before xgrammar compiles anything."""
    try:
        value = json.loads(text)
    except RecursionError:  # the parser's own limit, far deeper than MAX_SPEC_DEPTH
        raise ValueError(DEPTH_REFUSED) from None
    except ValueError as e:
        why = getattr(e, "msg", e)
        raise ValueError(f"not valid JSON ({why}); allowed: {allowed}") from None
    if too_deep(value, MAX_SPEC_DEPTH):
        raise ValueError(DEPTH_REFUSED)
    return value


def too_deep(value: object, limit: int) -> bool:
    """Whether `value` nests arrays/objects more than `limit` levels deep (no recursion).
    Example: {"a": [[1]]} is 3 levels deep."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list):
            continue
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)
    return False


def checked(field: str, spec: StructuredOutput) -> StructuredOutput:
    """spec, once its grammar parses; else ValueError naming field."""
    try:
        spec.grammar()
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    return spec
