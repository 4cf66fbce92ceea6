"""The batched sampler on CUDA: draws follow each row's kept distribution, a seeded row
gives the same tokens whatever shares its batch, and logprobs equal log_softmax."""

import pytest
import torch

from replica.sampler import SeedStream, sample
from replica.sampling_params import SamplingParams
from tests.unit.replica.test_sampler import _kept_distribution

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
KINDS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=4),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.2, top_k=6, top_p=0.7),
]


def test_mixed_rows_follow_their_distributions_on_cuda():
    logits = torch.randn(16) * 1.5
    n = 50_000
    params = [KINDS[i % len(KINDS)] for i in range(n * len(KINDS))]
    rows = logits.to(CUDA).expand(len(params), -1).contiguous()
    tokens = torch.tensor(sample(rows, params, [None] * len(params)).tokens)
    for j, p in enumerate(KINDS):
        freq = torch.bincount(tokens[j :: len(KINDS)], minlength=16).double() / n
        want = _kept_distribution(logits, p)
        assert torch.all(freq[want == 0] == 0), (p, freq, want)
        sigma = (want * (1 - want) / n).sqrt()
        assert torch.all((freq - want).abs() <= 5 * sigma + 1e-12), (p, freq, want)


def test_seeded_rows_are_batch_invariant_on_cuda():
    vocab = 128256
    logits = torch.randn(8, vocab, device=CUDA) * 3
    p = SamplingParams(temperature=0.8, top_p=0.95, seed=3)

    def gens():
        return [SeedStream(100 + i) for i in range(8)]

    together = sample(logits, [p] * 8, gens()).tokens
    alone = [sample(logits[i : i + 1], [p], [gens()[i]]).tokens[0] for i in range(8)]
    assert together == alone
    mixed = [p if i % 2 else SamplingParams(temperature=0.0) for i in range(8)]
    out = sample(logits, mixed, gens())
    assert out.tokens[0::2] == logits[0::2].argmax(-1).tolist()
    assert out.tokens[1::2] == together[1::2]


def test_logprobs_of_drawn_tokens_on_cuda():
    logits = torch.randn(32, 1000, device=CUDA) * 2
    p = SamplingParams(temperature=0.7, top_k=50, logprobs=True, top_logprobs=5)
    out = sample(logits, [p] * 32, [None] * 32)
    ref = torch.log_softmax(logits.double(), -1)
    picked = ref[torch.arange(32), torch.tensor(out.tokens, device=CUDA)]
    assert out.logprobs == pytest.approx(picked.tolist(), abs=1e-5)
    values, ids = ref.topk(5, -1)
    assert [[t for t, _ in row] for row in out.top] == ids.tolist()


def test_non_finite_rows_are_reported_on_cuda():
    """The old per-row sampler hit a device assert on a NaN row, which killed the CUDA
    context; now the row is reported and the others draw as they would alone."""
    logits = torch.randn(8, 1000, device=CUDA) * 2
    logits[1, 5] = float("nan")
    logits[2, :] = float("nan")
    logits[6, 3] = float("inf")
    logits[7, 100:] = float("-inf")  # masked tokens, still a good row
    params = [KINDS[i % len(KINDS)] for i in range(8)]

    def gens(rows):
        return [SeedStream(50 + i) for i in rows]

    out = sample(logits, params, gens(range(8)))
    assert out.non_finite == [1, 2, 6]
    good = [0, 3, 4, 5, 7]
    alone = sample(logits[good], [params[i] for i in good], gens(good))
    assert [out.tokens[i] for i in good] == alone.tokens and out.tokens[7] < 100
    assert all(0 <= t < 1000 for t in out.tokens)  # bad rows still carry a valid id
    torch.cuda.synchronize()  # the context is still healthy


MIN_P_KINDS = [
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=1.0, min_p=0.3, top_k=6),
    SamplingParams(temperature=1.2, min_p=0.2, top_p=0.8),
]


def test_min_p_rows_follow_their_distributions_on_cuda():
    from tests.unit.replica.test_min_p_allowed import _oracle

    logits = torch.randn(16, generator=torch.Generator().manual_seed(8)) * 1.5
    n = 50_000
    params = [MIN_P_KINDS[i % len(MIN_P_KINDS)] for i in range(n * len(MIN_P_KINDS))]
    rows = logits.to(CUDA).expand(len(params), -1).contiguous()
    tokens = torch.tensor(sample(rows, params, [None] * len(params)).tokens)
    for j, p in enumerate(MIN_P_KINDS):
        freq = torch.bincount(tokens[j :: len(MIN_P_KINDS)], minlength=16).double() / n
        want = _oracle(logits, p)
        assert torch.all(freq[want == 0] == 0), (p, freq, want)
        sigma = (want * (1 - want) / n).sqrt()
        assert torch.all((freq - want).abs() <= 5 * sigma + 1e-12), (p, freq, want)


def test_seeded_min_p_rows_are_batch_invariant_on_cuda():
    """Rows with min_p beside rows without: each draws what it draws alone (the rows
    without min_p are not renormalised by their neighbours')."""
    vocab = 128256
    logits = torch.randn(8, vocab, device=CUDA) * 3
    params = [
        SamplingParams(temperature=0.9, min_p=0.05 * (i % 2), top_p=0.95 if i % 3 else 1.0)
        for i in range(8)
    ]

    def gens():
        return [SeedStream(200 + i) for i in range(8)]

    together = sample(logits, params, gens()).tokens
    alone = [sample(logits[i : i + 1], [params[i]], [gens()[i]]).tokens[0] for i in range(8)]
    assert together == alone
