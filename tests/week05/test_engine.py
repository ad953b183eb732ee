"""Week 5: the engine loop over the paged cache, and the offline LLM API."""

import json

import pytest
import torch

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import make_checkpoint, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = [1, 2, 7, 15, 16, 17, 33, 64, 129, 300]  # several cross 16-token block boundaries


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("engine") / "ckpt", tiny_config(num_hidden_layers=3))


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in LENGTHS]


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.exercise("prepare-inputs", "schedule", "engine-step")
def test_ragged_batch_equals_hf_one_prompt_at_a_time(ckpt, prompts):
    path, hf = ckpt
    llm = LLM(str(path), device="cpu", batching="admit-all", block_size=16, num_blocks=128)
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outs] == prompts  # in order
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 24), f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length" and out.finished
    assert llm.engine.scheduler.allocator.num_free == 128  # every block back
    assert llm.engine.num_steps == 24  # one prefill step, then 23 decode steps for all


@pytest.mark.exercise("prepare-inputs", "engine-step")
def test_small_blocks_and_text_prompts(ckpt):
    path, hf = ckpt
    llm = LLM(str(path), device="cpu", batching="admit-all", block_size=4, num_blocks=256)
    texts = ["The list", "A dictionary maps keys", "x"]
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for text, out in zip(texts, outs):
        ids = llm.tokenizer.encode(text)
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(hf, ids, 10)
        assert out.text == llm.tokenizer.decode(out.token_ids)


@pytest.mark.exercise("engine-step")
def test_max_tokens_and_stop_tokens(ckpt, prompts):
    path, _ = ckpt
    llm = LLM(str(path), device="cpu", batching="admit-all", num_blocks=128)
    full = llm.generate(prompts[4], GREEDY)[0].token_ids
    stop_token = full[5]
    first = full.index(stop_token)
    out = llm.generate(prompts[4], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token],
                                                  ignore_eos=True))[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"
    out = llm.generate(prompts[4], SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.token_ids == full[:3] and out.finish_reason == "length"


@pytest.mark.exercise("engine-step")
def test_eos_from_the_config_stops_generation(ckpt, prompts, tmp_path):
    path, hf = ckpt
    full = LLM(str(path), device="cpu", batching="admit-all", num_blocks=128).generate(prompts[3], GREEDY)[0].token_ids
    eos = full[4]
    cfg = json.loads((path / "config.json").read_text())
    eos_dir = tmp_path / "eos"
    eos_dir.mkdir()
    for f in path.iterdir():
        (eos_dir / f.name).write_bytes(f.read_bytes())
    (eos_dir / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=eos)))
    llm = LLM(str(eos_dir), device="cpu", batching="admit-all", num_blocks=128)
    out = llm.generate(prompts[3], SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.token_ids == full[: full.index(eos) + 1] and out.finish_reason == "stop"
    ignored = llm.generate(prompts[3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert ignored.token_ids == full


@pytest.mark.exercise("stop-strings")
def test_stop_strings_cut_the_text(ckpt):
    path, _ = ckpt
    llm = LLM(str(path), device="cpu", batching="admit-all", num_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate("The list", params)[0].text
    stop = next(full[i : i + 3] for i in range(4, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    eng = llm.engine
    rid = eng.add_request("The list", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "zzzz"]))
    deltas, last = [], None
    while eng.has_unfinished():
        for out in eng.step():
            deltas.append(out.delta)
            last = out
    assert last.request_id == rid and last.finish_reason == "stop"
    assert last.text == full[: full.find(stop)]
    assert "".join(deltas) == last.text  # streamed deltas add up to the text, stop string held back
    assert eng.scheduler.allocator.num_free == eng.scheduler.allocator.num_blocks


@pytest.mark.exercise("schedule")
def test_abort_frees_blocks(ckpt, prompts):
    path, _ = ckpt
    llm = LLM(str(path), device="cpu", batching="admit-all", num_blocks=128)
    eng = llm.engine
    a = eng.add_request(prompts[7], GREEDY)
    b = eng.add_request(prompts[2], GREEDY)
    eng.step()
    eng.step()
    assert eng.scheduler.allocator.num_used > 0
    eng.abort(a)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert {o.request_id for o in outs} == {b}
    assert eng.scheduler.allocator.num_free == 128


def test_user_errors_are_clear(ckpt):
    path, _ = ckpt
    llm = LLM(str(path), device="cpu", batching="admit-all", num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * 1024])
    with pytest.raises(ValueError, match="never fit"):
        llm.generate([[5] * 40])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="2 prompts but 3"):
        llm.generate(["a", "b"], [GREEDY] * 3)


@pytest.mark.exercise("engine-step")
def test_tiny_model_generates_text():
    llm = LLM("tiny", device="cpu", batching="admit-all")
    out = llm.generate("Return the", SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.text and out.finish_reason in ("length", "stop")
    seeded = [llm.generate("Return the", SamplingParams(temperature=1.0, seed=3, max_tokens=12))[0].token_ids
              for _ in range(2)]
    assert seeded[0] == seeded[1]
