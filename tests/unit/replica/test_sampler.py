import numpy as np
import pytest
import torch

from lora_core.errors import InvalidRequest
from replica.detokenizer import _holdback
from replica.sampler import SeedStream, sample, seeded_uniforms
from replica.sampling_params import SamplingParams


def _gen(seed):
    return SeedStream(seed)


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.0, logprobs=True)] * 3
    tokens, lps, top, bad = sample(logits, params, [None] * 3)
    assert tokens == logits.argmax(-1).tolist() and bad == []
    ref = torch.log_softmax(logits, -1)[torch.arange(3), logits.argmax(-1)]
    assert lps == pytest.approx(ref.tolist(), abs=1e-6)
    assert top is None


def test_nothing_computed_when_no_row_asks():
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5)]
    assert sample(logits, params, [None, _gen(0)])[1:] == (None, None, [])


@pytest.mark.parametrize("ks", [(1,), (5, 0, 20), (0, 3)])
def test_top_logprobs_are_topk_of_raw_log_softmax(ks):
    logits = torch.randn(len(ks), 64) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=10, logprobs=True, top_logprobs=k, seed=i)
        for i, k in enumerate(ks)
    ]
    tokens, lps, top, _ = sample(logits, params, [_gen(i) for i in range(len(ks))])
    ref = torch.log_softmax(logits, -1)
    assert lps == pytest.approx(ref[torch.arange(len(ks)), tokens].tolist(), abs=1e-6)
    for i, k in enumerate(ks):
        values, ids = ref[i].topk(k)
        assert [t for t, _ in top[i]] == ids.tolist()
        assert [lp for _, lp in top[i]] == pytest.approx(values.tolist(), abs=1e-6)


@pytest.mark.parametrize("top_k", [40, 0], ids=["top-k path", "nucleus rejection path"])
def test_seeded_sampling_reproducible_and_batch_invariant(top_k):
    # top_p 0.3 over flat logits: the nucleus path rejects often, so rows take different
    # numbers of rounds; a seeded row's tokens still do not depend on its neighbours
    logits = torch.randn(4, 100) * (3.0 if top_k else 0.5)
    p = SamplingParams(temperature=0.9, top_p=0.3 if not top_k else 0.9, top_k=top_k, seed=7)
    alone = [sample(logits[i : i + 1], [p], [_gen(100 + i)])[0][0] for i in range(4)]
    together = sample(logits, [p] * 4, [_gen(100 + i) for i in range(4)])[0]
    assert alone == together
    again = sample(logits, [p] * 4, [_gen(100 + i) for i in range(4)])[0]
    assert again == together


def test_non_finite_rows_are_reported_and_leave_the_others_alone():
    """NaN / +inf / all -inf rows of every sampling path are reported (-inf beside finite
    logits only masks tokens); the other rows draw exactly
    what they draw without them; the nucleus rejection rounds do not stall on them."""
    logits = torch.randn(8, 100) * 2
    logits[1, 5] = float("nan")
    logits[3, :] = float("-inf")
    logits[5, 7] = float("inf")
    logits[6, :] = float("nan")
    logits[7, 10:] = float("-inf")  # masked tokens, still a good row
    paths = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=0.8, top_p=0.2),
        SamplingParams(temperature=0.8),
    ]
    params = [paths[i % 4] for i in range(8)]
    out = sample(logits, params, [None if p.greedy else _gen(i) for i, p in enumerate(params)])
    assert out.non_finite == [1, 3, 5, 6]
    good = [0, 2, 4, 7]
    alone = sample(logits[good], [params[i] for i in good], [None, _gen(2), None, _gen(7)])
    assert [out.tokens[i] for i in good] == alone.tokens and alone.non_finite == []
    assert out.tokens[7] < 10
    assert all(0 <= t < 100 for t in out.tokens)  # bad rows still carry a valid id


def test_seed_streams_are_uniform_distinct_and_reproducible():
    streams = [SeedStream(seed) for seed in (0, 1, 2**63 - 1, -(2**63), -1, 12345)]
    draws = np.stack([seeded_uniforms(streams) for _ in range(20_000)])  # [20000, 6]
    assert draws.dtype == np.float32 and 0.0 <= draws.min() and draws.max() < 1.0
    n = draws.shape[0]
    for col in draws.T:
        # 16 equal bins: each count within 5 sigma of n / 16; mean and variance of U(0, 1)
        counts = np.bincount((col * 16).astype(int), minlength=16)
        sigma = (n / 16 * (1 - 1 / 16)) ** 0.5
        assert np.all(np.abs(counts - n / 16) < 5 * sigma), counts
        assert abs(col.mean() - 0.5) < 5 * (1 / 12 / n) ** 0.5
        assert abs(col.var() - 1 / 12) < 0.005
    # successive draws are uncorrelated, and different seeds give different streams
    assert abs(np.corrcoef(draws[:-1, 0], draws[1:, 0])[0, 1]) < 5 / n**0.5
    assert abs(np.corrcoef(draws[:, 0], draws[:, 1])[0, 1]) < 5 / n**0.5
    assert len({tuple(col[:8]) for col in draws.T}) == len(streams)
    again = [SeedStream(seed) for seed in (0, 1, 2**63 - 1, -(2**63), -1, 12345)]
    assert np.array_equal(seeded_uniforms(again), draws[0])
    assert [st.drawn for st in again] == [1] * len(streams)


