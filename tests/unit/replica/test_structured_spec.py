"""replica.structured_spec's free whitespace: which kinds take it, what vLLM's
disable_any_whitespace asks for, and the grammar it compiles to (at most FREE_WHITESPACE
whitespace characters in each gap between JSON tokens, none by default), cached apart
from the compact grammar of the same schema."""

from __future__ import annotations

import json

import pytest

from replica.structured import Grammars
from replica.structured_forms import spec_from_json, structured_outputs_of
from replica.structured_spec import FREE_WHITESPACE, MAX_WHITESPACE, StructuredOutput

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["a", "b"],
    }
)
SPECS = {
    "json": StructuredOutput("json", SCHEMA),
    "json_object": StructuredOutput("json_object"),
    "regex": StructuredOutput("regex", "a+"),
    "choice": StructuredOutput("choice", ("a", "b")),
    "grammar": StructuredOutput("grammar", 'root ::= "a"'),
    "structural_tag": StructuredOutput(
        "structural_tag", '{"type": "structural_tag", "format": {"type": "any_text"}}'
    ),
}


def _with(spec: StructuredOutput, whitespace) -> StructuredOutput:
    return StructuredOutput(spec.kind, spec.value, whitespace)


@pytest.mark.parametrize("kind", ["json", "json_object"])
@pytest.mark.parametrize("whitespace", [0, 1, FREE_WHITESPACE, MAX_WHITESPACE])
def test_json_kinds_take_whitespace(kind, whitespace):
    spec = _with(SPECS[kind], whitespace)
    assert spec.whitespace == whitespace
    spec.grammar()  # compiles without a tokenizer


@pytest.mark.parametrize("kind", ["regex", "choice", "grammar", "structural_tag"])
def test_other_kinds_refuse_whitespace(kind):
    _with(SPECS[kind], 0)
    with pytest.raises(ValueError) as e:
        _with(SPECS[kind], FREE_WHITESPACE)
    assert str(e.value) == (
        f"whitespace={FREE_WHITESPACE} with a {kind} spec; allowed: 0 (free whitespace is for "
        "json and json_object only: a regex, choice, grammar or structural tag says its own)"
    )


@pytest.mark.parametrize("whitespace", [-1, MAX_WHITESPACE + 1, True, 2.0, "20"])
def test_whitespace_out_of_range_is_refused(whitespace):
    with pytest.raises(
        ValueError, match=f"^whitespace={whitespace!r}; allowed: an integer 0 to 64"
    ):
        _with(SPECS["json"], whitespace)


@pytest.mark.parametrize(
    "value, want",
    [
        ({"json_object": True, "disable_any_whitespace": False}, StructuredOutput("json_object", whitespace=FREE_WHITESPACE)),
        ({"json": SCHEMA, "disable_any_whitespace": False}, StructuredOutput("json", SCHEMA, FREE_WHITESPACE)),
        ({"json": SCHEMA, "disable_any_whitespace": True}, StructuredOutput("json", SCHEMA)),
        ({"json_object": True, "disable_any_whitespace": None}, StructuredOutput("json_object")),
        ({"regex": "a", "disable_any_whitespace": True}, StructuredOutput("regex", "a")),
    ],
)  # fmt: skip
def test_disable_any_whitespace_false_asks_for_free_whitespace(value, want):
    assert structured_outputs_of(value) == want


@pytest.mark.parametrize(
    "value, message",
    [
        ({"regex": "a", "disable_any_whitespace": False},
         "structured_outputs.disable_any_whitespace: false applies to json and json_object only; "
         "allowed with regex: true or null"),
        ({"choice": ["a"], "disable_any_whitespace": False},
         "structured_outputs.disable_any_whitespace: false applies to json and json_object only; "
         "allowed with choice: true or null"),
        ({"json_object": True, "disable_any_whitespace": "no"},
         "structured_outputs.disable_any_whitespace: allowed: true, false or null"),
        ({"json_object": True, "disable_any_whitespace": 0},
         "structured_outputs.disable_any_whitespace: allowed: true, false or null"),
    ],
)  # fmt: skip
def test_disable_any_whitespace_refusals_name_the_field(value, message):
    with pytest.raises(ValueError) as e:
        structured_outputs_of(value)
    assert str(e.value) == message


def accepts(grammars: Grammars, spec: StructuredOutput, text: str) -> bool:
    """Whether spec's grammar takes text, whole (then EOS); grammars: the `grammars`
    fixture (conftest.py)."""
    m = grammars.matcher(spec)
    return m.accept_string(text) and m.accept_token(grammars.stop_ids[0])


