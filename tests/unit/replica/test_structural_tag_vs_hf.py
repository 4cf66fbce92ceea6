"""A structural tag in float32 greedy generation equals HF transformers (+ PEFT) `generate`
with a logits processor masking by an independent xgrammar matcher (its grammar built
here with xgrammar's own StructuralTag classes, not by `replica.structural_tag`), token for
token, batched beside an unconstrained request; from the first token, and after
`structured_after` ids (a reasoning model's "</think>"). The trigger is a word the free
output writes, so the grammar takes hold: the output is free text, then begin, JSON under
the structure's schema and end, then free text again."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat, TriggeredTagsFormat

from lora_core.errors import InvalidRequest
from replica.sampling_params import SamplingParams
from replica.structured_forms import spec_from_json
from replica.structured_spec import FREE_WHITESPACE
from tests.hf_reference import hf_greedy
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine
from tests.unit.replica.test_structured_after_vs_hf import AfterMarker, after_marker
from tests.unit.replica.test_structured_vs_hf import SCHEMA, _GrammarMask

PROMPTS = ["the quick brown fox", "hello world"]
MAX_NEW = 96
PAIR = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}
END = ";"


def structures_of(engine, free_ids: list[int]) -> dict:
    """The structural tag (vLLM's structures form) of a free output: its first token
    spelling a word of 3 letters or more (`word`) gives the trigger (the word's first 3
    letters); begins `word:` (SCHEMA's object) and `trigger-` (a pair of integers)."""
    words = [engine.tokenizer.decode([t]) for t in free_ids]
    word = next((w for w in words if w.isascii() and w.isalpha() and len(w) >= 3), None)
    assert word is not None, words  # else the grammar never takes hold
    return {
        "type": "structural_tag",
        "structures": [
            {"begin": f"{word}:", "schema": SCHEMA, "end": END},
            {"begin": f"{word[:3]}-", "schema": PAIR, "end": END},
        ],
        "triggers": [word[:3]],
    }


def reference_grammar(tag: dict) -> xgr.Grammar:
    """tag's grammar from xgrammar's classes: a triggered_tags format whose JSON has
    FREE_WHITESPACE whitespace characters per gap at most."""
    tags = [
        TagFormat(
            begin=s["begin"],
            content=JSONSchemaFormat(json_schema=s["schema"], max_whitespace_cnt=FREE_WHITESPACE),
            end=s["end"],
        )
        for s in tag["structures"]
    ]
    fmt = TriggeredTagsFormat(triggers=tag["triggers"], tags=tags)
    return xgr.Grammar.from_structural_tag(StructuralTag(format=fmt))


def check_structures(text: str, tag: dict) -> int:
    """The number of complete structures in text (each trigger in it starts a begin, then
    JSON its schema takes, then END); an unfinished last one is not counted."""
    trigger, count, at = tag["triggers"][0], 0, 0
    while (at := text.find(trigger, at)) >= 0:
        [begin] = [s["begin"] for s in tag["structures"] if text.startswith(s["begin"], at)]
        try:
            value, at = json.JSONDecoder().raw_decode(
                text, at + len(begin) + _spaces(text, at + len(begin))
            )
        except json.JSONDecodeError:
            return count  # cut off by max_tokens
        if begin.endswith(":"):
            assert set(value) == {"color", "n"} and value["color"] in ("red", "green")
        else:
            assert len(value) == 2 and all(type(v) is int for v in value)
        at += _spaces(text, at)
        if at == len(text):
            return count
        assert text.startswith(END, at), text[at:]
        count += 1
    return count


def _spaces(text: str, at: int) -> int:
    return len(text[at:]) - len(text[at:].lstrip(" \t\r\n"))


@pytest.mark.parametrize("adapter", [None, "qv8"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_structural_tag_greedy_equals_hf(llama_dir, llama_adapters, refs, adapter, prompt):
    engine = small_engine(llama_dir)
    ref = refs[adapter] if adapter else None
    free = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    alone = run_requests(engine, [("free", prompt, free, ref)])["free"]
    tag = structures_of(engine, alone)
    spec = spec_from_json("structural_tag", tag, "response_format")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, structured_outputs=spec)
    got = run_requests(engine, [("s", prompt, params, ref), ("beside", prompt, free, ref)])
    ids = engine.tokenizer(prompt).input_ids
    path = llama_adapters[adapter] if adapter else None
    mask = _GrammarMask(engine, reference_grammar(tag), len(ids))
    want = hf_greedy(
        llama_dir, path, ids, max_new_tokens=MAX_NEW, logits_processor=[mask],
        eos_token_id=sorted(engine.eos_ids),
    )  # fmt: skip
    assert got["s"] == want and got["beside"] == alone
    assert want != alone  # the trigger came, and the JSON after it is not the free output's
    done = want[-1] in engine.eos_ids
    text = engine.tokenizer.decode(want[:-1] if done else want)
    assert tag["triggers"][0] in text
    complete = check_structures(text, tag)
    assert complete >= 1 or not done  # an output that ended closed its structures


def test_a_structural_tag_after_the_marker_equals_hf(llama_dir):
    """structured_after with a structural tag: free until the marker (the free output's
    first token), the tag's grammar after it, as HF with AfterMarker."""
    engine = small_engine(llama_dir)
    prompt = PROMPTS[1]
    free = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    alone = run_requests(engine, [("free", prompt, free, None)])["free"]
    marker = (alone[0],)
    tag = structures_of(engine, alone[1:])
    spec = spec_from_json("structural_tag", tag, "response_format")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, structured_outputs=spec,
                            structured_after=marker)  # fmt: skip
    got = run_requests(engine, [("s", prompt, params, None)])["s"]
    ids = engine.tokenizer(prompt).input_ids
    mask = AfterMarker(engine.tokenizer, engine.vocab_size, engine.eos_ids,
                       reference_grammar(tag), len(ids), marker)  # fmt: skip
    want = hf_greedy(llama_dir, None, ids, max_new_tokens=MAX_NEW, logits_processor=[mask],
                     eos_token_id=sorted(engine.eos_ids))  # fmt: skip
    assert got == want and want != alone
    k = after_marker(want, list(marker))
    assert k == 1 and tag["triggers"][0] in engine.tokenizer.decode(want[k:])


def test_a_token_id_past_the_vocabulary_is_refused_at_add(llama_dir):
    """The ingress, without a tokenizer, takes a token format's id; the replica refuses
    one past its vocabulary as it compiles the tag."""
    engine = small_engine(llama_dir)
    fmt = {"type": "sequence", "elements": [{"type": "const_string", "value": "a"},
                                            {"type": "token", "token": engine.vocab_size}]}  # fmt: skip
    spec = spec_from_json("structural_tag", {"type": "structural_tag", "format": fmt}, "f")
    params = SamplingParams(max_tokens=4, structured_outputs=spec)
    with pytest.raises(
        InvalidRequest, match=f"Token id {engine.vocab_size} in the grammar is out"
    ) as e:
        engine.add_request("r", [1, 2, 3], params)
    assert e.value.param == "structured_outputs" and not engine.has_unfinished()
