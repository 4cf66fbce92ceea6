"""Prompt logprobs (SamplingParams.prompt_logprobs) in float32 equal log_softmax of an HF
transformers (+ PEFT) forward over the prompt, token by token: in chunked prefill, with
the prompt already in the prefix cache (hits carry no logits, so they must not be taken),
through preemption (a recomputed chunk scores nothing twice), and with max_tokens 0 (the
prompt only: no token, finish "length")."""

from __future__ import annotations

import pytest
import torch

from replica.outputs import RequestOutput
from replica.prompt_logprobs import SCORE_ROWS
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_logp
from tests.unit.replica.engines import small_engine

PROMPT = "the quick brown fox jumps over the lazy dog and runs far away from home"
K = 3


def _run(engine, requests) -> dict[str, dict]:
    for rid, ids, params, ref in requests:
        engine.add_request(rid, ids, params, ref)
    got = {rid: {"ids": [], "outs": []} for rid, *_ in requests}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id]["ids"] += o.new_token_ids
            got[o.request_id]["outs"].append(o)
    return got


def _prompt_lps(outs) -> RequestOutput:
    """The one output that carries prompt logprobs."""
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carrying) == 1, [o.prompt_logprobs for o in outs]
    return carrying[0]


def _check(out: RequestOutput, logp: torch.Tensor, prompt: list[int], k: int) -> None:
    lps, top = out.prompt_logprobs, out.prompt_top_logprobs
    want = logp[torch.arange(len(prompt) - 1), prompt[1:]]
    assert lps == pytest.approx(want.tolist(), abs=1e-4)
    # rank: 1 + the tokens at least as likely as the prompt token, but for tokens within
    # float32 noise (1e-4) of it, which HF's forward may order either way
    above = (logp > want[:, None] + 1e-4).sum(-1).add(1).tolist()
    near = (logp >= want[:, None] - 1e-4).sum(-1).tolist()
    assert len(out.prompt_ranks) == len(lps)
    assert all(a <= r <= b for a, r, b in zip(above, out.prompt_ranks, near, strict=True))
    assert out.prompt_ranks != [1] * len(lps)  # the tiny model's prompt tokens are no argmax
    if not k:
        assert top is None
        return
    values, ids = logp.topk(k, dim=-1)
    assert [[t for t, _ in row] for row in top] == ids.tolist()
    assert [[v for _, v in row] for row in top] == [pytest.approx(r, abs=1e-4) for r in values]


@pytest.mark.parametrize("adapter", [None, "qv8"])
def test_chunked_prompt_in_the_prefix_cache_is_scored_by_its_own_forward(
    llama_dir, llama_adapters, refs, adapter
):
    engine = small_engine(llama_dir, max_num_batched_tokens=8)
    prompt = engine.tokenizer(PROMPT).input_ids
    ref = refs[adapter] if adapter else None
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    warm = _run(engine, [("warm", prompt, greedy, ref)])
    before = engine.computed_tokens
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    got = _run(engine, [("scored", prompt, scored, ref)])["scored"]
    assert engine.computed_tokens - before >= len(prompt)  # no prefix hit was taken
    assert got["ids"] == warm["warm"]["ids"]
    out = _prompt_lps(got["outs"])
    assert got["outs"][0].prompt_logprobs is not None  # with the first token
    logp = hf_logp(llama_dir, llama_adapters[adapter] if adapter else None, prompt)[:-1]
    _check(out, logp, prompt, K)


def test_max_tokens_zero_runs_the_prompt_only(llama_dir, llama_adapters, refs):
    engine = small_engine(llama_dir, max_num_batched_tokens=8)
    prompt = engine.tokenizer(PROMPT).input_ids
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    got = _run(engine, [("p", prompt, params, refs["qv8"])])["p"]
    (out,) = got["outs"]
    assert (out.new_token_ids, out.finish_reason, out.num_output_tokens) == ([], "length", 0)
    logp = hf_logp(llama_dir, llama_adapters["qv8"], prompt)[:-1]
    _check(out, logp, prompt, 0)
    assert not engine.has_unfinished() and engine.blocks.usage() == 0.0


def test_preempted_scoring_requests_score_each_token_once(llama_dir, llama_adapters, refs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    prompts = [tok(f"{PROMPT} {w}").input_ids for w in ("a", "b c", "d e f")]
    # KV for the longest request and 2 blocks more, 4-token blocks: three running
    # requests cannot all grow, so some are preempted (and recompute their chunks)
    blocks = -(-(max(map(len, prompts)) + 6) // 4) + 2
    engine = small_engine(llama_dir, num_kv_blocks=blocks, max_num_batched_tokens=12)
    names = [None, "qv8", "qv8"]
    reqs = [
        (
            str(i),
            p,
            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
            refs[n] if n else None,
        )
        for i, (p, n) in enumerate(zip(prompts, names, strict=True))
    ]
    got = _run(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    for i, (p, n) in enumerate(zip(prompts, names, strict=True)):
        logp = hf_logp(llama_dir, llama_adapters[n] if n else None, p)[:-1]
        _check(_prompt_lps(got[str(i)]["outs"]), logp, p, 2)


def test_a_one_token_prompt_has_no_prompt_logprobs(llama_dir):
    engine = small_engine(llama_dir)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    got = _run(engine, [("one", [5], params, None)])["one"]
    out = _prompt_lps(got["outs"])
    assert (out.prompt_logprobs, out.prompt_ranks, out.prompt_top_logprobs) == ([], [], [])


@pytest.mark.parametrize(
    ("model", "repeat", "batched"),
    # odd 8 x 512: one step of 2 SCORE_ROWS chunks; as the worker's first step it is also
    # its process's first multi-threaded cos / sin (replica.vml_warmup)
    [("llama", 1, 8), ("odd_vocab", 1, 8), ("odd_vocab", 8, 512)],
)
def test_a_tensor_parallel_driver_scores_prompts(
    model, repeat, batched, llama_adapters, refs, request
):
    """tp 2 (gloo): the driver scores the prompt from the logits it gathers from both
    ranks' vocab shards (V 383 is padded to 384 on rank 1): in 8-token chunks, and a
    prompt longer than SCORE_ROWS in one step (the worker follows each lm_head call)."""
    model_dir = request.getfixturevalue(f"{model}_dir")
    engine = small_engine(model_dir, tensor_parallel_size=2, max_num_batched_tokens=batched)
    try:
        prompt = engine.tokenizer(" ".join([PROMPT] * repeat)).input_ids
        assert (len(prompt) > SCORE_ROWS + 1) == (repeat > 1)
        params = SamplingParams(max_tokens=0, prompt_logprobs=K)
        (out,) = _run(engine, [("p", prompt, params, refs["qv8"])])["p"]["outs"]
    finally:
        engine.close()
    logp = hf_logp(model_dir, llama_adapters["qv8"], prompt)[:-1]
    _check(out, logp, prompt, K)
