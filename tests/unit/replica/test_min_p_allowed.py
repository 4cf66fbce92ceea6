"""min_p and allowed_token_ids in the sampler and the logits processor: min_p keeps what
transformers' MinPLogitsWarper keeps and draws follow temperature -> min_p -> top_k ->
top_p (vLLM v1's order); allowed_token_ids masks every other token (greedy and not, after
logit_bias and the penalties); rows without them are untouched and cost nothing."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from lora_core.errors import InvalidRequest
from replica.logits_processors import _Plan, process_logits
from replica.sampler import SeedStream, _probs, sample
from replica.sampling_checks import ALLOWED_TOKEN_IDS_ALLOWED
from replica.sampling_params import SamplingParams
from tests.unit.replica.test_logits_processors import VOCAB, random_row, reference


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_min_p_keeps_what_transformers_keeps(min_p, temperature):
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    gen = torch.Generator().manual_seed(int(min_p * 100 + temperature * 10))
    logits = torch.randn(16, VOCAB, generator=gen) * 3
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * 16
    got = _probs(logits, params)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    scores = MinPLogitsWarper(min_p)(None, scores)
    assert torch.equal(got > 0, scores > float("-inf"))
    torch.testing.assert_close(got, torch.softmax(scores, -1), rtol=1e-5, atol=1e-7)


def test_rows_without_min_p_are_bit_identical_beside_min_p_rows():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    plain = [SamplingParams(temperature=0.8, top_p=0.9)] * 6
    mixed = [SamplingParams(temperature=0.8, top_p=0.9, min_p=0.2 * (i % 2)) for i in range(6)]
    assert torch.equal(_probs(logits, mixed)[0::2], _probs(logits, plain)[0::2])
    assert not torch.equal(_probs(logits, mixed)[1::2], _probs(logits, plain)[1::2])


def _oracle(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64 [V]: the distribution a row draws from, the obvious way: temperature,
    min_p against the most likely, top_k, the smallest top_p prefix of the renormalised
    rest (most likely first)."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
    order = probs.argsort(descending=True, stable=True)
    k = p.top_k or len(probs)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass, total = 0.0, probs[order[:k]].sum().item()
    for t in order[:k].tolist():
        keep[t] = mass < p.top_p and probs[t] > 0
        mass += probs[t].item() / total
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=1.5, min_p=0.3),
        SamplingParams(temperature=1.0, min_p=0.3, top_k=3),
        SamplingParams(temperature=1.0, min_p=0.3, top_p=0.7),
        SamplingParams(temperature=0.8, min_p=0.2, top_k=6, top_p=0.8),
    ],
    ids=["plain", "t1.5", "topk", "topp", "topk-topp"],
)
def test_min_p_draws_follow_the_kept_distribution(params):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(4)) * 1.5
    n = 40_000
    tokens = sample(logits.expand(n, -1).contiguous(), [params] * n, [None] * n).tokens
    freq = torch.bincount(torch.tensor(tokens), minlength=12).double() / n
    want = _oracle(logits, params)
    plain = _oracle(logits, SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                           top_p=params.top_p))  # fmt: skip
    assert (want > 0).sum() < (plain > 0).sum()  # min_p removed something here
    assert torch.all(freq[want == 0] == 0), (freq, want)
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-12), (freq, want)


def test_top_p_counts_the_mass_left_by_min_p():
    """vLLM's order: top_p's nucleus is of the min_p-renormalised distribution. probs
    [.5, .3, .15, .05]: min_p .4 leaves [.625, .375]; top_p .6 then keeps token 0 alone
    (HF's order, top_p first, would keep tokens 0 and 1)."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    p = SamplingParams(temperature=1.0, min_p=0.4, top_p=0.6)
    assert {sample(logits, [p], [SeedStream(s)]).tokens[0] for s in range(200)} == {0}
    p = SamplingParams(temperature=1.0, min_p=0.4, top_p=0.7)
    assert {sample(logits, [p], [SeedStream(s)]).tokens[0] for s in range(200)} == {0, 1}


@pytest.mark.parametrize("mode", [{}, {"top_k": 30}, {"top_p": 0.5}])
def test_seeded_min_p_rows_are_reproducible_and_batch_invariant(mode):
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(9)) * 0.7
    params = [SamplingParams(temperature=1.0, min_p=0.2, seed=i, **mode) for i in range(6)]
    params[3] = SamplingParams(temperature=0.9, seed=3, **mode)  # no min_p, beside them

    def streams(rows):
        return [SeedStream(100 + i) for i in rows]

    together = sample(logits, params, streams(range(6))).tokens
    alone = [sample(logits[i : i + 1], [params[i]], streams([i])).tokens[0] for i in range(6)]
    assert together == alone
    assert sample(logits, params, streams(range(6))).tokens == together
    assert len(set(together)) > 1


def test_min_p_leaves_greedy_rows_alone():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=0.0, min_p=1.0, logprobs=True)
    out = sample(logits, [p] * 8, [None] * 8)
    assert out.tokens == logits.argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx(raw[torch.arange(8), out.tokens].tolist(), abs=1e-6)


