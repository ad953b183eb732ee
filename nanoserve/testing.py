"""Tiny random Llama checkpoints for tests and notebooks, written by HuggingFace itself.

Each checkpoint is a real directory (`config.json`, `model.safetensors`, tokenizer files) saved
by `LlamaForCausalLM.save_pretrained`, so loading it exercises nanoserve's loader exactly as a
downloaded model would. The tokenizer is the bundled tiny model's byte-level BPE.

Random weights drawn with the usual tiny std (0.02) give nearly flat logits: greedy decoding
then repeats one token, and a test that compares such outputs proves little. `init_std` scales
the weights so that logits are spread out and generations vary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from nanoserve.model.tiny import TINY_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# The exact shape of Llama-3.2-1B (its config.json, minus the weights).
LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
    max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
    eos_token_id=128001,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
)

# Week 18's larger shape (Llama-3.1-8B): for tensor-parallel figures, random weights.
LLAMA_3_1_8B = dict(
    LLAMA_3_2_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128,
    tie_word_embeddings=False, rope_parameters=dict(LLAMA_3_2_1B["rope_parameters"], factor=8.0),
)


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A small Llama config dict (GQA 4:2, llama3 rope scaling, tied), with overrides."""
    cfg = dict(
        vocab_size=4096, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        max_position_embeddings=1024, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=128),
    )
    cfg.update(overrides)
    return cfg


def make_hf_model(config: dict[str, Any], seed: int = 0, init_std: float | None = None):
    """A `LlamaForCausalLM` in float32 with seeded random weights (std `init_std`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf_config = LlamaConfig(**config)
    if init_std is not None:
        hf_config.initializer_range = init_std
    model = LlamaForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # norms start at 1; jitter them so bugs show
                p.uniform_(0.8, 1.2)
    return model


# Week 19: one tiny config per family, each with what makes the family differ switched on: a window
# shorter than the test prompts, Gemma 3's mix of local and global layers and its own query scale.
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", dict(attention_bias=False)),
    "gemma3": ("Gemma3ForCausalLM", dict(sliding_window=8, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
                                         layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                         rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                                                          "full_attention": dict(rope_type="default", rope_theta=10000.0)})),
    # Week 24: 8 experts top-2 renormalized; 16 small ones top-4 as they come, a shared expert, layer 1 dense.
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=96, mlp_only_layers=[1])),
}


def make_family_model(family: str, seed: int = 0, init_std: float = 0.15, **overrides: Any):
    """A HF model of one family (`FAMILY_CONFIGS`) in float32, seeded, with norms and biases jittered."""
    import transformers

    architecture, extra = FAMILY_CONFIGS[family]
    cfg = dict(vocab_size=4096, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=1024,
               tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
               initializer_range=init_std, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(extra, **overrides)
    config_class = {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(architecture, architecture.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    hf_config = getattr(transformers, config_class)(**cfg)
    hf_config.architectures = [architecture]
    model = getattr(transformers, architecture)(hf_config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms hold w of (1 + w), the others w itself
                p.uniform_(-0.2, 0.2) if family == "gemma3" else p.uniform_(0.8, 1.2)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    return model


def make_family_checkpoint(path: str | Path, family: str, seed: int = 0, **overrides: Any):
    """A tiny random checkpoint of one family saved to `path`: (path, the HF model)."""
    model = make_family_model(family, seed=seed, **overrides)
    return save_checkpoint(model, path), model


def save_checkpoint(model, path: str | Path, max_shard_size: str | None = None, with_tokenizer: bool = True) -> Path:
    """Write `model` as a HF checkpoint directory, with the tiny model's tokenizer files."""
    path = Path(path)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if with_tokenizer:
        for name in TOKENIZER_FILES:
            src = TINY_MODEL_DIR / name
            if src.exists():
                shutil.copy(src, path / name)
    return path


def make_checkpoint(path: str | Path, config: dict[str, Any] | None = None, seed: int = 0, init_std: float = 0.15,
                    **save_kwargs: Any):
    """Build a random HF model, save it to `path`, return (path, the HF model)."""
    model = make_hf_model(config or tiny_config(), seed=seed, init_std=init_std)
    return save_checkpoint(model, path, **save_kwargs), model


