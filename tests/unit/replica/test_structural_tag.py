"""replica.structural_tag: vLLM's two forms of a structural tag read into xgrammar's format
form (each JSON schema's whitespace bounded), refusals naming the part at fault, and the
grammar: free text, then after a trigger only begin + JSON its schema takes + end, then
free text again; bounded strings inside are JSON (xgrammar 0.2.9's fix), and only there."""

from __future__ import annotations

import collections
import json
import random

import pytest
import xgrammar as xgr

from replica.structural_tag import structural_tag_text
from replica.structured import Grammars
from replica.structured_forms import spec_from_json
from replica.structured_spec import (
    FREE_WHITESPACE,
    MAX_WHITESPACE,
    StructuredOutput,
    checked,
    tag_grammar,
)
from tests.unit.replica.test_structured_spec import accepts
from tests.unit.replica.test_structured_strings import ALPHABET, bmp

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TAG = {
    "type": "structural_tag",
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {"begin": "<function=get_time>", "schema": TIME, "end": "</function>"},
    ],
    "triggers": ["<function="],
}


def spec(tag: object) -> StructuredOutput:
    return StructuredOutput("structural_tag", structural_tag_text(tag, "response_format"))


def _tag(begin: str, schema: dict, end: str, bound: int = FREE_WHITESPACE) -> dict:
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": bound}
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def test_the_structures_form_becomes_triggered_tags_with_bounded_whitespace():
    want = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<function="],
            "tags": [
                _tag("<function=get_weather>", WEATHER, "</function>"),
                _tag("<function=get_time>", TIME, "</function>"),
            ],
        },
    }
    assert json.loads(structural_tag_text(TAG, "f")) == want
    untyped = {k: v for k, v in TAG.items() if k != "type"}  # as vLLM's backend reads it
    assert structural_tag_text(json.dumps(untyped), "f") == structural_tag_text(TAG, "f")
    assert list(json.loads(structural_tag_text(TAG, "f"))["format"]["tags"][0]["content"][
        "json_schema"]["properties"]) == ["city", "days"]  # fmt: skip


def test_the_format_form_keeps_its_formats_and_bounds_each_schema():
    fmt = {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "Answer: "},
            {"type": "triggered_tags", "triggers": ["<f="], "tags": [
                {"type": "tag", "begin": "<f=a>", "end": "</f>",
                 "content": {"type": "json_schema", "json_schema": TIME}},
                {"type": "tag", "begin": "<f=b>", "end": "</f>",
                 "content": {"type": "json_schema", "json_schema": TIME, "max_whitespace_cnt": 3}},
                {"type": "tag", "begin": "<f=c>", "end": "</f>",
                 "content": {"type": "qwen_xml_parameter", "json_schema": TIME}},
            ]},
        ],
    }  # fmt: skip
    got = json.loads(structural_tag_text({"type": "structural_tag", "format": fmt}, "f"))
    tags = got["format"]["elements"][1]["tags"]
    assert [t["content"]["max_whitespace_cnt"] for t in tags] == [FREE_WHITESPACE, 3, 20]
    assert tags[2]["content"] == {"type": "json_schema", "json_schema": TIME, "style": "qwen_xml",
                                  "max_whitespace_cnt": FREE_WHITESPACE}  # fmt: skip
    assert got["format"]["elements"][0] == fmt["elements"][0]
    assert "max_whitespace_cnt" not in fmt["elements"][1]["tags"][0]["content"]  # a copy


def _with(**changes) -> dict:
    return {**TAG, **changes}


def _structure(i: int, **changes) -> dict:
    structures = [dict(s) for s in TAG["structures"]]
    structures[i].update(changes)
    return _with(structures=structures)


BAD_BEGIN = "starts with 0 of the triggers; allowed: a begin that starts with exactly one trigger"


