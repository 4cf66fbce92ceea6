"""A structured output that starts after given ids (`SamplingParams.structured_after`, a
reasoning model's "</think>"), in float32 greedy generation, equals HF transformers (+ PEFT)
`generate` with a logits processor written here: free until the generated ids end with
the marker, then an independent xgrammar matcher's mask, fed only the tokens after it.
The marker is two tokens the free output writes; one it never writes leaves the output
free (the grammar never starts); the ids are checked."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr

from lora_core.errors import InvalidRequest
from replica.sampling_checks import MAX_STRUCTURED_AFTER
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine
from tests.unit.replica.test_structured_vs_hf import PROMPT, SPECS

MAX_NEW = 40


def after_marker(out: list[int], marker: list[int]) -> int | None:
    """Index in out of the first token after marker's first occurrence (None: none)."""
    m = len(marker)
    return next((k for k in range(m, len(out) + 1) if out[k - m : k] == marker), None)


class AfterMarker:
    """An HF logits processor: logits as they are until the generated ids (those past
    prompt_len) contain marker, then the tokens an xgrammar matcher of grammar allows,
    the matcher fed each token after the marker's first occurrence."""

    def __init__(self, tokenizer, vocab_size, eos_ids, grammar, prompt_len, marker):
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_ids)
        )
        self.matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
        self.bits = xgr.allocate_token_bitmask(1, vocab_size)
        self.prompt_len, self.marker, self.fed = prompt_len, list(marker), 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[0, self.prompt_len :].tolist()
        start = after_marker(out, self.marker)
        if start is None:
            return scores
        for token in out[start + self.fed :]:
            assert self.matcher.accept_token(token)
            self.fed += 1
        self.matcher.fill_next_token_bitmask(self.bits, 0)
        xgr.apply_token_bitmask_inplace(scores, self.bits)
        return scores


def reference(engine, model_dir, adapter_path, prompt_ids, kind, marker, **generate):
    mask = AfterMarker(
        engine.tokenizer, engine.vocab_size, engine.eos_ids, SPECS[kind].grammar(),
        len(prompt_ids), marker,
    )  # fmt: skip
    processors = [*generate.pop("logits_processor", []), mask]
    return hf_greedy(
        model_dir, adapter_path, prompt_ids, max_new_tokens=MAX_NEW, logits_processor=processors,
        eos_token_id=sorted(engine.eos_ids), **generate,
    )  # fmt: skip


@pytest.mark.parametrize("adapter", [None, "qv8"])
@pytest.mark.parametrize("kind", ["json", "regex"])
def test_the_grammar_starts_after_the_marker_as_hf_with_its_processor(
    llama_dir, llama_adapters, refs, adapter, kind
):
    engine = small_engine(llama_dir)
    ref = refs[adapter] if adapter else None
    free = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    alone = run_requests(engine, [("free", PROMPT, free, ref)])["free"]
    marker = tuple(alone[3:5])  # written by the free output: the grammar starts there
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, structured_outputs=SPECS[kind],
                            structured_after=marker)  # fmt: skip
    got = run_requests(engine, [("s", PROMPT, params, ref), ("beside", PROMPT, free, ref)])
    ids = engine.tokenizer(PROMPT).input_ids
    path = llama_adapters[adapter] if adapter else None
    want = reference(engine, llama_dir, path, ids, kind, marker)
    assert got["s"] == want and got["beside"] == alone
    k = after_marker(want, list(marker))
    assert want[:k] == alone[:k] and want != alone  # free up to the marker, held after it
    if kind == "json":  # the answer after the marker is the schema's JSON, ended by EOS
        assert want[-1] in engine.eos_ids
        answer = json.loads(engine.tokenizer.decode(want[k:-1]))
        assert set(answer) == {"color", "n"} and answer["color"] in ("red", "green")


def test_an_output_that_never_writes_the_marker_is_never_held(llama_dir):
    engine = small_engine(llama_dir)
    free = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    alone = run_requests(engine, [("free", PROMPT, free, None)])["free"]
    unused = next(t for t in range(engine.vocab_size) if t not in alone)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, structured_outputs=SPECS["json"],
                            structured_after=(alone[0], unused))  # fmt: skip
    assert run_requests(engine, [("s", PROMPT, params, None)])["s"] == alone
    grammar = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, structured_outputs=SPECS["json"])
    assert run_requests(engine, [("g", PROMPT, grammar, None)])["g"] != alone  # it would hold


def test_preempted_requests_keep_where_their_grammar_started(llama_dir, refs):
    engine = small_engine(llama_dir)
    free = SamplingParams(max_tokens=24, temperature=0.0)
    reqs = []
    for i in range(4):
        prompt = f"{PROMPT} {i}"
        alone = run_requests(engine, [("f", prompt, free, None)])["f"]
        params = SamplingParams(
            max_tokens=24,
            temperature=0.0,
            structured_outputs=SPECS["json"],
            structured_after=(alone[2],),
        )
        reqs.append((f"r{i}", prompt, params, refs["qv8"] if i % 2 else None))  # fmt: skip
    tight = small_engine(llama_dir, num_kv_blocks=9)
    got = run_requests(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    assert got == run_requests(small_engine(llama_dir), reqs)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"structured_after": (5,)}, "given without structured_outputs"),
        ({"structured_after": (5, -1), "structured_outputs": SPECS["json"]}, "got (5, -1)"),
        ({"structured_after": (1,) * (MAX_STRUCTURED_AFTER + 1),
          "structured_outputs": SPECS["json"]}, f"at most {MAX_STRUCTURED_AFTER} token ids"),
    ],
)  # fmt: skip
def test_bad_structured_after_is_refused(fields, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)) as e:
        SamplingParams(max_tokens=4, **fields)
    assert e.value.param == "structured_after"


def test_ids_past_the_vocabulary_are_refused_at_add(llama_dir):
    engine = small_engine(llama_dir)
    params = SamplingParams(max_tokens=4, structured_outputs=SPECS["json"],
                            structured_after=(3, engine.vocab_size))  # fmt: skip
    with pytest.raises(InvalidRequest, match=f"token id {engine.vocab_size} out of range") as e:
        engine.add_request("r", [1, 2, 3], params)
    assert e.value.param == "structured_after" and not engine.has_unfinished()
