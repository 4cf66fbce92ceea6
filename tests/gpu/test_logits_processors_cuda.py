"""logit_bias and the penalties on CUDA equal the CPU result on the same inputs (Llama-3's
vocabulary, penalised rows mixed with untouched ones), and pick the same greedy tokens."""

import random

import pytest
import torch

from replica.logits_processors import process_logits
from replica.sampler import SeedStream, sample
from replica.sampling_params import SamplingParams
from tests.unit.replica.test_logits_processors import History

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
VOCAB = 128256


def _rows(n: int, seed: int) -> tuple[list[SamplingParams], list[History]]:
    rng = random.Random(seed)
    params, history = [], []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 2000))]
        output = [rng.choice(prompt[:20]) for _ in range(rng.randrange(0, 300))]
        kind = i % 4
        fields: dict = {}
        if kind in (1, 3):
            ids = rng.sample(range(VOCAB), 300)
            fields["logit_bias"] = tuple((t, rng.uniform(-100, 100)) for t in ids)
        if kind in (2, 3):
            fields.update(
                repetition_penalty=rng.uniform(0.5, 2.0),
                presence_penalty=rng.uniform(-2, 2),
                frequency_penalty=rng.uniform(-2, 2),
            )
        params.append(SamplingParams(temperature=0.0, **fields))
        history.append(History(prompt + output, len(prompt)))
    return params, history


@pytest.mark.parametrize("n", [1, 8, 128])
def test_cuda_equals_cpu(n):
    params, history = _rows(n, seed=n)
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(n)) * 4
    cpu = process_logits(logits, params, history)
    gpu = process_logits(logits.to(CUDA), params, history).cpu()
    for i, p in enumerate(params):
        if not p.processes_logits:
            assert torch.equal(gpu[i], logits[i])
    torch.testing.assert_close(gpu, cpu, rtol=1e-6, atol=1e-5)
    tokens = sample(logits.to(CUDA), params, [None] * n, None, history).tokens
    assert tokens == cpu.argmax(-1).tolist()


def test_nothing_is_done_on_cuda_when_no_row_asks():
    logits = torch.randn(64, VOCAB, device=CUDA)
    params = [SamplingParams(temperature=0.7, top_k=50)] * 64
    assert process_logits(logits, params, None) is logits


def test_forbidden_and_forced_tokens_on_cuda():
    logits = torch.randn(64, VOCAB, device=CUDA) * 3
    top, low = logits.argmax(-1).tolist(), logits.argmin(-1).tolist()
    forbid = [SamplingParams(temperature=1.0, logit_bias=((t, -100),)) for t in top]
    out = sample(logits, forbid, [SeedStream(i) for i in range(64)])
    assert all(tok != t for tok, t in zip(out.tokens, top, strict=True))
    force = [SamplingParams(temperature=1.0, logit_bias=((t, 100),)) for t in low]
    assert sample(logits, force, [SeedStream(i) for i in range(64)]).tokens == low


@pytest.mark.parametrize("n", [1, 8, 128])
def test_allowed_token_ids_on_cuda_equal_cpu(n):
    """allowed_token_ids (sets of 1 to 50k ids) beside bias / penalties / untouched rows:
    the same logits as on CPU, -inf outside each set, greedy picks inside it."""
    params, history = _rows(n, seed=100 + n)
    rng = random.Random(n)
    for i in range(0, n, 2):
        ids = rng.sample(range(VOCAB), rng.choice([1, 7, 300, 50_000]))
        fields = {
            k: getattr(params[i], k)
            for k in ("logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty")
        }
        params[i] = SamplingParams(temperature=0.0, allowed_token_ids=ids, **fields)
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(n)) * 4
    cpu = process_logits(logits, params, history)
    gpu = process_logits(logits.to(CUDA), params, history).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-6, atol=1e-5)
    tokens = sample(logits.to(CUDA), params, [None] * n, None, history).tokens
    assert tokens == cpu.argmax(-1).tolist()
    for i in range(0, n, 2):
        allowed = torch.zeros(VOCAB, dtype=torch.bool)
        allowed[list(params[i].allowed_token_ids)] = True
        assert (
            torch.all(gpu[i][~allowed] == float("-inf"))
            and tokens[i] in params[i].allowed_token_ids
        )
