"""Week 10 (issue 17): the OpenAI sampling fields inside the sampler. `logit_bias` against HF's
`SequenceBiasLogitsProcessor` (in HF's order, before its repetition penalty, temperature, top-k
and top-p); presence and frequency penalties against OpenAI's formula, written out by hand (HF
has no processor for them); logprobs from the raw logits, whatever the request's settings."""

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nanoserve.sampling.sampler import Sampler, filtered_logits, token_logprobs
from nanoserve.sampling.params import SamplingParams

V = 50


def hf_chain(logits, p: SamplingParams, seen):
    """HF's processors in generate()'s order (sequence bias first), one row."""
    x = logits[None].clone()
    ids = torch.tensor([seen])
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()})(ids, x)
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    if p.temperature not in (0, 1.0):
        x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    return x[0]


BIASED = [
    SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(logit_bias={0: 2.5, 49: 1.0}, repetition_penalty=1.3, temperature=0.7),
    SamplingParams(logit_bias={10: -3.0, 11: 3.0}, top_k=5, top_p=0.9, temperature=1.2),
    SamplingParams(logit_bias={1: 100.0}),
    SamplingParams(),  # a row without bias, batched with biased ones
]


def test_logit_bias_matches_hf_sequence_bias():
    logits = torch.randn(len(BIASED), V) * 3
    seen = [[1, 2, 3], [0, 0, 5], [10, 12], [4], [3, 7]]
    ours = filtered_logits(logits, BIASED, seen).softmax(-1)
    for i, p in enumerate(BIASED):
        torch.testing.assert_close(ours[i], hf_chain(logits[i], p, seen[i]).softmax(-1), atol=1e-6, rtol=1e-5)
    assert filtered_logits(logits, BIASED, seen)[3].argmax() == 1  # +100 forces a token
    assert ours[0, 7] < 1e-30  # -100 bans one