@pytest.mark.parametrize(
    "tag, message",
    [
        (_structure(1, schema={"type": "bogus"}), 'response_format.structures[1].schema: Unsupported type "bogus"'),
        (_structure(0, schema=[1]), "response_format.structures[0].schema: got list; allowed: a JSON schema object"),
        (_structure(1, begin="<tool=get_time>"), f'response_format.structures[1].begin: "<tool=get_time>" {BAD_BEGIN}'),
        (_structure(0, begin=""), "response_format.structures[0].begin: allowed: a non-empty string"),
        (_structure(0, end=None), "response_format.structures[0].end: got NoneType; allowed: a string"),
        (_with(structures=[{"begin": "<function=x>", "schema": {}}]), "response_format.structures[0]: allowed: an object of begin"),
        (_with(structures=[]), "response_format.structures: allowed: a non-empty list of objects"),
        (_with(triggers=[]), "response_format.triggers: allowed: a non-empty list of strings"),
        (_with(triggers=["<function=", 3]), "response_format.triggers[1]: allowed: a non-empty string"),
        (_with(triggers=["<function=", ""]), "response_format.triggers[1]: empty; allowed: a non-empty string"),
        (_with(triggers=["<function=", "<fun"]),
         'response_format.structures[0].begin: "<function=get_weather>" starts with 2 of the triggers'),
        (_with(triggers=["<function=", "<tool="]),
         'response_format.triggers[1]: "<tool=" starts no begin; allowed: triggers that each start some begin'),
        (_with(type="json_schema"), 'response_format.type: got "json_schema"; allowed: {"type": "structural_tag"'),
        (_with(format={"type": "any_text"}), "response_format.format: not a field of the structures form"),
        ({"type": "structural_tag"}, "response_format: neither structures nor format given; allowed: "),
        ("{not json", "response_format: not valid JSON (Expecting property name enclosed in double quotes)"),
        ("[1]", "response_format: got list; allowed: "),
        ("", "response_format: 0 characters of JSON; allowed: 1 to 65536"),
        ({"type": "structural_tag", "format": {"type": "nope"}},
         "response_format.format: Invalid structural tag error: Format type not recognized: nope"),
        ({"type": "structural_tag", "format": {"type": "or", "elements": [
            {"type": "any_text"}, {"type": "json_schema", "json_schema": {"type": "bogus"}}]}},
         'response_format.format.elements[1]: Unsupported type "bogus"'),
        ({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": TIME,
                                               "max_whitespace_cnt": MAX_WHITESPACE + 1}},
         f"response_format.format.max_whitespace_cnt: got {MAX_WHITESPACE + 1}; allowed: an integer "
         f"1 to {MAX_WHITESPACE}, or null ({FREE_WHITESPACE})"),
        ({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a"],
          "tags": [{"type": "tag", "begin": "<b>", "content": {"type": "any_text"}, "end": "x"}]}},
         f'response_format.format.tags[0].begin: "<b>" {BAD_BEGIN}'),
        ({"type": "structural_tag", "format": {"type": "token", "token": "<s>"}},
         "response_format.format: Invalid structural tag error: Token string resolution requires"),
    ],
)  # fmt: skip
def test_refusals_name_the_part_at_fault(tag, message):
    with pytest.raises(ValueError) as e:
        structural_tag_text(tag, "response_format")
    assert str(e.value).startswith(message), str(e.value)


def test_the_grammar_holds_only_what_follows_a_trigger(grammars):
    tag = spec(TAG)
    call = '<function=get_weather>{"city": "Oslo", "days": 2}</function>'
    for text in [
        "",
        "just words, no call",
        f"Let me look. {call}",
        f'{call} and then <function=get_time>{{"zone": "cet"}}</function>. Done <b>',
        'a\n<function=get_time>{\n  "zone": "utc"\n}</function>\nmore text',
    ]:
        assert accepts(grammars, tag, text), text
    for text in [
        "<function=get_news>{}</function>",  # no structure begins so
        '<function=get_weather>{"city": "Oslo"}</function>',  # days missing
        '<function=get_weather>{"city": "Oslo", "days": 8}</function>',  # above maximum
        '<function=get_weather>{"city": "Oslo", "days": 2, "x": 1}</function>',
        '<function=get_weather>{"city": "Oslo", "days": 2}',  # no end
        '<function=get_weather>{"city": "Oslo", "days": 2}</functio>',
        '<function=get_weather> {"city": "Oslo", "days": 2}</function>',  # none before
        '<function=get_time>{"zone":' + " " * (FREE_WHITESPACE + 1) + '"utc"}</function>',
    ]:
        assert not accepts(grammars, tag, text), text
    bounded = '<function=get_time>{"zone":' + " " * FREE_WHITESPACE + '"utc"}</function>'
    assert accepts(grammars, tag, bounded)


