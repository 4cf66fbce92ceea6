"""What a structured output asks for (`StructuredOutput`), read from its JSON forms: the
request-side half of structured outputs, torch-free (`replica.structured` runs them).

A spec is parsed into an xgrammar `Grammar` without a tokenizer (`StructuredOutput.grammar`),
so the ingress refuses a schema xgrammar does not support, or a regular expression or
grammar that does not parse, before any replica sees it. vLLM's `structured_outputs`
object (REST, the offline runner) is read by `structured_outputs_of`.

JSON is compact unless a request asks for free whitespace (`disable_any_whitespace: false`),
and then bounded (FREE_WHITESPACE characters per gap between tokens), so that a model can
never loop on newlines inside a JSON value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SPEC_KEYS = ("json", "regex", "choice", "grammar", "json_object")
BACKENDS = ("auto", "xgrammar")
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 65536
"""Longest schema, regular expression or grammar taken (characters)."""
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
CACHE_SIZE = 256
"""Compiled grammars an engine keeps (least recently used dropped first)."""
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


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    kind: "json" (value: a JSON schema, as JSON text), "json_object" (any JSON object;
    value ""), "regex" (value: the expression, matched whole), "choice" (value: a tuple of
    strings; the output is exactly one of them) or "grammar" (value: EBNF, xgrammar's
    dialect of GBNF, with a `root` rule).

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
                "json and json_object only: a regex, choice or grammar says its own)"
            )

    def grammar(self) -> Any:
        """The tokenizer-free `xgrammar.Grammar`; ValueError naming what is wrong (a
        schema xgrammar does not support, a regular expression or grammar that does not
        parse). Example: StructuredOutput("regex", "a(b").grammar() -> ValueError."""
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
            return xgr.Grammar.from_ebnf(self.value)
        except RuntimeError as e:
            raise ValueError(_reason(e)) from None


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


def _reason(e: RuntimeError) -> str:
    """xgrammar's message without its source location ("[05:07:12] /project/cpp/x.cc:94: ")."""
    text = str(e).strip()
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text) or type(e).__name__


def parse_json_schema(schema: object) -> str:
    """A JSON schema given as an object or as JSON text -> its JSON text; ValueError when
    it is neither an object nor the text of one."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise ValueError("not valid JSON; allowed: a JSON schema") from None
    if not isinstance(schema, dict):
        raise ValueError(f"got {type(schema).__name__}; allowed: a JSON schema object")
    # keys keep the client's order: a schema's properties are generated in that order
    # ("reasoning" before "answer" is why a client orders them), so sorting them changed
    # what a model wrote
    return json.dumps(schema)


def checked(field: str, spec: StructuredOutput) -> StructuredOutput:
    """spec, once its grammar parses; else ValueError naming field."""
    try:
        spec.grammar()
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    return spec


def structured_outputs_of(value: object, field: str = "structured_outputs") -> StructuredOutput:
    """vLLM's structured_outputs object -> StructuredOutput; ValueError naming the field
    at fault (\"structured_outputs.regex: ...\")."""
    if not isinstance(value, dict):
        raise ValueError(f"{field}: got {type(value).__name__}; allowed: an object")
    given = [k for k in SPEC_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise ValueError(
            f"{field}: {len(given)} of {', '.join(SPEC_KEYS)} given; allowed: exactly one"
        )
    check_backend(value.get("backend"), f"{field}.backend")
    free = value.get("disable_any_whitespace")
    if free is not None and not isinstance(free, bool):
        raise ValueError(f"{field}.disable_any_whitespace: allowed: true, false or null")
    if free is False and given[0] not in WHITESPACE_KINDS:
        raise ValueError(
            f"{field}.disable_any_whitespace: false applies to json and json_object only; "
            f"allowed with {given[0]}: true or null"
        )
    whitespace = FREE_WHITESPACE if free is False else 0
    known = {*SPEC_KEYS, "backend", "disable_any_whitespace"}
    extra = sorted(k for k in value if k not in known and value[k] not in (None, False))
    if extra:
        raise ValueError(f"{field}.{extra[0]}: not supported; allowed: null")
    key = given[0]
    if key == "json_object":
        if value[key] is not True:
            raise ValueError(f"{field}.json_object: allowed: true or null")
        return StructuredOutput("json_object", whitespace=whitespace)
    return spec_from_json(key, value[key], f"{field}.{key}", whitespace)


def spec_from_json(kind: str, value: object, field: str, whitespace: int = 0) -> StructuredOutput:
    """StructuredOutput(kind, value) from JSON (whitespace: json's); ValueError naming
    field."""
    try:
        if kind == "json":
            return StructuredOutput("json", parse_json_schema(value), whitespace)
        if kind == "choice":
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise ValueError("allowed: a list of strings")
            return StructuredOutput("choice", tuple(value))
        if not isinstance(value, str):
            raise ValueError(f"got {type(value).__name__}; allowed: a string")
        return StructuredOutput(kind, value)
    except ValueError as e:
        text = str(e)
        raise ValueError(text if text.startswith(field) else f"{field}: {text}") from None


def check_backend(backend: object, field: str) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"{field}: got {json.dumps(backend)[:60]}; allowed: null, " + ", ".join(BACKENDS)
        )


def whitespace_pattern_refused(field: str) -> str:
    return (
        f"{field}: not supported (xgrammar takes no whitespace pattern, and a pattern "
        "such as [\\n ]* would let a model loop on newlines); allowed: null, or "
        "structured_outputs with disable_any_whitespace false for JSON with at most "
        f"{FREE_WHITESPACE} whitespace characters between tokens"
    )
