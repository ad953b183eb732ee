"""Week 18: which slice of each weight a rank keeps, and why the slices add up to the whole model.

These run in one process: a rank's shard is built with a group whose collectives do nothing, and
the test does by hand what the all-reduce and the all-gather would do (sum the partial outputs,
concatenate the logit slices). tests/week18/test_tensor_parallel.py runs real ranks.
"""

from unittest import mock

import pytest
import torch

from nanoserve.model.config import ModelConfig
from nanoserve.model.loader import load_model
from nanoserve.model.tensor_parallel import (
    Group,
    check_shardable,
    head_range,
    kv_head_range,
    shard_model,
)
from nanoserve.testing import make_checkpoint, tiny_config


class Alone(Group):
    """Rank `rank` of `size`, with collectives that leave the tensor as it is."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x):
        return x


@pytest.mark.exercise("kv-heads")
@pytest.mark.parametrize("kv_heads,size,expected", [
    (8, 2, [(0, 4), (4, 8)]),  # Llama-3.1-8B over 2 GPUs: 4 KV heads each
    (2, 2, [(0, 1), (1, 2)]),  # the tiny model
    (1, 2, [(0, 1), (0, 1)]),  # fewer KV heads than ranks: replicated
    (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # each KV head on the two ranks whose query heads use it
])
def test_kv_heads_are_split_or_replicated(kv_heads, size, expected):
    assert [kv_head_range(kv_heads, r, size) for r in range(size)] == expected


@pytest.mark.exercise("kv-heads")
@pytest.mark.parametrize("heads,kv_heads,size", [(6, 2, 2), (8, 2, 4), (32, 8, 2), (4, 1, 2), (32, 8, 8)])
def test_each_rank_keeps_the_kv_heads_of_its_query_heads(heads, kv_heads, size):
    """Query head h attends to KV head h // (heads / kv_heads): a rank must hold exactly the KV
    heads its own query heads need, whether KV heads are split or replicated."""
    group = heads // kv_heads
    for r in range(size):
        q0, q1 = head_range(heads, r, size)
        k0, k1 = kv_head_range(kv_heads, r, size)
        assert {h // group for h in range(q0, q1)} == set(range(k0, k1))


def _config(**overrides) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config(model_type="llama", **overrides))


@pytest.mark.exercise("shard-model")
@pytest.mark.parametrize("kv_heads,rank,expected_kv", [(2, 1, 1), (1, 1, 0), (1, 0, 0)])
@torch.no_grad()
def test_qkv_shard_holds_my_heads_rows(kv_heads, rank, expected_kv, tmp_path):
    """Rank `rank` of 2 keeps its query heads' rows, then its KV head's rows of k and of v, in
    that order; with one KV head, both ranks keep the same one."""
    make_checkpoint(tmp_path, tiny_config(num_key_value_heads=kv_heads))  # 4 query heads of 16 dimensions
    model = load_model(tmp_path)
    cfg, d = model.config, model.config.head_dim
    for layer in model.layers:  # row i holds the number i
        layer.self_attn.qkv_proj.weight.copy_(torch.arange(cfg.q_size + 2 * cfg.kv_size)[:, None].float())
    got = shard_model(model, Alone(rank, 2)).layers[0].self_attn.qkv_proj.weight[:, 0].long().tolist()
    q = list(range(2 * rank * d, 2 * (rank + 1) * d))  # query heads 2r and 2r + 1
    k = list(range(cfg.q_size + expected_kv * d, cfg.q_size + (expected_kv + 1) * d))
    v = [i + cfg.kv_size for i in k]
    assert got == q + k + v


def test_uneven_splits_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="attention heads"):
        check_shardable(_config(), 3)  # 4 heads over 3 ranks
    with pytest.raises(ValueError, match="key/value heads"):
        check_shardable(_config(num_attention_heads=12, num_key_value_heads=3), 2)


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    """A tiny checkpoint with one KV head: fewer than the ranks (and an untied output head)."""
    path = tmp_path_factory.mktemp("gqa1")
    make_checkpoint(path, tiny_config(num_key_value_heads=1, tie_word_embeddings=False))
    return path


@pytest.mark.exercise("shard-model")
@pytest.mark.parametrize("model", ["tiny", "gqa"])
def test_shard_shapes(model, gqa_dir):
    name = "tiny" if model == "tiny" else gqa_dir
    whole = load_model(name)
    cfg = whole.config
    shard = shard_model(load_model(name), Alone(1, 2))
    local = shard.config
    assert (local.num_heads, local.intermediate_size) == (cfg.num_heads // 2, cfg.intermediate_size // 2)
    assert local.num_kv_heads == max(1, cfg.num_kv_heads // 2)
    assert local.vocab_size == cfg.vocab_size and local.hidden_size == cfg.hidden_size
    layer = shard.layers[0]
    d, h = cfg.head_dim, cfg.hidden_size
    assert layer.self_attn.qkv_proj.weight.shape == ((local.num_heads + 2 * local.num_kv_heads) * d, h)
    assert layer.self_attn.o_proj.weight.shape == (h, local.num_heads * d)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * local.intermediate_size, h)
    assert layer.mlp.down_proj.weight.shape == (h, local.intermediate_size)
    assert shard.embed_tokens.weight.shape == (cfg.vocab_size // 2, h)
    assert shard.lm_head.weight.shape == (cfg.vocab_size // 2, h)
    assert (shard.lm_head.weight is shard.embed_tokens.weight) == cfg.tie_word_embeddings


def _shards(name):
    return [shard_model(load_model(name), Alone(r, 2)) for r in range(2)]


@pytest.mark.exercise("row-parallel")
@torch.no_grad()
def test_row_parallel_partial_sums_add_up_to_the_whole_mlp():
    """down(SwiGLU(gate_up(x))): each rank's partial output; their sum (the all-reduce) is the
    whole MLP's output."""
    whole, shards = load_model("tiny"), _shards("tiny")
    x = torch.randn(5, whole.config.hidden_size)
    partials = [s.layers[2].mlp(x) for s in shards]
    torch.testing.assert_close(partials[0] + partials[1], whole.layers[2].mlp(x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(partials[0], whole.layers[2].mlp(x), atol=1e-3)  # one rank alone is not enough


@torch.no_grad()
def test_fused_gate_up_kernel_runs_on_a_column_parallel_shard():
    """Week 12's batch-1 kernel (the gate_up product and SiLU·mul in one) takes a rank's slice of
    gate_up as it takes the whole weight: the shard's MLP gives the same output with it as
    without, and the kernel itself ran, not the fallback through the product and `silu_mul`."""
    pytest.importorskip("triton", reason="week 12's kernels need the triton package: pip install triton (Linux)")
    from nanoserve.kernels import fused

    mlp = _shards("tiny")[1].layers[1].mlp
    x = torch.randn(1, mlp.down_proj.weight.shape[0])
    expected = mlp(x)
    mlp.fused = fused.gate_up_silu
    with mock.patch.object(fused, "silu_mul", side_effect=AssertionError("the fallback ran, not the fused kernel")):
        got = mlp(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.exercise("vocab-embedding")
@torch.no_grad()
def test_vocab_parallel_embedding_and_logits():
    """Each rank embeds the ids in its rows (zeros elsewhere): the sum is the embedding. Each
    rank's logits are its slice of the vocabulary: side by side, they are the whole row."""
    whole, shards = load_model("tiny"), _shards("tiny")
    ids = torch.tensor([0, 5, 2047, 2048, 4095])  # both halves of the 4096-token vocabulary
    looked_up = [s.embed_tokens(ids) for s in shards]
    torch.testing.assert_close(looked_up[0] + looked_up[1], whole.embed_tokens(ids))
    assert looked_up[0][3:].abs().sum() == 0 and looked_up[1][:3].abs().sum() == 0
    hidden = torch.randn(3, whole.config.hidden_size)
    logits = torch.cat([s.lm_head(hidden) for s in shards], dim=-1)
    torch.testing.assert_close(logits, whole.lm_head(hidden), atol=1e-5, rtol=1e-5)


@pytest.mark.exercise("vocab-embedding")
@torch.no_grad()
def test_uneven_vocabulary_is_padded_and_cut(tmp_path):
    make_checkpoint(tmp_path, tiny_config(vocab_size=4093))  # not a multiple of 2
    whole = load_model(tmp_path)
    shards = [shard_model(load_model(tmp_path), Alone(r, 2)) for r in range(2)]
    assert shards[1].embed_tokens.weight.shape[0] == 2047  # 2047 + 2047 rows, the last one padding
    ids = torch.tensor([1, 4092])
    torch.testing.assert_close(shards[0].embed_tokens(ids) + shards[1].embed_tokens(ids), whole.embed_tokens(ids))
    hidden = torch.randn(2, whole.config.hidden_size)
    full = torch.cat([hidden @ s.lm_head.weight.T for s in shards], dim=-1)  # what the all-gather assembles
    assert full.shape[1] == 4094 and shards[0].lm_head.vocab_size == 4093  # one padding column, cut off
    torch.testing.assert_close(full[:, :4093], whole.lm_head(hidden), atol=1e-5, rtol=1e-5)


def test_the_model_code_is_unchanged():
    """The parallel layers come from the loader's side (shard_model): model/llama.py and model/layers.py know
    nothing of ranks."""
    import inspect

    import nanoserve.model.layers
    import nanoserve.model.llama

    for module in (nanoserve.model.llama, nanoserve.model.layers):
        source = inspect.getsource(module)
        assert "parallel" not in source.lower() and "all_reduce" not in source