def _kept_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The oracle: float64 [V] probabilities a row is sampled from, written the obvious
    way (temperature, then top-k, then the smallest top-p prefix of the renormalised
    rest, most likely first)."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    order = probs.argsort(descending=True, stable=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = p.top_k or len(probs)
    keep[order[:k]] = True
    kept = torch.where(keep, probs, 0.0)
    kept = kept / kept.sum()
    mass = 0.0
    for t in order[:k].tolist():
        if mass >= p.top_p:
            keep[t] = False
        mass += kept[t].item()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=0.8, top_p=0.7),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.6),
    ],
    ids=["t1", "t0.5", "topk3", "topp0.7", "topk5-topp0.6"],
)
def test_draws_follow_the_kept_distribution(params):
    torch.manual_seed(0)
    logits = torch.randn(12) * 1.5
    n = 40_000  # rows of one call: one batch, one draw per row
    tokens = sample(logits.expand(n, -1).contiguous(), [params] * n, [None] * n).tokens
    freq = torch.bincount(torch.tensor(tokens), minlength=12).double() / n
    want = _kept_distribution(logits, params)
    assert torch.all(freq[want == 0] == 0), (freq, want)
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-12), (freq, want)


def test_mixed_rows_each_follow_their_own_distribution():
    torch.manual_seed(1)
    logits = torch.randn(10) * 1.5
    kinds = [
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_k=6),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=0.0),
    ]
    n = 20_000
    params = [kinds[i % len(kinds)] for i in range(n * len(kinds))]
    tokens = torch.tensor(sample(logits.expand(len(params), -1).contiguous(), params,
                                 [None] * len(params)).tokens)  # fmt: skip
    for j, p in enumerate(kinds):
        freq = torch.bincount(tokens[j :: len(kinds)], minlength=10).double() / n
        if p.greedy:
            assert freq[logits.argmax()] == 1.0
            continue
        want = _kept_distribution(logits, p)
        assert torch.all(freq[want == 0] == 0), (p, freq, want)
        sigma = (want * (1 - want) / n).sqrt()
        assert torch.all((freq - want).abs() <= 5 * sigma + 1e-12), (p, freq, want)


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])  # probs ~[0.64, 0.24, 0.09, 0.03]
    kept = _kept_distribution(logits, SamplingParams(temperature=1.0, top_k=2)) > 0
    assert kept.tolist() == [True, True, False, False]
    kept = _kept_distribution(logits, SamplingParams(temperature=1.0, top_p=0.8)) > 0
    assert kept.tolist() == [True, True, False, False]
    kept = _kept_distribution(logits, SamplingParams(temperature=1.0, top_p=0.5)) > 0
    assert kept.tolist() == [True, False, False, False]
    for p in [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.8)]:
        picks = {sample(logits[None], [p], [_gen(s)]).tokens[0] for s in range(60)}
        assert picks == {0, 1}


def test_sampling_never_picks_filtered_tokens():
    logits = torch.tensor([[5.0, 4.9, -1.0, -2.0]])
    p = SamplingParams(temperature=1.0, top_k=2)
    picks = {sample(logits, [p], [_gen(s)])[0][0] for s in range(50)}
    assert picks == {0, 1}


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", -1),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", True),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("stop", [""]),
        ("max_tokens", True),
        ("temperature", 2.5),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("seed", False),
        ("top_logprobs", -1),
        ("top_logprobs", 21),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**{field: value})


def test_top_logprobs_need_logprobs():
    with pytest.raises(InvalidRequest, match="top_logprobs=3 needs logprobs"):
        SamplingParams(top_logprobs=3)
    assert SamplingParams(logprobs=True, top_logprobs=20).top_logprobs == 20


def test_holdback_of_partial_stop_strings():
    assert _holdback("hello wor", ("world",)) == 3
    assert _holdback("hello", ("xyz",)) == 0
    assert _holdback("ab", ("abc", "b!")) == 2


@pytest.mark.parametrize("temperature", [1e-20, 1e-38, 1e-45, 1e-46, 5e-324])
@pytest.mark.parametrize("mode", [{}, {"top_k": 5}, {"top_p": 0.5}])
def test_tiny_temperature_draws_the_argmax(temperature, mode):
    """A valid but tiny temperature is (near-)greedy: logits / t used to overflow to inf
    (or t rounded to 0 in float32), softmax gave NaN and the draw an arbitrary token."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 5
    logits[1, 7] = float("-inf")  # a masked token beside finite ones stays masked
    params = [SamplingParams(temperature=temperature, seed=i, **mode) for i in range(4)]
    tokens, _, _, bad = sample(logits, params, [_gen(i) for i in range(4)])
    assert tokens == logits.argmax(-1).tolist() and bad == []
