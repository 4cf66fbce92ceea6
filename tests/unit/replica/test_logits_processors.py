"""logit_bias and the repetition / presence / frequency penalties against references
written here (float64 loops over tokens) and transformers' RepetitionPenaltyLogitsProcessor,
on fresh random logits and token histories, with untouched rows mixed in."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pytest
import torch

from replica.logits_processors import process_logits
from replica.sampler import SeedStream, sample
from replica.sampling_params import SamplingParams

VOCAB = 97


@dataclass
class History:
    tokens: list[int]
    prompt_len: int

    @cached_property
    def prompt_array(self) -> np.ndarray:
        return np.asarray(self.tokens[: self.prompt_len], dtype=np.int64)

    @cached_property
    def output_array(self) -> np.ndarray:
        return np.asarray(self.tokens[self.prompt_len :], dtype=np.int64)


def reference(logits: np.ndarray, p: SamplingParams, h: History) -> np.ndarray:
    """One row in float64, token by token: bias, then repetition over prompt and output,
    then OpenAI's presence / frequency over the output."""
    out = logits.astype(np.float64)
    for token, bias in p.logit_bias:
        out[token] += bias
    generated = h.tokens[h.prompt_len :]
    for j in set(h.tokens):
        out[j] = out[j] / p.repetition_penalty if out[j] > 0 else out[j] * p.repetition_penalty
    for j in set(generated):
        count = generated.count(j)
        out[j] -= p.presence_penalty * (count > 0) + p.frequency_penalty * count
    return out


def random_row(rng: random.Random, kind: str) -> tuple[SamplingParams, History]:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
    # a small alphabet, so output tokens repeat and overlap the prompt
    output = [rng.choice(prompt[:5] + [1, 2, 3]) for _ in range(rng.randrange(0, 30))]
    fields: dict = {}
    if kind in ("bias", "all"):
        ids = rng.sample(range(VOCAB), rng.randrange(1, 8))
        fields["logit_bias"] = tuple((t, rng.uniform(-100, 100)) for t in ids)
    if kind in ("repetition", "all"):
        fields["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0])
    if kind in ("openai", "all"):
        fields["presence_penalty"] = rng.uniform(-2, 2)
        fields["frequency_penalty"] = rng.uniform(-2, 2)
    return SamplingParams(**fields), History(prompt + output, len(prompt))


KINDS = ["none", "bias", "repetition", "openai", "all"]


@pytest.mark.parametrize("seed", range(6))
def test_mixed_rows_equal_the_float64_reference(seed):
    rng = random.Random(seed)
    kinds = [rng.choice(KINDS) for _ in range(12)] + ["none", "all"]
    rows = [random_row(rng, k) for k in kinds]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    params, history = [p for p, _ in rows], [h for _, h in rows]
    before = logits.clone()
    got = process_logits(logits, params, history)
    assert torch.equal(logits, before)  # the caller's logits stay raw
    for i, (p, h) in enumerate(rows):
        if kinds[i] == "none":
            assert torch.equal(got[i], logits[i])
            continue
        want = reference(logits[i].numpy(), p, h)
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-6, atol=1e-5)
        # the first step of a row with only presence / frequency: nothing to penalise yet
        idle = kinds[i] == "openai" and h.prompt_len == len(h.tokens)
        assert np.array_equal(want, logits[i].numpy()) == idle


def test_no_row_processing_returns_the_logits_themselves():
    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(), SamplingParams(temperature=0.0, top_k=5)] * 2
    assert process_logits(logits, params, None) is logits


@pytest.mark.parametrize("penalty", [0.25, 0.8, 1.2, 2.0])
def test_repetition_equals_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = random.Random(int(penalty * 100))
    hist = [random_row(rng, "none")[1] for _ in range(5)]
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    logits[0, hist[0].tokens[0]] = 0.0  # 0 stays 0 either way
    p = SamplingParams(repetition_penalty=penalty)
    got = process_logits(logits, [p] * 5, hist)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, h in enumerate(hist):
        want = hf(torch.tensor([h.tokens]), logits[i : i + 1].clone())[0]
        assert torch.equal(got[i], want)


