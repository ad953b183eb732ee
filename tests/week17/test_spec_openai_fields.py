"""Week 17 and issue 17: a request asking for logprobs, prompt logprobs, presence or frequency
penalties, a `logit_bias` or structured output (which verification cannot give) runs in plain steps: no guesses
while it is in the engine, and exactly the answer of an engine without speculation."""

import pytest
import torch

from nanoserve.engine.engine import LLM
from nanoserve.engine.config import EngineConfig
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.grammar import grammar_for

PROMPTS = ["the list, the list, the list, the", "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"]
ASKING = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={264: -100.0}),
    SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=3, logprobs=0, frequency_penalty=0.3),
    SamplingParams(temperature=0, max_tokens=24, grammar=grammar_for({"type": "json_object"})),
]


def engine(speculative: str | None) -> LLM:
    return LLM(EngineConfig(model="tiny", device="cpu", dtype=torch.float32, speculative=speculative,
                            num_speculative_tokens=3, speculative_max_batch=8))


def summary(out):
    return (out.token_ids, out.text, [(e.token, round(e.logprob, 5), e.top) for e in out.logprobs or []],
            [(e.token, e.logprob) for e in out.prompt_logprobs or []])


@pytest.mark.parametrize("params", ASKING, ids=["logprobs", "prompt_logprobs", "presence", "frequency",
                                                "logit_bias", "sampled", "grammar"])
def test_requests_speculation_cannot_serve_get_plain_steps(params):
    plain = engine(None).generate(PROMPTS, params)
    spec = engine("ngram")
    got = spec.generate(PROMPTS, params)
    assert [summary(o) for o in got] == [summary(o) for o in plain]
    assert spec.engine.spec_stats()["proposed"] == 0  # not one guess while they ran
    # The same engine speculates again once they are gone.
    spec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert spec.engine.spec_stats()["proposed"] > 0