def reference_penalties(row, generated, presence, frequency):
    """OpenAI's definition, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = row.clone()
    for token in set(generated):
        count = generated.count(token)
        out[token] -= count * frequency + (count > 0) * presence
    return out


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, -0.4), (-2.0, 2.0)])
def test_presence_and_frequency_penalties_follow_openai(presence, frequency):
    logits = torch.randn(3, V) * 2
    generated = [[4, 4, 4, 9], [], [0, 1, 2, 1]]
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency)] * 2 + [SamplingParams()]
    ours = filtered_logits(logits, params, generated=generated)
    for i in range(2):
        torch.testing.assert_close(ours[i], reference_penalties(logits[i], generated[i], presence, frequency))
    torch.testing.assert_close(ours[2], logits[2])  # its own params: no penalty
    # Output tokens only: the prompt (in `seen`, for the repetition penalty) does not count.
    seen = [[40, 41] + g for g in generated]
    torch.testing.assert_close(filtered_logits(logits, params, seen, generated), ours)


def test_every_edit_together_in_the_documented_order():
    """bias and presence/frequency (additive) -> repetition penalty -> temperature -> top-k -> top-p."""
    logits = torch.randn(V) * 3
    p = SamplingParams(logit_bias={2: 4.0, 5: -1.0}, presence_penalty=0.8, frequency_penalty=0.3,
                       repetition_penalty=1.2, temperature=0.8, top_k=10, top_p=0.95)
    prompt, generated = [7, 8], [2, 2, 5, 30]
    ours = filtered_logits(logits[None], [p], [prompt + generated], [generated])[0]
    penalized = reference_penalties(logits, generated, 0.8, 0.3)
    hf_part = SamplingParams(logit_bias=p.logit_bias, repetition_penalty=1.2, temperature=0.8, top_k=10, top_p=0.95)
    expected = hf_chain(penalized, hf_part, prompt + generated)
    torch.testing.assert_close(ours.softmax(-1), expected.softmax(-1), atol=1e-6, rtol=1e-5)


def test_the_raw_logits_are_never_changed_in_place():
    logits = torch.randn(2, V)
    before = logits.clone()
    params = [SamplingParams(logit_bias={1: 3.0}, presence_penalty=1.0, repetition_penalty=1.5, temperature=0.5)] * 2
    filtered_logits(logits, params, [[1, 2], [3]], [[2], [3]])
    assert torch.equal(logits, before)


def test_token_logprobs_are_log_softmax_and_its_top_k():
    logits = torch.randn(4, V) * 4
    chosen = [3, 0, 49, 17]
    found = token_logprobs(logits, chosen, [0, 1, 5, 20])
    logp = logits.log_softmax(-1)
    for i, entry in enumerate(found):
        assert entry.token == chosen[i]
        assert entry.logprob == pytest.approx(logp[i, chosen[i]].item(), abs=1e-6)
        k = [0, 1, 5, 20][i]
        values, ids = logp[i].topk(k)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-6)


def test_the_sampler_reports_logprobs_of_the_raw_logits_per_sequence():
    """Whatever the temperature, penalties and bias do to the draw, the logprobs are the model's."""
    torch.manual_seed(3)
    logits = torch.randn(3, V) * 2
    sampler = Sampler("cpu")
    params = [SamplingParams(temperature=1.7, logprobs=2, presence_penalty=2.0, logit_bias={5: 10.0}, seed=1),
              SamplingParams(temperature=0),  # asks for nothing
              SamplingParams(temperature=0, logprobs=0, frequency_penalty=1.0)]
    for seq_id, p in zip([10, 11, 12], params):
        sampler.add(seq_id, p, prompt_len=2)
    seen = [[1, 5, 5], [2, 3], [5, 9, 9]]
    tokens = sampler(logits, [10, 11, 12], params, seen).tolist()
    logp = logits.log_softmax(-1)
    first, third = sampler.take_logprobs(10), sampler.take_logprobs(12)
    assert sampler.take_logprobs(11) == [] and sampler.take_logprobs(10) == []  # taken once
    assert [e.token for e in first] == [tokens[0]] and [e.token for e in third] == [tokens[2]]
    assert first[0].logprob == pytest.approx(logp[0, tokens[0]].item(), abs=1e-6)
    assert [t for t, _ in first[0].top] == logp[0].topk(2).indices.tolist()
    assert third[0].logprob == pytest.approx(logp[2, tokens[2]].item(), abs=1e-6) and third[0].top == []
    # Row 2 is greedy with a frequency penalty over its output only ([9], after a prompt of 2).
    assert tokens[2] == reference_penalties(logits[2], [9], 0.0, 1.0).argmax().item()
    sampler.release(10)
    assert 10 not in sampler.prompt_lens and 10 not in sampler.generators


# ------------------------------------------------------------- in the engine, under preemption


def test_logprobs_and_prompt_logprobs_survive_preemption():
    """A pool too small for all requests preempts and recomputes sequences (week 9): their
    logprobs, prompt logprobs and tokens are those of a run with room to spare."""
    from nanoserve.engine.engine import LLM

    prompts = [f"The list {i} of values and keys" for i in range(6)]
    params = SamplingParams(temperature=0.9, seed=1, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                            presence_penalty=0.5, frequency_penalty=0.2, logit_bias={13: 1.5})

    def run(**kw):
        llm = LLM("tiny", device="cpu", block_size=4, **kw)
        return llm, llm.generate(prompts, params)

    _, ample = run(num_blocks=256)
    small, tight = run(num_blocks=20)
    assert small.engine.scheduler.num_preemptions > 0
    for a, b in zip(ample, tight):
        assert a.token_ids == b.token_ids and len(a.logprobs) == 24
        for x, y in zip(a.logprobs + a.prompt_logprobs[1:], b.logprobs + b.prompt_logprobs[1:]):
            assert x.token == y.token and [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
        assert [e.token for e in b.prompt_logprobs] == b.prompt_token_ids