def test_presence_and_frequency_count_only_generated_tokens():
    logits = torch.zeros(1, 6)
    h = History([1, 1, 2, 3, 3, 3, 4], prompt_len=3)  # output: 3, 3, 3, 4
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = process_logits(logits, [p], [h])
    assert got.tolist() == [[0.0, 0.0, 0.0, -1.25, -0.75, 0.0]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_minus_100_forbids_and_plus_100_forces(temperature):
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    top = logits.argmax(-1).tolist()
    forbid = [SamplingParams(temperature=temperature, logit_bias=((t, -100),)) for t in top]
    out = sample(logits, forbid, [SeedStream(i) for i in range(64)])
    assert all(tok != t for tok, t in zip(out.tokens, top, strict=True))
    low = logits.argmin(-1).tolist()
    force = [SamplingParams(temperature=temperature, logit_bias=((t, 100),)) for t in low]
    assert sample(logits, force, [SeedStream(i) for i in range(64)]).tokens == low


def test_logprobs_stay_those_of_the_raw_logits():
    logits = torch.randn(3, VOCAB) * 2
    p = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3, logit_bias=((7, 100),))
    h = [History([7, 8], 1)] * 3
    out = sample(
        logits, [p, SamplingParams(temperature=0.0, logprobs=True), p], [None] * 3, None, h
    )
    assert out.tokens[0] == out.tokens[2] == 7
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx(raw[torch.arange(3), out.tokens].tolist(), abs=1e-6)
    assert [t for t, _ in out.top[0]] == raw[0].topk(3).indices.tolist()


def test_the_plan_carries_everything_in_one_array():
    from replica.logits_processors import _Plan

    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(presence_penalty=0.5, logit_bias=((7, 1.5),)),
    ]
    history = [History([3, 4, 4], 1), History([9, 5], 1)]
    plan = _Plan.build([0, 1], [0, 1], params, history, n=2, vocab=10, banned=[(), ()])
    assert plan.words[: plan.num_seen].tolist() == [4, 4, 15, 3]
    assert plan.num_out == 3
    assert plan.words[plan.num_seen : plan.floats_at].tolist() == [17]
    floats = plan.words[plan.floats_at :].view(np.float32)
    assert floats[:6].tolist() == [2.0, 0.0, 0.0, 1.0, 0.0, 0.5]
    assert floats[6 : 6 + plan.num_bias].tolist() == [1.5]


def test_a_sequences_output_array_follows_its_tokens():
    from replica.sequence import Sequence

    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(5)]
    seq = Sequence("r", len(prompt), list(prompt), SamplingParams(), None, 0)
    assert seq.output_array.tolist() == [] and seq.prompt_array.tolist() == prompt
    seen = []
    for step in range(100):  # one token a step, sometimes several, read every step or not
        for _ in range(rng.choice([1, 1, 1, 3])):
            seq.tokens.append(rng.randrange(VOCAB))
        if rng.random() < 0.7:
            seen.append(seq.output_array)
            assert seen[-1].tolist() == seq.output_ids, step
    # the arrays handed out earlier kept their values while the buffer grew
    assert all(a.tolist() == seq.output_ids[: len(a)] for a in seen)


def test_non_contiguous_logits_are_processed_as_contiguous_ones():
    rng = random.Random(11)
    rows = [random_row(rng, "all") for _ in range(4)]
    wide = torch.randn(VOCAB, 4, generator=torch.Generator().manual_seed(11))
    logits = wide.t()  # [4, VOCAB], not contiguous
    params, history = [p for p, _ in rows], [h for _, h in rows]
    got = process_logits(logits, params, history)
    assert torch.equal(got, process_logits(logits.contiguous(), params, history))
