"""Week 5: the model runner turns the scheduler's `Batch` into one forward pass.

It is the only place where scheduling decisions (lists of sequences and token counts) meet
tensors, and it owns everything on the device side of a step: the paged KV pool, and (week 12)
the CUDA graphs with their scratch block. Each step goes through one plain description of it:

    Batch --step_input()--> StepInput --prepare()--> tensors + attention context --Llama.forward--> logits
                                 (decode steps, week 12) --graphs.run()--> one replay of Llama.forward --> logits

`StepInput` holds lists of ints only, no `Sequence` and no tensor, so the eager path, the graph
path (and, later, a worker process on another GPU) all consume the same thing: the new tokens of
every scheduled sequence back to back (ids, positions), the lists behind `PagedAttentionMetadata`
(under the same names), and the packed rows whose logits are sampled.
"""

from __future__ import annotations

import torch

from nanoserve.attention.cpu_pool import CPUKVPool
from nanoserve.attention.fp8_cache import kv_cache_class
from nanoserve.attention.paged import PagedAttentionMetadata, PagedContext
from nanoserve.model.llama import Llama
from nanoserve.model.lora import lora_rows
from nanoserve.runner.cuda_graphs import feed_last_tokens
from nanoserve.runner.lora import AdapterPool
from nanoserve.runner.step import StepInput
from nanoserve.sampling.sampler import TokenLogprob, token_logprobs
from nanoserve.scheduler.blocks import blocks_needed, slot_of
from nanoserve.scheduler.sequence import PENDING, Batch, Sequence


