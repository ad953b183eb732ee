"""Week 2: the exact Llama-3.2-1B shape (1.24 B parameters), random weights, float32, on the CPU.

The checkpoint is written by HuggingFace (`save_pretrained`), loaded through nanoserve's loader,
and both models generate 16 greedy tokens (54 s on an idle 2-core CPU, against 72 s for 32). A 7.5 GiB
peak: the two models never live at the same time.
"""

import gc
import shutil

import pytest
import torch

from nanoserve.attention.base import PrefillContext
from nanoserve.model.config import ModelConfig
from nanoserve.runner.generate import greedy_generate_no_cache
from nanoserve.model.loader import load_model
from nanoserve.testing import LLAMA_3_2_1B, make_hf_model, save_checkpoint

# slow; and under pytest-xdist on the worker of the other large models, never beside them (memory)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("large-models")]


@torch.no_grad()
def test_llama_3_2_1b_shape_matches_hf(tmp_path):
    prompt = [128000, 791, 6864, 315, 9822, 374, 12366, 13, 578, 1176, 315]  # 11 token ids
    hf = make_hf_model(LLAMA_3_2_1B, seed=0, init_std=0.02)
    path = save_checkpoint(hf, tmp_path / "llama-3.2-1b-random", with_tokenizer=False)
    ids = torch.tensor(prompt)
    expected_logits = hf(ids[None]).logits[0, -1]
    expected_tokens = hf.generate(ids[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=16, min_new_tokens=16, do_sample=False)
    expected_tokens = expected_tokens[0, len(prompt):].tolist()
    del hf
    gc.collect()

    ours = load_model(path)
    cfg: ModelConfig = ours.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (16, 2048, 8192)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (32, 8, 64, 128256)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 32.0 and cfg.tie_word_embeddings
    assert sum(p.numel() for p in ours.parameters()) == 1_235_814_400

    logits = ours.compute_logits(ours(ids, torch.arange(len(prompt)), PrefillContext([len(prompt)]))[-1])
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    got = greedy_generate_no_cache(ours, prompt, max_new_tokens=16)
    assert got == expected_tokens
    assert len(set(got)) >= 8, f"degenerate generation {got}"
    shutil.rmtree(path)
