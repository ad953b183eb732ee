"""Week 6: the Triton backend behind the engine, and how the backend is chosen."""

import pytest
import torch

from nanoserve.engine.engine import LLM
from nanoserve.attention.backend import ENV_VAR, select_backend
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import make_checkpoint, tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_default_and_override(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert select_backend("cpu") == "torch"
    assert select_backend("cuda") == "triton"
    assert select_backend("cuda", "torch") == "torch"
    monkeypatch.setenv(ENV_VAR, "torch")
    assert select_backend("cuda") == "torch"
    monkeypatch.setenv(ENV_VAR, "flash")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_backend("cuda")


@pytest.mark.exercise("triton-read")
def test_engine_with_triton_backend_matches_hf(tmp_path):
    """Greedy float32 outputs for ragged prompts equal HF, with the Triton kernel decoding
    (compiled on CUDA, interpreted on the CPU)."""
    pytest.importorskip("triton", reason="week 6 needs the triton package: pip install triton (Linux)")
    path, hf = make_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=2))
    hf = hf.to(DEVICE)
    llm = LLM(str(path), device=DEVICE, dtype=torch.float32, attention_backend="triton", batching="admit-all",
              num_blocks=64, block_size=16, fused_kernels=False)  # week 6 alone: week 12's kernels are tested there
    assert llm.engine.attention_backend == "triton"
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (1, 15, 16, 17, 60)]
    n_new = 20 if DEVICE == "cuda" else 8
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        expected = hf.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=n_new,
                               min_new_tokens=n_new, do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == expected
    assert llm.engine.scheduler.allocator.num_free == 64


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(tmp_path):
    """Week 12's CUDA-graph decode steps are a pure speed-up: the same tokens as eager steps,
    for a batch whose size is padded up to a captured size, in float32."""
    path, hf = make_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=2))
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (1, 15, 16, 17, 60)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        llm = LLM(str(path), device="cuda", dtype=torch.float32, attention_backend="triton",
                  num_blocks=64, max_num_seqs=8, max_model_len=256, cuda_graphs=graphs)
        assert (llm.engine.runner.graphs is not None) == graphs
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.scheduler.allocator.num_free == 64
    assert outs[True] == outs[False]
    hf = hf.to("cuda")
    for prompt, got in zip(prompts, outs[True]):
        expected = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                               do_sample=False)[0, len(prompt):].tolist()
        assert got == expected
