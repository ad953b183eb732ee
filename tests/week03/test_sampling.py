"""Week 3: the batched sampler against HuggingFace's logits processors, and by statistics."""

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sampler import filtered_logits, make_generator, sample


@pytest.mark.exercise("validate-params")
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(seed="abc"), "seed"),
        (dict(seed=2**64), "seed"),
    ],
)
def test_invalid_params_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.exercise("validate-params")
def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


def hf_filter(logits, p: SamplingParams, seen=None):
    """HF's processors in generate()'s order, one row."""
    x = logits[None].clone()
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([seen]), x)
    if p.temperature not in (0, 1.0):
        x = TemperatureLogitsWarper(p.temperature)(None, x)
    if p.top_k:
        x = TopKLogitsWarper(p.top_k)(None, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(None, x)
    return x[0]


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(top_p=0.8),
    SamplingParams(temperature=0.5, top_k=40, top_p=0.9),
    SamplingParams(top_k=1),
    SamplingParams(temperature=0.9, top_p=0.3, repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),
]


@pytest.mark.exercise("repetition-penalty", "top-k-top-p")
@pytest.mark.parametrize("p", CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-r{p.repetition_penalty}")
def test_filtered_distribution_matches_hf(p):
    logits = torch.randn(4, 100) * 3
    seen = [[1, 2, 3, 50], [7], [99, 99, 0], [10, 20, 30]]
    ours = filtered_logits(logits, [p] * 4, seen).softmax(-1)
    for i in range(4):
        theirs = hf_filter(logits[i], p, seen[i]).softmax(-1)
        torch.testing.assert_close(ours[i], theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.exercise("repetition-penalty", "top-k-top-p")
def test_rows_keep_their_own_params():
    logits = torch.randn(len(CASES), 100) * 3
    seen = [[3, 4]] * len(CASES)
    together = filtered_logits(logits, CASES, seen).softmax(-1)
    for i, p in enumerate(CASES):
        alone = filtered_logits(logits[i : i + 1], [p], [seen[i]]).softmax(-1)
        torch.testing.assert_close(together[i : i + 1], alone)
        torch.testing.assert_close(together[i], hf_filter(logits[i], p, seen[i]).softmax(-1), atol=1e-6, rtol=1e-5)


@pytest.mark.exercise("top-k-top-p", "sample")
def test_sampled_frequencies_match_filtered_probabilities():
    """20 000 draws land on each token as often as its filtered probability says (5 sigma)."""
    torch.manual_seed(1234)
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.1, -0.5, -1.0, -2.0, -3.0])
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    probs = filtered_logits(logits[None], [p]).softmax(-1)[0]
    n = 20_000
    draws = sample(logits.expand(n, -1).clone(), [p] * n)
    freq = torch.bincount(draws, minlength=len(logits)).float() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert (freq - probs).abs().le(5 * sigma + 1e-9).all(), (freq, probs)
    assert freq[probs == 0].sum() == 0  # filtered-out tokens are never drawn
    assert (probs > 0).sum() >= 3  # the test exercised a real choice


@pytest.mark.exercise("sample")
def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=1.0)] * 2
    out = sample(logits, params)
    assert torch.equal(out[:3], logits[:3].argmax(-1))


@pytest.mark.exercise("sample")
def test_seeded_requests_reproduce_whatever_shares_the_batch():
    logits = torch.randn(6, 300)
    params = [SamplingParams(temperature=1.0, seed=7 + i) for i in range(6)]

    def draw_steps(rows):
        gens = [make_generator(params[i].seed, "cpu") for i in rows]
        return [sample(logits[rows], [params[i] for i in rows], gens).tolist() for _ in range(20)]

    full = draw_steps(list(range(6)))
    assert full == draw_steps(list(range(6)))  # same seeds, same tokens
    alone = draw_steps([2])
    assert [step[2] for step in full] == [step[0] for step in alone]  # batch-mates do not matter
    mixed = [SamplingParams(temperature=1.0)] + [params[2]]  # an unseeded neighbour
    gens = [None, make_generator(params[2].seed, "cpu")]
    got = [sample(logits[[0, 2]], mixed, gens)[1].item() for _ in range(20)]
    assert got == [step[0] for step in alone]
    assert len({t for step in full for t in step}) > 6  # the draws really vary
