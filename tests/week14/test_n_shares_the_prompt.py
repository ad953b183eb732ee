"""Week 14 (issue 17): `n` choices prefill their prompt once, sharing its blocks through the
prefix cache; and a request that wants its prompt's logprobs never reuses cached blocks (they
have no logits), yet fills the cache for the others."""

import pytest
import torch
from openai import OpenAI

from nanoserve.testing import ServerThread
from nanoserve.model.tiny import TINY_MODEL_DIR

BLOCK = 8
PROMPT = ("A dictionary maps keys to values. The list type is a mutable sequence, and the tuple type "
          "an immutable one; both support indexing and slicing.")


@pytest.fixture()
def server():
    with ServerThread(engine_kwargs=dict(max_model_len=256, num_blocks=256, block_size=BLOCK)) as s:
        assert s.engine.scheduler.prefix_caching
        yield s


def client_of(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def counters(server) -> tuple[int, int]:
    return server.engine.prefix_cache_stats()["hit_tokens"], server.engine.scheduler.num_scheduled_tokens


def test_n_choices_prefill_the_prompt_once(server):
    client = client_of(server)
    prompt_len = len(server.engine.tokenizer.encode(PROMPT))
    full = (prompt_len // BLOCK) * BLOCK  # tokens in the prompt's full blocks
    assert full >= 3 * BLOCK and prompt_len > full  # a partial last block, which each choice computes itself
    hits, scheduled = counters(server)
    resp = client.completions.create(model="tiny", prompt=PROMPT, n=4, max_tokens=8, temperature=1.0, seed=7,
                                     extra_body={"ignore_eos": True})
    assert len({c.text for c in resp.choices}) == 4
    new_hits, new_scheduled = counters(server)
    assert new_hits - hits == 3 * full  # choices 1..3 found the prompt's full blocks in the cache
    # The model ran the prompt once in full, then only each other choice's partial block, then
    # the decodes (every output token but the last went back through the model).
    decodes = sum(8 - 1 for _ in resp.choices)
    assert new_scheduled - scheduled == prompt_len + 3 * (prompt_len - full) + decodes
    again = client.completions.create(model="tiny", prompt=PROMPT, n=4, max_tokens=8, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # reproducible, cache or not
    assert server.wait_idle()


@torch.no_grad()
def test_prompt_logprobs_are_computed_in_full_even_when_the_prompt_is_cached(server):
    from transformers import LlamaForCausalLM

    client = client_of(server)
    ids = server.engine.tokenizer.encode(PROMPT)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)  # the prompt's blocks are now cached
    hits, _ = counters(server)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, echo=True, logprobs=0)
    assert counters(server)[0] == hits  # no reuse: every prompt position had to run for its logits
    hf = LlamaForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    expected = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    got = resp.choices[0].logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids) + 1
    assert got[1 : len(ids)] == pytest.approx([expected[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=1e-4)
    # With n > 1, the first choice computes the prompt's logprobs; the others reuse its blocks.
    hits, _ = counters(server)
    three = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=2, echo=True, logprobs=0,
                                      temperature=1.0, seed=1)
    assert counters(server)[0] - hits == 2 * (len(ids) // BLOCK) * BLOCK
    assert all(c.logprobs.token_logprobs[: len(ids)] == got[: len(ids)] for c in three.choices)