def test_bounded_strings_inside_are_json(grammars):
    """A maxLength string inside a structural tag takes JSON escapes and refuses raw
    control characters, as a json spec's does (fresh random strings each run)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}},
              "required": ["s"]}  # fmt: skip
    tag = spec({"structures": [{"begin": "<s>", "schema": schema, "end": "</s>"}],
                "triggers": ["<s>"]})  # fmt: skip
    rng = random.Random()
    for _ in range(40):
        value = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
        body = json.dumps({"s": value}, ensure_ascii=bmp(value) and rng.random() < 0.5)
        assert accepts(grammars, tag, f"x <s>{body}</s> y") == (len(value) <= 5), body
        raw = [c for c in value if c < " "]
        if len(value) <= 5 and raw:
            unescaped = body.replace(json.dumps(raw[0])[1:-1], raw[0])
            assert not accepts(grammars, tag, f"<s>{unescaped}</s>"), unescaped


def test_a_regex_format_keeps_the_rule_text_of_a_bounded_character(grammars):
    """xgrammar writes a regex [^"\\\\\\r\\n] as the very rule a bounded JSON string's
    character has; the fix patches the schema's rule only, so the regex still takes a tab."""
    schema = {"type": "string", "maxLength": 2}
    fmt = {"type": "sequence", "elements": [
        {"type": "regex", "pattern": '[^"\\\\\\r\\n]'},
        {"type": "json_schema", "json_schema": schema},
    ]}  # fmt: skip
    tag = spec({"type": "structural_tag", "format": fmt})
    assert accepts(grammars, tag, '\t"\\t"') and accepts(grammars, tag, 'x"ab"')
    assert not accepts(grammars, tag, 'x"\t"')


@pytest.mark.parametrize("form", ["structures", "format"])
def test_each_grammar_of_a_tag_is_built_once_per_side(monkeypatch, grammars, form):
    """The ingress checks a request's tag part by part (each schema, then the whole
    format form) and then as the request's grammar (`router.structured_request`:
    spec_from_json, then checked), from the very same texts: xgrammar builds each text
    once (the whole format form and each schema were built twice). The replica, in a
    process of its own, builds them once more and compiles once against its tokenizer,
    for the request's check and its matcher alike."""
    tag = TAG if form == "structures" else json.loads(structural_tag_text(TAG, "f"))
    whole = structural_tag_text(TAG, "f")
    built, compiled = collections.Counter(), []
    build, compile_grammar = xgr.Grammar.from_structural_tag, xgr.GrammarCompiler.compile_grammar

    def counted_build(text):
        built[text] += 1
        return build(text)

    def counted_compile(compiler, grammar, *args, **kwargs):
        compiled.append(grammar)
        return compile_grammar(compiler, grammar, *args, **kwargs)

    monkeypatch.setattr(xgr.Grammar, "from_structural_tag", staticmethod(counted_build))
    monkeypatch.setattr(xgr.GrammarCompiler, "compile_grammar", counted_compile)
    tag_grammar.cache_clear()
    spec = checked("response_format", spec_from_json("structural_tag", tag, "response_format"))
    assert spec == StructuredOutput("structural_tag", whole)
    schemas = [
        json.dumps({"type": "structural_tag", "format": t["content"]})
        for t in json.loads(whole)["format"]["tags"]
    ]
    assert built == {text: 1 for text in [*schemas, whole]}
    tag_grammar.cache_clear()  # the replica's process
    replica = Grammars(grammars.tokenizer, grammars.vocab_size, grammars.stop_ids)
    replica.compile(spec)  # the request's check (`replica.async_engine`)
    replica.matcher(spec)  # its sequence's matcher (`replica.engine`)
    assert built == {text: 2 for text in [*schemas, whole]} and len(compiled) == 1
