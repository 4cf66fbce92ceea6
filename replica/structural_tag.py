"""A structural tag (vLLM's `structural_tag` structured output) read into the JSON text of
xgrammar's format form, the value of `StructuredOutput("structural_tag", ...)`: free text
until a trigger string appears, then a begin string, JSON valid under a schema and an end
string, then free text again (a tool call inside free text,
`<function=get_weather>{"city": "Oslo"}</function>`). Two forms, as vLLM takes them:

    structures  {"type": "structural_tag", "structures": [{"begin": str, "schema": {...},
                "end": str}, ...], "triggers": [str, ...]} (vLLM's older form): each begin
                starts with exactly one trigger, and each trigger starts some begin
    format      {"type": "structural_tag", "format": {...}}: xgrammar's formats
                (triggered_tags, tag, json_schema, sequence, or, any_text, const_string,
                regex, grammar, ...; a token is given by its id: the ingress, which
                checks the tag, has no tokenizer)

"type" may be left out, as vLLM's xgrammar backend reads the text. The structures form
becomes a triggered_tags format of tags (xgrammar's own conversion of it). Each JSON schema
gets at most FREE_WHITESPACE whitespace characters in each gap between JSON tokens unless
its format sets max_whitespace_cnt (1 to MAX_WHITESPACE): xgrammar's default there is
unbounded, which lets a model loop on newlines inside a tool call's arguments. Each schema
and each set of triggers is checked here, so that a refusal names it
(`response_format.structures[1].schema: ...`); the whole tag is checked by compiling it
(`StructuredOutput.grammar`).
"""

from __future__ import annotations

import json

from replica.structured_spec import (
    FREE_WHITESPACE,
    MAX_SPEC_CHARS,
    MAX_WHITESPACE,
    format_nodes,
    load_spec_json,
    tag_grammar,
    xgrammar_reason,
)

FORMS = (
    'allowed: {"type": "structural_tag", "structures": [{"begin": ..., "schema": ..., '
    '"end": ...}, ...], "triggers": [...]} or {"type": "structural_tag", "format": {...}}'
)
FORM_KEYS = {"structures": ("type", "structures", "triggers"), "format": ("type", "format")}
STRUCTURE_ALLOWED = (
    "allowed: an object of begin (a non-empty string), schema (a JSON schema object) and "
    "end (a string)"
)


def structural_tag_text(value: object, field: str) -> str:
    """A structural tag in either form (its object, or that object's JSON text) -> the
    format form's JSON text; ValueError naming the part of field at fault. Example:
    {"structures": [{"begin": "<f=a>", "schema": {}, "end": "</f>"}], "triggers": ["<f="]}
    -> '{"type": "structural_tag", "format": {"type": "triggered_tags", ...}}'."""
    text = value if isinstance(value, str) else json.dumps(value)
    if not 1 <= len(text) <= MAX_SPEC_CHARS:
        raise ValueError(f"{field}: {len(text)} characters of JSON; allowed: 1 to {MAX_SPEC_CHARS}")
    tag = _loads(text, field)  # a copy: its formats are changed below
    if not isinstance(tag, dict):
        raise ValueError(f"{field}: got {type(tag).__name__}; {FORMS}")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{field}.type: got {json.dumps(tag['type'])[:60]}; {FORMS}")
    form = "structures" if "structures" in tag else "format"
    extra = [k for k in tag if k not in FORM_KEYS[form]]
    if extra:
        raise ValueError(f"{field}.{extra[0]}: not a field of the {form} form; {FORMS}")
    if form == "structures":
        fmt = _structures(tag, field)
    elif "format" in tag:
        fmt = _formats(tag["format"], f"{field}.format")
    else:
        raise ValueError(f"{field}: neither structures nor format given; {FORMS}")
    return json.dumps({"type": "structural_tag", "format": fmt})


def _loads(text: str, field: str) -> object:
    try:
        return load_spec_json(text, FORMS.removeprefix("allowed: "))
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None


def _structures(tag: dict, field: str) -> dict:
    """The structures form's triggered_tags format."""
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{field}.structures: allowed: a non-empty list of objects; {FORMS}")
    if not isinstance(triggers, list) or not triggers:
        raise ValueError(f"{field}.triggers: allowed: a non-empty list of strings")
    for i, trigger in enumerate(triggers):
        if not isinstance(trigger, str):
            raise ValueError(f"{field}.triggers[{i}]: allowed: a non-empty string")
    tags = [_structure(s, f"{field}.structures[{i}]") for i, s in enumerate(structures)]
    begins = [t["begin"] for t in tags]
    _match(triggers, begins, f"{field}.triggers", f"{field}.structures")
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


