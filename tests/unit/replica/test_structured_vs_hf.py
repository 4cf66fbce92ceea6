"""Structured outputs in float32 greedy generation equal HF transformers (+ PEFT) `generate`
with a logits processor that masks by an independent xgrammar matcher (xgrammar's own
`apply_token_bitmask_inplace`, not lorafleet's unpacking; JSON with free whitespace from a
grammar built here with xgrammar's options, not by the spec), token for token, batched
beside an unconstrained request; finished outputs match their regex, choice or schema."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import xgrammar as xgr

from lora_core.errors import InvalidRequest
from replica.sampling_params import SamplingParams
from replica.structured import unpack_bitmask
from replica.structured_spec import FREE_WHITESPACE, StructuredOutput
from tests.hf_reference import hf_greedy
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine

PROMPT = "the quick brown fox"
MAX_NEW = 24
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "maximum": 9}},
    "required": ["color", "n"],
    "additionalProperties": False,
}
SPECS = {
    "regex": StructuredOutput("regex", r"[a-z]{2,5}( [a-z]{2,5}){0,2}"),
    "choice": StructuredOutput("choice", ("red", "green", 'bl"ue\u00e9')),
    "json": StructuredOutput("json", json.dumps(SCHEMA)),
    "json_object": StructuredOutput("json_object"),
    "grammar": StructuredOutput("grammar", 'root ::= "yes" | "no" | ("maybe " [0-9])'),
    "json_ws": StructuredOutput("json", json.dumps(SCHEMA), whitespace=FREE_WHITESPACE),
    "json_object_ws": StructuredOutput("json_object", whitespace=FREE_WHITESPACE),
}
FREE = {  # the free-whitespace grammars, from xgrammar directly
    "json_ws": (json.dumps(SCHEMA), FREE_WHITESPACE),
    "json_object_ws": ('{"type": "object"}', FREE_WHITESPACE),
}


def _reference_grammar(kind: str) -> xgr.Grammar:
    if kind in FREE:
        schema, bound = FREE[kind]
        return xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=bound)
    return SPECS[kind].grammar()


class _GrammarMask:
    """An HF logits processor: the tokens an xgrammar matcher allows, fed each new token."""

    def __init__(self, engine, grammar: xgr.Grammar, prompt_len: int):
        info = xgr.TokenizerInfo.from_huggingface(
            engine.tokenizer, vocab_size=engine.vocab_size, stop_token_ids=sorted(engine.eos_ids)
        )
        compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)
        self.matcher, self.prompt_len = xgr.GrammarMatcher(compiled), prompt_len
        self.bits = xgr.allocate_token_bitmask(1, engine.vocab_size)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        self.matcher.fill_next_token_bitmask(self.bits, 0)
        xgr.apply_token_bitmask_inplace(scores, self.bits)
        return scores


def _check_finished(engine, kind: str, ids: list[int]) -> None:
    """A request that ended on EOS matches its spec (its text is all but the EOS)."""
    if not ids or ids[-1] not in engine.eos_ids:
        return
    text = engine.tokenizer.decode(ids[:-1])
    if kind == "regex":
        assert re.fullmatch(SPECS["regex"].value, text), text
    elif kind == "choice":
        assert text in SPECS["choice"].value
    elif kind in ("json", "json_ws"):
        got = json.loads(text)
        assert set(got) == {"color", "n"} and got["color"] in ("red", "green") and got["n"] <= 9
    elif kind in ("json_object", "json_object_ws"):
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("adapter", [None, "qv8"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_structured_greedy_equals_hf(llama_dir, llama_adapters, refs, adapter, kind):
    engine = small_engine(llama_dir)
    ref = refs[adapter] if adapter else None
    free = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    alone = run_requests(engine, [("free", PROMPT, free, ref)])["free"]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, structured_outputs=SPECS[kind])
    got = run_requests(engine, [("s", PROMPT, params, ref), ("beside", PROMPT, free, ref)])
    ids = engine.tokenizer(PROMPT).input_ids
    path = llama_adapters[adapter] if adapter else None
    mask = _GrammarMask(engine, _reference_grammar(kind), len(ids))
    want = hf_greedy(
        llama_dir, path, ids, max_new_tokens=MAX_NEW, logits_processor=[mask],
        eos_token_id=sorted(engine.eos_ids),
    )  # fmt: skip
    assert got["s"] == want
    assert got["beside"] == alone  # the mask is the row's own
    _check_finished(engine, kind, got["s"])


def test_sampled_outputs_stay_in_the_grammar(llama_dir):
    engine = small_engine(llama_dir)
    spec = SPECS["choice"]
    reqs = [
        (f"r{seed}", PROMPT, SamplingParams(max_tokens=8, temperature=1.5, seed=seed,
                                             structured_outputs=spec), None)
        for seed in range(12)
    ]  # fmt: skip
    got = run_requests(engine, reqs)
    texts = {engine.tokenizer.decode(ids[:-1]) for ids in got.values()}
    assert all(ids[-1] in engine.eos_ids for ids in got.values())
    assert texts <= set(spec.value) and len(texts) > 1  # sampled, not one fixed answer


def test_sampled_json_with_free_whitespace_parses_obeys_the_schema_and_ends(llama_dir):
    """Every gap between JSON tokens holds at most FREE_WHITESPACE characters, so a schema
    of finitely many values has a longest output (8 gaps here) and every sampled request
    ends on EOS before max_tokens, however much whitespace the model likes."""
    schema = {
        **SCHEMA,
        "properties": {
            **SCHEMA["properties"],
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
    }
    longest = len('{"color":"green","n":9}') + 8 * FREE_WHITESPACE
    spec = StructuredOutput("json", json.dumps(schema), whitespace=FREE_WHITESPACE)
    engine = small_engine(llama_dir)
    reqs = [
        (f"r{seed}", PROMPT, SamplingParams(max_tokens=longest + 1, temperature=1.0, seed=seed,
                                             structured_outputs=spec), None)
        for seed in range(8)
    ]  # fmt: skip
    texts = []
    for ids in run_requests(engine, reqs).values():
        assert ids[-1] in engine.eos_ids
        text = engine.tokenizer.decode(ids[:-1])
        got = json.loads(text)
        assert set(got) == {"color", "n"} and got["color"] in ("red", "green")
        assert type(got["n"]) is int and 0 <= got["n"] <= 9
        assert max(map(len, re.findall(r"\s+", text)), default=0) <= FREE_WHITESPACE
        texts.append(text)
    assert any(re.search(r"[\n\r\t]", t) for t in texts), texts  # not the compact form


def test_logprobs_are_of_the_masked_distribution(llama_dir):
    engine = small_engine(llama_dir)
    params = SamplingParams(
        max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5,
        structured_outputs=StructuredOutput("choice", ("red fox",)),
    )  # fmt: skip
    engine.add_request("r", engine.tokenizer(PROMPT).input_ids, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    ids = [t for o in outs for t in o.new_token_ids]
    tops = [t for o in outs for t in o.new_top_logprobs]
    assert ids[-1] in engine.eos_ids and engine.tokenizer.decode(ids[:-1]) == "red fox"
    for pos, top in enumerate(tops):
        done = engine.tokenizer.decode(ids[:pos])
        allowed = [(t, lp) for t, lp in top if lp > float("-inf")]
        # every token with mass continues "red fox" (or ends it); the grammar's forbidden
        # tokens show as -inf, and the allowed ones share all the mass
        for t, _ in allowed:
            if done == "red fox":
                assert t in engine.eos_ids
            else:
                assert "red fox".startswith(done + engine.tokenizer.decode([t]))
        assert sum(math.exp(lp) for _, lp in allowed) <= 1 + 1e-5
        assert len(allowed) < len(top)  # a few tokens allowed: the rest of the top k is -inf
    assert tops[-1][0][1] == pytest.approx(0.0, abs=1e-6)  # EOS, the only token left


def test_preempted_constrained_requests_give_the_same_tokens(llama_dir, refs):
    """A preempted sequence recomputes its KV and keeps its matcher as it was (the tokens
    it already fed are not fed again)."""
    kinds = ["json", "regex", "grammar", "json_object"]
    reqs = [
        (k, f"{PROMPT} {i}", SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                            structured_outputs=SPECS[k]),
         refs["qv8"] if i % 2 else None)
        for i, k in enumerate(kinds)
    ]  # fmt: skip
    tight = small_engine(llama_dir, num_kv_blocks=9)
    got = run_requests(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    assert got == run_requests(small_engine(llama_dir), reqs)


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutput("regex", "a(b"), "parenthesis is not closed"),
        (StructuredOutput("json", '{"type": "bogus"}'), 'Unsupported type "bogus"'),
        (StructuredOutput("grammar", "root ::= "), "EBNF parser error"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_at_add(llama_dir, spec, message):
    engine = small_engine(llama_dir)
    params = SamplingParams(max_tokens=4, structured_outputs=spec)
    with pytest.raises(InvalidRequest, match=re.escape(message)) as e:
        engine.add_request("r", [1, 2, 3], params)
    assert e.value.param == "structured_outputs" and not engine.has_unfinished()


def test_a_spec_the_other_fields_leave_no_token_for_stops_with_an_error(llama_dir):
    engine = small_engine(llama_dir)
    tok = engine.tokenizer
    # allowed_token_ids hold no token starting "red": the grammar's tokens are all masked
    others = [
        t for t in range(engine.vocab_size) if not "red".startswith(tok.decode([t])[:1] or "?")
    ]
    params = SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=others[:50],
                            structured_outputs=StructuredOutput("choice", ("red",)))  # fmt: skip
    engine.add_request("r", tok(PROMPT).input_ids, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    [out] = outs
    assert isinstance(out.error, InvalidRequest) and out.error.param == "structured_outputs"
    assert "allows no token" in str(out.error) and out.new_token_ids == []


@pytest.mark.parametrize(
    "fields, param", [({"min_tokens": 2}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos")]
)
def test_fields_that_fight_the_grammar_are_refused(fields, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(max_tokens=4, structured_outputs=SPECS["regex"], **fields)
    assert e.value.param == param


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 400, 1000])
def test_unpack_bitmask_equals_xgrammar_masking(vocab):
    bits = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    got = unpack_bitmask(bits, vocab)
    words = bits.tolist()
    want = [[bool((row[t // 32] >> (t % 32)) & 1) for t in range(vocab)] for row in words]
    assert got.tolist() == want
    if vocab > 1:  # xgrammar 0.2.9's CPU masking corrupts the heap at a vocabulary of 1
        logits = torch.randn(3, vocab)
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bits)
        assert torch.equal(logits.masked_fill(~got, float("-inf")), masked)