# ------------------------------------------------------------------ GGUF files (week 13)


def private_gguf_cache(tmp_path_factory):
    """A session fixture's body (weeks 13 and 19): GGUF files convert into a fresh cache of the test
    session's own, never the user's, so a directory converted by another converter (an older one, or
    a learner's with stubbed dequantizers) is never read back."""
    import os

    old = os.environ.get("NANOSERVE_CACHE_DIR")
    os.environ["NANOSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("nanoserve-cache"))
    yield
    if old is None:
        os.environ.pop("NANOSERVE_CACHE_DIR", None)
    else:
        os.environ["NANOSERVE_CACHE_DIR"] = old



def _hf_to_gguf_name(name: str) -> str:
    """The inverse of `gguf_loader.gguf_to_hf`, for writing test files."""
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm"}
    stem, _, suffix = name.rpartition(".")
    if stem in top:
        return f"{top[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{per_layer[rest]}.{suffix}"


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF's row order of a q_proj / k_proj weight -> llama.cpp's: each head's row i and row
    i + head_dim/2 become neighbours 2i and 2i + 1 (what llama.cpp's converter does)."""
    rows, cols = w.shape
    half = rows // num_heads // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)  # 0, h, 1, h+1, ...
    heads = torch.arange(num_heads)[:, None] * 2 * half
    return w[(heads + order).reshape(-1)]


def write_gguf(path: str | Path, model, qtype: str = "F32", arch: str = "llama",
               with_tokenizer: bool = True, extra_tensors: dict | None = None,
               sampling: dict[str, float] | None = None, mixed: dict[str, str] | None = None) -> Path:
    """Write a HF `LlamaForCausalLM` as a GGUF file, the way llama.cpp's converter does: its
    tensor names, Q/K rows permuted for its RoPE, 2-D weights in `qtype` (norms stay F32), the
    config and the bundled tiny tokenizer in the metadata. Quantized with `gguf.quants` (the
    ecosystem's implementation), so that nanoserve's own dequantizers are what gets tested.
    `sampling`: llama.cpp's recommended-sampling keys, by their last part ({"temp": 0.7, "top_k": 40}).
    `mixed`: another type for some tensors, by their GGUF name's part before ".weight" ({"attn_q": "Q8_0"})."""

    import gguf
    import numpy as np

    cfg = model.config
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    writer.add_uint32(f"{arch}.rope.dimension_count", cfg.head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if with_tokenizer:
        tok = json.loads((TINY_MODEL_DIR / "tokenizer.json").read_text())
        vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
        special = {t["id"] for t in tok["added_tokens"] if t["special"]}
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([t for t, _ in vocab])
        writer.add_token_types([3 if i in special else 1 for _, i in vocab])
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        template = json.loads((TINY_MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
        writer.add_chat_template(template)
    for key, value in (sampling or {}).items():  # general.sampling.temp, ... (what GGUFWriter.add_sampling_* write)
        add = writer.add_int32 if isinstance(value, int) else writer.add_float32
        add(f"general.sampling.{key}", value)
    tensors = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for name, w in tensors.items():
        w = w.detach().float()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            w = permute_qk(w, heads)
        data, target = w.numpy(), _hf_to_gguf_name(name)
        own = (mixed or {}).get(target.rsplit(".", 2)[-2], qtype)
        if data.ndim == 1 or own == "F32":
            writer.add_tensor(target, data.astype(np.float32))
        else:
            own_kind = gguf.GGMLQuantizationType[own]
            writer.add_tensor(target, gguf.quants.quantize(data, own_kind), raw_dtype=own_kind)
    for name, (raw, raw_type) in (extra_tensors or {}).items():
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[raw_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------ scheduling without a model


def random_paged_step(seqs: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                      spare_blocks: int = 3):
    """One step for the paged-attention tests (weeks 6 and 19): `seqs` gives (past, new) tokens per
    sequence; a one-layer pool of random K/V whose blocks are handed out shuffled, as a busy pool's
    would be. Returns (cache, tables as lists, block_tables [N, width] int32, query_start_loc as a
    list, context lengths, q [T, num_heads, head_dim])."""
    import random

    from nanoserve.attention.paged import PagedKVCache
    from nanoserve.scheduler.blocks import blocks_needed

    rng = random.Random(seed)
    torch.manual_seed(seed)
    lens = [past + new for past, new in seqs]
    num_blocks = sum(blocks_needed(n, block_size) for n in lens) + spare_blocks
    cache = PagedKVCache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    cache.k.normal_()
    cache.v.normal_()
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(blocks_needed(n, block_size))] for n in lens]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], num_heads, head_dim, dtype=dtype, device=device)
    return cache, tables, block_tables, starts, lens, q


def run_scheduler(scheduler, arrivals: dict[int, list], token: int = 7, max_steps: int = 100_000,
                  on_step=None) -> int:
    """Drive a `Scheduler` with a fake runner: every scheduled sequence gets `token` each step.

    `arrivals[step]` lists the sequences that arrive just before that step. `on_step(step,
    batch)` is called after each schedule(), before update(): the place to check invariants.
    Returns the number of steps until every sequence finished.
    """
    step = 0
    last_arrival = max(arrivals, default=-1)
    while step <= last_arrival or scheduler.has_unfinished():
        for seq in arrivals.get(step, []):
            scheduler.add(seq)
        batch = scheduler.schedule()
        if on_step is not None:
            on_step(step, batch)
        scheduler.update(batch, [[token] * n for n in batch.num_samples])
        step += 1
        if step > max_steps:
            raise RuntimeError(f"the scheduler did not finish in {max_steps} steps")
    return step


def fitting_arrivals(scheduler, timed: list[tuple[int, object]]) -> tuple[dict[int, list], list]:
    """(step, sequence) pairs -> (arrivals for `run_scheduler`, the sequences kept): a sequence
    that could never fit the scheduler's pool is left out, as `Scheduler.add` would refuse it."""
    arrivals: dict[int, list] = {}
    kept = []
    for step, seq in timed:
        try:
            scheduler.add(seq)  # only to check that it fits: run_scheduler adds it at its step
        except ValueError:
            continue
        scheduler.waiting.remove(seq)
        kept.append(seq)
        arrivals.setdefault(step, []).append(seq)
    return arrivals, kept


def check_block_invariants(scheduler, batch=None) -> None:
    """No block owned twice, free + used = total, every scheduled sequence's table covers it."""
    alloc = scheduler.allocator
    owned = [b for seq in scheduler.running for b in seq.block_table]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert set(owned) == alloc.used, "allocator's used set differs from what sequences hold"
    assert alloc.num_free + alloc.num_used == alloc.num_blocks
    assert all(not seq.block_table for seq in scheduler.waiting), "a waiting sequence holds blocks"
    if batch is not None:
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert len(seq.block_table) * scheduler.block_size >= seq.num_computed + n, \
                f"sequence {seq.seq_id}'s block table does not cover its tokens"


# ------------------------------------------------------------------------- a real test server


class AppThread:
    """Any ASGI app (a proxy, a front) served by uvicorn on a free loopback port, on a thread;
    `config` goes to `uvicorn.Config`. `with AppThread(app) as s: httpx.get(s.url + "/health")`"""

    def __init__(self, app, **config):
        import uvicorn

        self.app, self.port = app, free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", **config))

    def __enter__(self):
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class ServerThread(AppThread):
    """The real nanoserve server (uvicorn + FastAPI + the engine thread) on a loopback port:
    `with ServerThread(engine_kwargs=dict(model="tiny", device="cpu")) as server: httpx.get(server.url)`"""

    def __init__(self, engine_kwargs: dict | None = None, model_name: str = "tiny", api_key: str | None = None,
                 max_pending: int = 256, max_body_bytes: int = 1 << 20, app_kwargs: dict | None = None,
                 keep_alive_timeout: float = 5.0):
        from nanoserve.engine.async_engine import AsyncEngine
        from nanoserve.engine.config import EngineConfig
        from nanoserve.engine.engine import Engine
        from nanoserve.server.app import create_app
        from nanoserve.server.http11 import OpenAIErrorH11Protocol

        kwargs = dict(model="tiny", device="cpu")
        kwargs.update(engine_kwargs or {})
        self.engine = Engine(EngineConfig(**kwargs))
        self.async_engine = AsyncEngine(self.engine, max_pending=max_pending)
        app = create_app(self.async_engine, model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                         **(app_kwargs or {}))
        # as `nanoserve serve` runs it: the protocol that answers malformed HTTP in OpenAI's shape
        super().__init__(app, http=OpenAIErrorH11Protocol, timeout_keep_alive=keep_alive_timeout)

    def __enter__(self) -> "ServerThread":
        self.async_engine.start()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__()
        self.async_engine.shutdown()

    def slowed(self, seconds: float = 0.02):
        """A context in which every engine step takes `seconds` longer, so that a request stays
        in flight long enough for a test to act on it (disconnect, fill the queue)."""
        import contextlib
        import time

        @contextlib.contextmanager
        def slow():
            step = self.engine.step

            def slow_step():
                time.sleep(seconds)
                return step()

            self.engine.step = slow_step
            try:
                yield self
            finally:
                self.engine.step = step

        return slow()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until no request is in flight and every KV block is free (or held: issue 38's sessions)."""
        import time

        alloc = self.engine.scheduler.allocator
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.engine.has_unfinished() and alloc.num_free + self.engine.held_kv()["blocks"] == alloc.num_blocks:
                return True
            time.sleep(0.02)
        return False


# ------------------------------------------------------------------ JSON schemas (structured output)


def random_value_schema(rng, depth: int) -> dict:
    """A random JSON schema for one value (`rng` a random.Random): what the structured-output tests send."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "x", "yes no"], rng.randint(1, 4))}
    if kind == "array":
        item = random_value_schema(rng, depth + 1) if depth < 1 else {"type": "boolean"}
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return random_object_schema(rng, depth + 1)


def random_object_schema(rng, depth: int = 0) -> dict:
    """A random object schema: 1 to 4 required properties, no others."""
    names = rng.sample(["id", "name", "count", "ok", "tags", "color", "inner", "score", "meta"], rng.randint(1, 4))
    properties = {name: random_value_schema(rng, depth) for name in names}
    return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}


def max_bytes(schema: dict) -> int:
    """The most UTF-8 bytes a compact JSON value of this schema can take. A character inside a
    string takes at most 12 (an escaped surrogate pair, \\uXXXX\\uXXXX)."""
    if "enum" in schema:
        return max(2 + 12 * len(v) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + 12 * schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "boolean":
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (max_bytes(schema["items"]) + 1)
    return 2 + sum(len(json.dumps(k)) + 1 + max_bytes(v) + 1 for k, v in schema["properties"].items())


def schema_format(schema: dict, name: str) -> dict:
    """The `response_format` of a request asking for `schema`."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def free_ports(n: int) -> int:
    """The first of `n` consecutive free ports (on every interface), drawn below Linux's ephemeral range (32768 on):
    ports the OS hands out to other tests' servers come one after another there, and under pytest-xdist
    another test's server could take the port right after this one's."""
    import contextlib
    import random
    import socket

    rng = random.Random()
    while True:
        first = rng.randrange(20000, 32000 - n)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + n):
                    stack.enter_context(socket.socket()).bind(("", port))  # every interface: Ray binds the host's address
            return first
        except OSError:
            continue


def dead_url() -> str:
    """A loopback URL on which nothing listens (a port bound, then closed): a replica that is down."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def command_parsers(parser, name: str = "nanoserve"):
    """(command name, parser) of an argparse parser and of all its subcommands."""
    import argparse

    yield name, parser
    for action in parser._actions:  # argparse keeps its actions in a private list; no public way
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from command_parsers(sub, f"{name} {sub_name}")