def _structure(structure: object, where: str) -> dict:
    """One structure's tag format."""
    if not isinstance(structure, dict) or set(structure) != {"begin", "schema", "end"}:
        raise ValueError(f"{where}: {STRUCTURE_ALLOWED}")
    begin, schema, end = structure["begin"], structure["schema"], structure["end"]
    if not isinstance(begin, str) or not begin:
        raise ValueError(f"{where}.begin: allowed: a non-empty string")
    if not isinstance(end, str):
        raise ValueError(f"{where}.end: got {type(end).__name__}; allowed: a string")
    if not isinstance(schema, dict):
        raise ValueError(
            f"{where}.schema: got {type(schema).__name__}; allowed: a JSON schema object"
        )
    content = _schema({"type": "json_schema", "json_schema": schema}, f"{where}.schema")
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _formats(fmt: object, path: str) -> object:
    """The format form's format, its JSON schemas' whitespace bounded (fmt changed in
    place), each schema and each triggered_tags format's triggers checked, then the
    whole; ValueError naming the format at fault (path: the whole)."""
    for where, node in format_nodes(fmt, path):
        kind = node["type"]
        if kind == "qwen_xml_parameter":  # xgrammar's deprecated spelling of this format
            node.update(type="json_schema", style="qwen_xml")
            kind = "json_schema"
        if kind == "json_schema":
            _schema(node, where)
        elif kind == "triggered_tags":
            triggers, tags = node.get("triggers"), node.get("tags")
            if (
                _strings(triggers)
                and isinstance(tags, list)
                and all(isinstance(t, dict) and isinstance(t.get("begin"), str) for t in tags)
            ):  # other shapes: xgrammar's own check says what is wrong
                begins = [t["begin"] for t in tags]
                _match(triggers, begins, f"{where}.triggers", f"{where}.tags")
    _compiles(fmt, path)
    return fmt


def _schema(node: dict, where: str) -> dict:
    """A json_schema format (node, changed in place) with its whitespace bound, once its
    schema compiles; ValueError naming where."""
    bound = node.get("max_whitespace_cnt")
    if bound is None:
        node["max_whitespace_cnt"] = FREE_WHITESPACE
    elif type(bound) is not int or not 1 <= bound <= MAX_WHITESPACE:
        raise ValueError(
            f"{where}.max_whitespace_cnt: got {json.dumps(bound)[:60]}; allowed: an integer "
            f"1 to {MAX_WHITESPACE}, or null ({FREE_WHITESPACE})"
        )
    _compiles(node, where)
    return node


def _compiles(fmt: object, where: str) -> None:
    """ValueError naming where unless xgrammar builds fmt's grammar. Built from the text
    the request's grammar builds it from again (`structural_tag_grammar`): a schema's, and
    the whole format form's (what `structural_tag_text` returns), so kept
    (`tag_grammar`), not built twice."""
    try:
        tag_grammar(json.dumps({"type": "structural_tag", "format": fmt}))
    except RuntimeError as e:
        raise ValueError(f"{where}: {xgrammar_reason(e)}") from None


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _match(triggers: list[str], begins: list[str], triggers_at: str, tags_at: str) -> None:
    """xgrammar's rule for triggers (which it checks with a less telling message, or not
    at all: an unused trigger failed an internal check): non-empty, each begin starts
    with exactly one trigger, and each trigger starts some begin. triggers_at, tags_at:
    the paths of the triggers and of the list whose items hold the begins."""
    for i, trigger in enumerate(triggers):
        if not trigger:
            raise ValueError(f"{triggers_at}[{i}]: empty; allowed: a non-empty string")
    for j, begin in enumerate(begins):
        count = sum(begin.startswith(t) for t in triggers)
        if count != 1:
            raise ValueError(
                f"{tags_at}[{j}].begin: {json.dumps(begin)[:80]} starts with {count} of the "
                "triggers; allowed: a begin that starts with exactly one trigger"
            )
    for i, trigger in enumerate(triggers):
        if not any(b.startswith(trigger) for b in begins):
            raise ValueError(
                f"{triggers_at}[{i}]: {json.dumps(trigger)[:80]} starts no begin; allowed: "
                "triggers that each start some begin"
            )