class ModelRunner:
    def __init__(self, model: Llama, num_blocks: int, block_size: int, attention_backend: str = "torch",
                 cuda_graphs: bool = False, max_model_len: int = 2048, max_batch: int = 256,
                 fused_kernels: bool = False, verify_tokens: int = 0, verify_batch: int = 0, mixed_tokens: int = 0,
                 cpu_blocks: int = 0, lora: AdapterPool | None = None, kv_cache_dtype: str = "auto"):
        self.model = model
        self.lora = lora  # week 23: the adapters, when the model has LoRA layers (`enable_lora`)
        self.device = model.embed_tokens.weight.device
        self.workers = None  # week 18, on the driver: the other ranks (nanoserve.engine.distributed.Workers)
        self.prompt_logprobs: dict[int, dict[int, TokenLogprob]] = {}  # prompt logprobs: seq_id -> position -> logprob
        cfg = model.config
        # Week 12: CUDA graphs need one block beyond the pool the scheduler hands out: the
        # padding rows of a padded batch write their K/V there.
        self.scratch_block = num_blocks if cuda_graphs else None
        # Issue 33: `kv_cache_dtype` "fp8" stores the pool as e4m3 codes and scales (Fp8PagedKVCache)
        self.cache = kv_cache_class(kv_cache_dtype)(cfg.num_layers, num_blocks + int(cuda_graphs), block_size,
                                                    cfg.num_kv_heads, cfg.head_dim,
                                                    dtype=model.embed_tokens.weight.dtype, device=self.device)
        self.cpu_pool = CPUKVPool(self.cache, cpu_blocks) if cpu_blocks else None  # the CPU tier (issue 35)
        self.context_class = PagedContext
        # Week 12's fused kernels (behind the norms and MLPs, and in the K/V write) need the Triton backend.
        self.fused = fused_kernels and attention_backend == "triton"
        if attention_backend == "triton":  # week 6: same context interface, Triton inside
            from nanoserve.attention.triton import TritonPagedContext
            from nanoserve.kernels.fused import use_fused_kernels
            from nanoserve.kernels.paged_attention import warm_up

            self.context_class = TritonPagedContext
            use_fused_kernels(model, self.fused)
            if lora is not None:  # week 23: the adapters' products in two kernels (`nanoserve/kernels/lora.py`)
                from nanoserve.kernels.lora import use_lora_kernels

                use_lora_kernels(lora.state)
            if self.device.type == "cuda":  # compile the kernel's variants now, not mid-serving
                windows = {cfg.window(i) for i in range(cfg.num_layers)}  # week 19: sliding layers' variant too
                c = self.cache
                warm_up(c.k[0], c.v[0], cfg.num_heads, max_model_len, windows=sorted(windows, key=str), dtype=c.dtype,
                        k_scale=None if c.k_scale is None else c.k_scale[0],
                        v_scale=None if c.v_scale is None else c.v_scale[0], merge_in_kernel=self.fused)
        self.graphs = None
        if cuda_graphs:  # on the CPU: the same static buffers and padding, nothing captured
            self.graphs = self.build_graphs(max_model_len, max_batch, verify_tokens=verify_tokens,
                                            verify_batch=verify_batch, mixed_tokens=mixed_tokens)

    def build_graphs(self, max_model_len: int, max_batch: int, **shapes):
        """Week 12's graph runner over this runner's pool (`shapes`: week 17's verification and week 15's
        mixed steps). A pipeline stage builds its own (week 20: `PipelineRunner.build_graphs`)."""
        from nanoserve.runner.cuda_graphs import CUDAGraphDecoder

        return CUDAGraphDecoder(self.model, self.cache, self.scratch_block, max_model_len, max_batch,
                                self.context_class, fused=self.fused,
                                lora=None if self.lora is None else self.lora.state, **shapes)

    @classmethod
    @torch.no_grad()
    def measure_step_memory(cls, model: Llama, block_size: int, max_num_batched_tokens: int, max_model_len: int,
                            max_batch: int, **runner_args) -> int:
        """GPU bytes a step needs beyond the weights and the KV pool, measured, not guessed: build
        a runner over a pool just large enough (its CUDA graphs captured, if any), run the largest
        prefill step the scheduler may send (max_num_batched_tokens tokens, as many rows sampled
        as the largest batch), and read the allocator's peak. Everything is freed afterwards."""
        tokens = min(max_num_batched_tokens, max_model_len)
        num_blocks = blocks_needed(tokens, block_size)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_reserved()
        runner = cls(model, num_blocks, block_size, max_model_len=max_model_len, max_batch=max_batch, **runner_args)
        pool = runner.cache.nbytes
        rows = min(tokens, max_batch)
        step = StepInput(input_ids=[0] * tokens, positions=list(range(tokens)), slot_mapping=list(range(tokens)),
                         query_start_loc=[0, tokens], context_lens=[tokens], block_tables=[list(range(num_blocks))],
                         table_ids=[(-1, 0)], sample_rows=list(range(tokens - rows, tokens)))
        runner.measure_forward(step)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_reserved() - before - pool
        del runner
        torch.cuda.empty_cache()
        return peak

    def measure_forward(self, step: StepInput) -> None:
        """The forward pass `measure_step_memory` measures (week 20: a pipeline stage runs its share)."""
        input_ids, positions, ctx = self.prepare(step)
        self.set_lora_rows(step)
        hidden = self.model(input_ids, positions, ctx)
        self.model.compute_logits(hidden[torch.tensor(step.sample_rows, device=self.device)])

    def lora_slots(self, batch: Batch) -> list[int]:
        """Week 23: each input token's adapter slot (its sequence's; -1: none), the adapters made resident
        first; [] when no sequence of the batch has one."""
        if self.lora is None or not any(seq.lora_id for seq in batch.seqs):
            return []
        slots = self.lora.slots([seq.lora_id for seq in batch.seqs])
        return [slot for slot, n in zip(slots, batch.num_new_tokens) for _ in range(n)]

    def set_lora_rows(self, step: StepInput) -> None:
        """Week 23: tell the LoRA layers which rows of this eager step use which slot."""
        if self.lora is not None:
            self.lora.state.rows = lora_rows(step.lora_slots, self.lora.max_loras, self.device)

    def step_input(self, batch: Batch) -> StepInput:
        """The scheduler's batch -> the step as plain lists."""
        # >>> week05: prepare-inputs
        block_size = self.cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        for seq, n, k in zip(batch.seqs, batch.num_new_tokens, batch.num_samples):
            start = seq.num_computed
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [slot_of(seq.block_table, p, block_size) for p in range(start, start + n)]
            query_start_loc.append(query_start_loc[-1] + n)
            context_lens.append(start + n)
            sample_rows += range(query_start_loc[-1] - k, query_start_loc[-1])  # its last k rows
        # <<< week05: prepare-inputs
        return StepInput(input_ids, positions, slots, query_start_loc, context_lens,
                         block_tables=[seq.block_table for seq in batch.seqs],
                         table_ids=[(seq.seq_id, seq.block_table_version) for seq in batch.seqs],
                         sample_rows=sample_rows, offloads=list(batch.offloads), reloads=list(batch.reloads))

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, PagedContext]:
        """StepInput -> (input_ids [T], positions [T], the attention context) on the device."""
        meta = PagedAttentionMetadata.build(step.slot_mapping, step.query_start_loc, step.context_lens,
                                            step.block_tables, device=self.device)
        return (torch.tensor(step.input_ids, dtype=torch.long, device=self.device),
                torch.tensor(step.positions, dtype=torch.long, device=self.device),
                self.context_class(self.cache, meta, fused=self.fused))

    @torch.no_grad()
    def execute(self, batch: Batch, last: tuple[torch.Tensor, dict[int, int]] | None = None) -> torch.Tensor:
        """One forward pass -> logits [sum(batch.num_samples), vocab] (float32), in batch order.

        `last` (async scheduling): the previous step's sampled tokens, still on the
        device, and the row of each sequence's token among them. A sequence whose newest token
        is a placeholder (`PENDING`) takes it from there."""
        step = self.step_input(batch)
        step.lora_slots = self.lora_slots(batch)  # week 23
        last_tokens = None
        if last is not None:
            last_tokens, rows = last
            for i, seq in enumerate(batch.seqs):
                if seq.num_pending:  # its last token is the newest input: one decode row
                    row = step.query_start_loc[i + 1] - 1
                    assert step.input_ids[row] == PENDING, "only a decode's last input can be on the GPU"
                    step.input_ids[row] = 0
                    step.from_last.append((row, rows[seq.seq_id]))
        prompt_rows = self.prompt_rows(batch, step)  # prompt logprobs: rows whose logits are kept, in eager steps only
        if self.workers is not None:  # week 18: every rank runs the same step
            return self.workers.run_step(self.run, step, prompt_rows, last_tokens)
        return self.run(step, prompt_rows, last_tokens)

    @torch.no_grad()
    def run(self, step: StepInput, prompt_rows: list[tuple[int, int, int, int, int]],
            last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`execute` once the step is plain data: what every rank of a tensor-parallel group runs."""
        self.copy_blocks(step)
        if self.graphs is not None and step.is_decode and self.graphs.fits(step.num_seqs):
            return self.graphs.run(step, last_tokens)  # week 12: one replay
        q = self.graphs.verify_shape(step) if self.graphs is not None and not prompt_rows else None
        if q is not None:
            return self.graphs.run_verify(step, q)  # week 17: a verification step, one replay
        t = self.graphs.mixed_size(step) if self.graphs is not None and not prompt_rows else None
        if t is not None:
            return self.graphs.run_mixed(step, t, last_tokens)  # week 15: a mixed step, one replay
        input_ids, positions, ctx = self.prepare(step)
        self.set_lora_rows(step)
        if step.from_last:  # async scheduling
            source = torch.full_like(input_ids, -1)
            source[[d for d, _ in step.from_last]] = torch.tensor([s for _, s in step.from_last], device=self.device)
            feed_last_tokens(input_ids, source, last_tokens)
        hidden = self.model(input_ids, positions, ctx)  # [T, hidden]
        self.keep_prompt_logprobs(prompt_rows, hidden)
        rows = torch.tensor(step.sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])

    def copy_blocks(self, step: StepInput) -> None:
        """The CPU tier: the step's offloads, then its reloads, ordered before its forward pass
        (what is guaranteed: `CPUKVPool`)."""
        if step.offloads or step.reloads:
            assert self.cpu_pool is not None, "a step copies blocks to a CPU tier this runner does not have"
            self.cpu_pool.copy(self.cache, step.offloads, step.reloads)

    def prompt_rows(self, batch: Batch, step: StepInput) -> list[tuple[int, int, int, int, int]]:
        """Prompt logprobs: a request with `prompt_logprobs` (the server's `echo` with `logprobs`) wants the
        logits of every prompt position, not only of the last: row p gives the logprob of prompt
        token p + 1. This step's such rows, as (row, sequence id, position of the token scored, its
        id, alternatives wanted). A prompt run in chunks (week 15) has some in every chunk; one
        run again after a preemption before its first token gives the same values again. (A pure
        decode step never has any: the last prompt row's logits are the first token's.)"""
        wanted = []
        for i, seq in enumerate(batch.seqs):
            k = seq.params.prompt_logprobs
            if k is None or seq.num_output_tokens:  # (with output tokens, its prompt was delivered)
                continue
            start = seq.num_computed
            for p in range(start, min(start + batch.num_new_tokens[i], seq.prompt_len - 1)):
                wanted.append((step.query_start_loc[i] + p - start, seq.seq_id, p + 1, seq.token_ids[p + 1], k))
        return wanted

    def keep_prompt_logprobs(self, wanted: list[tuple[int, int, int, int, int]], hidden: torch.Tensor) -> None:
        """The logprobs of the `prompt_rows`, from the raw logits, kept by sequence and position
        until the engine takes them (`take_prompt_logprobs`)."""
        for first in range(0, len(wanted), 256):  # [256, vocab] of logits at a time, not [prompt, vocab]
            part = wanted[first : first + 256]
            rows = torch.tensor([w[0] for w in part], dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            found = token_logprobs(logits, [w[3] for w in part], [w[4] for w in part])
            for (_, seq_id, position, _, _), entry in zip(part, found):
                self.prompt_logprobs.setdefault(seq_id, {})[position] = entry

    def take_prompt_logprobs(self, seq: Sequence) -> list[TokenLogprob]:
        """The logprobs of `seq`'s prompt tokens, one per token, once its whole prompt has run; the
        first token's logprob is None (nothing predicts it). Forgets them."""
        found = self.prompt_logprobs.pop(seq.seq_id, {})
        return [TokenLogprob(seq.token_ids[0], None, [])] + [found[p] for p in range(1, seq.prompt_len)]
