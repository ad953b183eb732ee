"""Week 12: decode steps from static buffers (what CUDA graphs replay), checked on the CPU.

On the CPU the `CUDAGraphDecoder` captures nothing: the same static buffers, the same padding to
a captured size and the same block-table bookkeeping feed an eager forward pass, so everything
but the replay itself is tested here (the Triton kernel runs in its interpreter). On a GPU the
same tests run with real graphs.
"""

import pytest
import torch

from nanoserve.runner.cuda_graphs import CAPTURE_SIZES, CUDAGraphDecoder, padded_size
from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduler.sequence import Batch, Sequence
from nanoserve.testing import make_checkpoint, tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton", reason="week 12 uses the week-6 Triton kernel: pip install triton (Linux)")


@pytest.mark.exercise("padded-size")
def test_padded_size():
    assert [padded_size(n, CAPTURE_SIZES) for n in (1, 2, 3, 5, 8, 9, 33, 200, 256)] == \
        [1, 2, 4, 8, 8, 16, 48, 224, 256]
    assert padded_size(3, [4, 16]) == 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("w12") / "ckpt", tiny_config(num_hidden_layers=2))


def make_llm(path, graphs: bool, num_blocks: int = 64) -> LLM:
    return LLM(str(path), device=DEVICE, dtype=torch.float32, attention_backend="triton", num_blocks=num_blocks,
               block_size=4, max_num_seqs=8, max_model_len=128, cuda_graphs=graphs,
               fused_kernels=graphs)  # the graphs with week 12's kernels; the eager run without


@pytest.mark.exercise("stage-inputs")
def test_stage_fills_the_buffers_and_pads(checkpoint):
    path, _ = checkpoint
    llm = make_llm(path, graphs=True)
    dec = llm.engine.runner.graphs
    assert isinstance(dec, CUDAGraphDecoder) and dec.capture == (DEVICE == "cuda") and dec.sizes == [1, 2, 4, 8]
    a = Sequence([5, 6, 7, 8, 9], SamplingParams())  # 5 tokens; the 5th is the one to decode
    b = Sequence([1, 2], SamplingParams())
    a.block_table, a.num_computed = [10, 3], 4
    b.block_table, b.num_computed = [7], 1
    runner = llm.engine.runner

    def stage(*seqs):
        return dec.stage(runner.step_input(Batch(list(seqs), [1] * len(seqs))))

    bs = stage(a, b, b)  # three rows (b twice is fine for staging): padded to 4
    assert bs == 4
    ids, pos, slots, lens, source = dec.inputs[:, :4].tolist()
    assert source == [-1] * 4  # every input came from the host (issue 20: none from the last step)
    assert ids == [9, 2, 2, 0] and pos == [4, 1, 1, 0] and lens == [5, 2, 2, 1]
    assert slots == [3 * 4 + 0, 7 * 4 + 1, 7 * 4 + 1, dec.scratch_slot]  # padding writes to scratch
    assert dec.block_tables[0, :2].tolist() == [10, 3] and dec.block_tables[1, 0].item() == 7
    # a row is rewritten when its sequence changes, or when its table grows
    a.block_table.append(11)
    a.num_computed = 8
    a.token_ids += [1, 2, 3, 4]
    stage(b, a)
    assert dec.block_tables[0, 0].item() == 7 and dec.block_tables[1, :3].tolist() == [10, 3, 11]
    assert dec.inputs[2, 1].item() == 11 * 4 + 0
    # preempted and readmitted: new blocks, same number of them, same row
    a.block_table, a.block_table_version = [20, 21, 22], a.block_table_version + 1
    stage(b, a)
    assert dec.block_tables[1, :3].tolist() == [20, 21, 22]


@pytest.mark.exercise("stage-inputs")
def test_static_decode_matches_eager_and_hf(checkpoint):
    """Ragged prompts, a batch of 5 padded to 8, greedy float32: same tokens as eager steps and HF."""
    path, hf = checkpoint
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (1, 3, 4, 5, 13)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        llm = make_llm(path, graphs)
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.scheduler.allocator.num_free == 64
    assert outs[True] == outs[False]
    for prompt, got in zip(prompts, outs[True]):
        expected = hf.to(DEVICE).generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=6, min_new_tokens=6,
                               do_sample=False)[0, len(prompt):].tolist()
        assert got == expected


@pytest.mark.slow
def test_static_decode_survives_preemption(checkpoint):
    """A pool too small for everyone: sequences are preempted, come back with new blocks (maybe
    into the same row, with a table of the same length), and still produce eager's tokens."""
    path, _ = checkpoint
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (6, 9, 7, 8)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        llm = make_llm(path, graphs, num_blocks=12)
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.allocator.num_free == 12
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_kv_pool_is_sized_from_measured_memory(checkpoint):
    """The pool takes what `gpu_memory_utilization` leaves after the weights and a measured step
    (graphs included), so running the largest steps stays within that share of the GPU."""
    path, _ = checkpoint
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(str(path), dtype=torch.bfloat16, gpu_memory_utilization=0.5, max_num_batched_tokens=1024,
              max_num_seqs=64)
    sizing = llm.engine.kv_sizing
    assert sizing is not None and sizing["step_bytes"] > 0 and llm.engine.runner.cache.num_blocks > 1000
    prompts = [[1 + (i * 7 + j) % 4000 for j in range(200 + i)] for i in range(64)]
    torch.cuda.reset_peak_memory_stats()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert torch.cuda.max_memory_reserved() <= 0.5 * total * 1.02, (torch.cuda.max_memory_reserved(), total)