def test_free_whitespace_is_bounded_in_each_gap(grammars):
    value = {"a": 1, "b": ["x", "y"]}
    compact, free = SPECS["json"], _with(SPECS["json"], FREE_WHITESPACE)
    pretty = json.dumps(value, indent=2)
    assert accepts(grammars, compact, json.dumps(value))  # one space after ':' and ','
    assert not accepts(grammars, compact, pretty)
    assert accepts(grammars, free, pretty)
    assert accepts(grammars, free, json.dumps(value, separators=(",", ":")))
    n = FREE_WHITESPACE
    tabs = "{" + "\t" * n + '"a"' + " " * n + ":" + "\n" * n + '1,"b":[]' + "\r\n" * (n // 2) + "}"
    assert accepts(grammars, free, tabs)  # each gap holds up to n, of any whitespace
    assert not accepts(grammars, free, "{" + " " * (n + 1) + '"a":1,"b":[]}')
    assert not accepts(grammars, free, '{"a":1,"b":[' + "\n" * (n + 1) + "]}")
    assert not accepts(grammars, free, ' {"a":1,"b":[]}')  # none before the value
    assert not accepts(grammars, free, '{"a":1,"b":[]}\n')  # nor after it
    obj = _with(SPECS["json_object"], FREE_WHITESPACE)
    assert accepts(grammars, obj, json.dumps({"k": [{"x": None}]}, indent=4))
    assert not accepts(grammars, SPECS["json_object"], json.dumps({"k": 1}, indent=4))


def test_the_grammar_cache_keys_on_whitespace(grammars):
    compact, free = SPECS["json_object"], _with(SPECS["json_object"], FREE_WHITESPACE)
    a, b = grammars.compile(compact), grammars.compile(free)
    assert a is not b
    assert grammars.compile(_with(SPECS["json_object"], FREE_WHITESPACE)) is b
    assert grammars.compile(StructuredOutput("json_object")) is a
    assert not accepts(grammars, compact, '{\n"k": 1}') and accepts(grammars, free, '{\n"k": 1}')


def test_properties_keep_the_order_the_client_gave():
    import xgrammar as xgr

    schema = {
        "type": "object",
        "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
        "required": ["reasoning", "answer"],
    }
    spec = spec_from_json("json", schema, "guided_json")
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    compiled = xgr.GrammarCompiler(info).compile_grammar(spec.grammar())

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()

    assert accepts('{"reasoning": "x", "answer": 1}')
    assert not accepts('{"answer": 1, "reasoning": "x"}')


def test_the_grammar_cache_is_bounded_by_bytes(grammars):
    specs = [StructuredOutput("regex", f"[a-z]{{1,{n}}}x") for n in range(3, 9)]
    sizes = [grammars.compile(s).memory_size_bytes for s in specs]
    limit = sizes[-1] + sizes[-2]  # room for the two newest
    small = Grammars(grammars.tokenizer, grammars.vocab_size, grammars.stop_ids, limit)
    kept = [small.compile(s) for s in specs]
    assert small.cache_bytes == sizes[-1] + sizes[-2] <= limit
    assert small.compile(specs[-1]) is kept[-1] and small.compile(specs[-2]) is kept[-2]
    assert small.compile(specs[0]) is not kept[0]  # dropped, compiled again
    tiny = Grammars(grammars.tokenizer, grammars.vocab_size, grammars.stop_ids, 1)
    first = tiny.compile(specs[0])  # larger than the bound: kept alone, the newest
    assert tiny.compile(specs[0]) is first and tiny.cache_bytes == sizes[0]
    tiny.compile(specs[1])
    assert tiny.cache_bytes == sizes[1]


def test_two_threads_compiling_one_spec_keep_one_and_count_it_once(grammars, monkeypatch):
    import threading

    import replica.structured as structured

    fresh = Grammars(grammars.tokenizer, grammars.vocab_size, grammars.stop_ids)
    compiler = fresh._get_compiler()
    both_compiled = threading.Barrier(2)

    class Together:  # both threads compile before either stores
        def compile_grammar(self, grammar):
            out = compiler.compile_grammar(grammar)
            both_compiled.wait(timeout=30)
            return out

    fresh._compiler = Together()
    spec = StructuredOutput("regex", "[a-z]{1,5}x")
    got = [None, None]
    threads = [
        threading.Thread(target=lambda i=i: got.__setitem__(i, fresh.compile(spec)))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got[0] is got[1] is fresh.compile(spec)
    assert fresh.cache_bytes == got[0].memory_size_bytes
    fresh._compiler = compiler
    monkeypatch.setattr(structured, "CACHE_SIZE", 3)  # the count bound, beside the bytes
    specs = [StructuredOutput("regex", f"[a-z]{{1,{n}}}y") for n in range(3, 9)]
    kept = [fresh.compile(s) for s in specs]
    assert fresh.cache_bytes == sum(k.memory_size_bytes for k in kept[-3:])
    assert all(fresh.compile(s) is k for s, k in zip(specs[-3:], kept[-3:], strict=True))