def _allowed_rows(seed: int) -> tuple[list[SamplingParams], list, list]:
    """Rows of every kind (reference() does bias and penalties), about half with
    allowed_token_ids, and a banned token in some."""
    rng = random.Random(seed)
    params, history, banned = [], [], []
    for i in range(14):
        p, h = random_row(rng, rng.choice(["none", "bias", "repetition", "openai", "all"]))
        if i % 2:
            ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
            p = SamplingParams(**{**_fields(p), "allowed_token_ids": ids})
        params.append(p)
        history.append(h)
        banned.append((rng.randrange(VOCAB),) if i % 3 == 0 else ())
    return params, history, banned


def _fields(p: SamplingParams) -> dict:
    names = ("logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty")
    return {k: getattr(p, k) for k in names}


@pytest.mark.parametrize("seed", range(4))
def test_allowed_token_ids_mask_every_other_token_after_bias_and_penalties(seed):
    params, history, banned = _allowed_rows(seed)
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    before = logits.clone()
    got = process_logits(logits, params, history, banned)
    assert torch.equal(logits, before)  # the caller's logits stay raw
    for i, (p, h) in enumerate(zip(params, history, strict=True)):
        want = reference(logits[i].numpy(), p, h)
        want[list(banned[i])] = -np.inf
        if p.allowed_token_ids is not None:
            off = np.ones(VOCAB, dtype=bool)
            off[list(p.allowed_token_ids)] = False
            want[off] = -np.inf
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_only_allowed_tokens_are_sampled_and_logprobs_stay_raw(temperature):
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(6)) * 3
    rng = random.Random(6)
    allowed = [rng.sample(range(VOCAB), rng.randrange(1, 6)) for _ in range(64)]
    params = [
        SamplingParams(temperature=temperature, allowed_token_ids=a, logprobs=True, top_k=i % 3)
        for i, a in enumerate(allowed)
    ]
    out = sample(logits, params, [SeedStream(i) for i in range(64)])
    assert all(t in a for t, a in zip(out.tokens, allowed, strict=True))
    if temperature == 0.0:
        best = [max(a, key=lambda t, i=i: logits[i, t].item()) for i, a in enumerate(allowed)]
        assert out.tokens == best
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx(raw[torch.arange(64), out.tokens].tolist(), abs=1e-6)


def test_no_row_with_them_returns_the_logits_themselves():
    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(min_p=0.5), SamplingParams(temperature=0.0, min_p=0.1)] * 2
    assert process_logits(logits, params, None) is logits


def test_the_plan_carries_the_allowed_ids_and_their_rows():
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(logit_bias=((7, 1.5),), allowed_token_ids=(7, 2, 7)),
    ]
    from tests.unit.replica.test_logits_processors import History

    history = [History([3, 4, 4], 1), History([9, 5], 1)]
    plan = _Plan.build([0, 1], [0], params, history, n=2, vocab=10, banned=[(), ()])
    assert plan.words[plan.num_seen : plan.allowed_at].tolist() == [17]
    assert plan.words[plan.allowed_at : plan.masked_at].tolist() == [12, 17]
    assert plan.words[plan.masked_at : plan.floats_at].tolist() == [1]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("min_p", -0.1, "min_p=-0.1; allowed: a number 0 <= min_p <= 1 (0 = off)"),
        ("min_p", 1.5, "min_p=1.5; allowed: a number 0 <= min_p <= 1 (0 = off)"),
        ("min_p", float("nan"), "min_p=nan; allowed"),
        ("min_p", True, "min_p=True; allowed"),
        ("min_p", "0.1", "min_p='0.1'; allowed"),
        ("allowed_token_ids", [], "allowed_token_ids: an empty list allows no token; "),
        ("allowed_token_ids", [1, -1], "allowed_token_ids: token id -1; "),
        ("allowed_token_ids", [True], "allowed_token_ids: token id True; "),
        ("allowed_token_ids", [3, None], "allowed_token_ids: token id None; "),
        ("allowed_token_ids", "5", "allowed_token_ids: got str; "),
        ("allowed_token_ids", [0] * 262_145, "allowed_token_ids: 262145 token ids; "),
    ],
)
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(message) and e.value.param == field
    if field == "allowed_token_ids":
        assert str(e.value).endswith(ALLOWED_TOKEN_IDS_ALLOWED)


def test_allowed_values_are_normalised():
    p = SamplingParams(min_p=1, allowed_token_ids=[5, 3, 5, 0])
    assert (p.min_p, p.allowed_token_ids) == (1.0, (0, 3, 5))
    assert p.allowed_array.tolist() == [0, 3, 5] and p.processes_logits
    # a choice's params (n > 1) keep them, not checked again
    assert dataclasses.replace(p, seed=1).allowed_token_ids == (0, 3, 5)
    assert not SamplingParams(min_p=0.3).processes_logits
