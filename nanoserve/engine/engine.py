"""Week 5: the engine loop, and the offline `LLM` API on top of it.

    while has_work:
        batch   = scheduler.schedule()           # who runs this step
        logits  = runner.execute(batch)          # one forward pass for the whole batch
        tokens  = sampler(logits, ...)           # the tokens each sequence samples (usually one)
        scheduler.update(batch, tokens)          # append; stop tokens, stop strings, limits; free blocks
        deliver(outputs)                         # text deltas, finished requests

`Engine.step()` is one turn of that loop. `LLM.generate()` runs it until every prompt is done.
Later weeks plug into the same step: speculative decoding (week 17) through the hooks of
`SpecDecoder` around the forward pass, and async scheduling (week 12), which launches a step
before the step before it is resolved. The outputs are built by the `OutputProcessor` (outputs.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from nanoserve.course.stubs import stubbed_weeks
from nanoserve.engine.config import EngineConfig, default_device
from nanoserve.engine.device import build_device_side
from nanoserve.engine.disaggregation import check_kv_transfer, disaggregation_sides
from nanoserve.engine.distributed import WorkerFailed, start_tensor_parallel, stop_workers
from nanoserve.engine.lora import LoRARegistry
from nanoserve.engine.outputs import OutputProcessor, RequestOutput
from nanoserve.engine.pipeline import check_pipeline_config, pipeline_depths
from nanoserve.engine.reports import EngineReports
from nanoserve.engine.speculative import SpecDecoder
from nanoserve.engine.steps_in_flight import StepsInFlight
from nanoserve.engine.tokenizer import Tokenizer
from nanoserve.model.loader import check_model_dir, resolve_model_dir
from nanoserve.sampling.grammar import TokenConstraint, make_tokenizer
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sampler import Sampler
from nanoserve.scheduler.remote_kv import RemoteKVScheduler
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Batch, Sequence


@dataclass
class StepRecord:
    """What one engine step did (kept when the engine runs with `trace=True`)."""

    step: int
    start: float  # perf_counter seconds
    end: float
    seq_ids: list[int]
    num_new_tokens: list[int]  # per sequence: > 1 for a prefill, 1 for a decode
    num_waiting: int
    blocks_used: int


@dataclass
class _InFlight:
    """Async scheduling: a step launched on the GPU whose tokens the host has not seen yet."""

    batch: Batch
    tokens: torch.Tensor  # [sampled rows] on the device: the next step's inputs read them there
    rows: dict[int, int]  # sequence id -> its row in `tokens`
    host: torch.Tensor  # where the tokens land on the host (pinned)
    event: torch.cuda.Event | None  # recorded after the copy to the host
    before: list  # Scheduler.launched's record, for Scheduler.resolve


class Engine(EngineReports):
    def __init__(self, config: EngineConfig | None = None):
        c = config or EngineConfig()
        self.config = c = dataclasses.replace(c, device=c.device or default_device())
        model_dir = resolve_model_dir(c.model)
        check_model_dir(model_dir)  # what a folder lacks, named before any library trips over it
        self.model_name = str(c.model)
        self.tokenizer = Tokenizer(model_dir, tool_template=c.tool_template)
        # Week 18: with tensor parallelism this process is rank 0, the driver; the other ranks
        # build the same device side (`build_device_side`) and run the steps it broadcasts.
        self.workers, group = None, None
        if c.world_size == 1 and c.distributed_executor != "mp":
            raise ValueError(f"distributed_executor={c.distributed_executor!r} starts the other ranks of a tensor-"
                             "parallel engine: it needs tensor_parallel_size > 1 (or pipeline_parallel_size > 1)")
        check_pipeline_config(c, model_dir)  # week 20: what stages refuse, said before any process starts
        if c.cpu_offload_gb and not (self._prefix_caching() and c.batching == "continuous"):
            raise ValueError("--cpu-offload-gb keeps the blocks the prefix cache evicts: it needs prefix caching "
                             "(--enable-prefix-caching, with continuous batching)")
        if c.world_size > 1:
            group, self.workers = start_tensor_parallel(c)
        try:
            side = build_device_side(c, group)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise
        self.model, self.runner, self.kv_sizing = side.model, side.runner, side.kv_sizing
        self.attention_backend, self.max_model_len = side.attention_backend, side.max_model_len
        self.runner.workers = self.workers
        if self.workers is not None:  # stop them when this engine goes away, or at exit
            weakref.finalize(self, stop_workers, self.runner, self.workers)
        cfg = self.model.config
        scheduler = RemoteKVScheduler if c.kv_role else Scheduler  # issue 35: an instance of a disaggregated pair
        self.scheduler = scheduler(side.num_blocks, c.block_size, c.max_num_seqs, c.max_num_batched_tokens,
                                   self.max_model_len, batching=c.batching, preemption=c.preemption,
                                   prefix_caching=self._prefix_caching(), chunked_prefill=c.enable_chunked_prefill,
                                   scheduling=c.scheduling_policy, cpu_blocks=side.num_cpu_blocks,
                                   max_loras=c.max_loras)
        if c.enable_chunked_prefill and c.max_num_batched_tokens < c.max_num_seqs:
            warnings.warn(f"chunked prefill with a budget of {c.max_num_batched_tokens} tokens for up to {c.max_num_seqs} "
                          "sequences: when more sequences decode than the budget holds, the newest wait and prompts "
                          "make no progress; raise --max-num-batched-tokens or lower --max-num-seqs", stacklevel=2)
        self.eos_ids = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.sampler = Sampler(self.runner.device, one_pass_argmax=self.runner.fused)  # issue 39
        self.output_processor = OutputProcessor(self.tokenizer, self.sampler, self.runner)
        self._grammar_tokenizer = None  # structured output (week 10): built on first use
        self.sequences: dict[int, Sequence] = {}
        self.adapters = LoRARegistry(self.runner.lora, cfg, c.max_lora_rank, self.model_name, self.scheduler,
                                     self.sequences)  # week 23: the LoRA adapters served, by name
        for name, path in (c.lora_modules or {}).items():
            self.adapters.add(name, path)
        self.num_steps = 0
        self.trace: list[StepRecord] | None = [] if c.trace else None
        self.speculator = None
        if c.speculative is not None:  # week 17
            self.speculator = SpecDecoder(c.speculative, c.num_speculative_tokens, c.speculative_max_batch,
                                          runner=self.runner, scheduler=self.scheduler, sampler=self.sampler,
                                          max_model_len=self.max_model_len, attention_backend=self.attention_backend,
                                          draft_model=c.draft_model, ngram_min=c.ngram_min)
        self.async_scheduling = self._choose_async_scheduling()
        self._in_flight: _InFlight | None = None  # async scheduling: the step launched and not yet resolved
        self._needs_tokens: set[int] = set()  # requests whose sampling reads earlier tokens on the host
        self._host_tokens = [torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)]  # pinned, alternated
        self.kv_prefill, self.kv_decode = disaggregation_sides(c, self.runner.cache)  # issue 35; None, None: both phases
        depth = pipeline_depths(c)[0]  # week 20: steps in flight through a pipeline's stages (1: one at a time)
        self.pipelined = StepsInFlight(self.scheduler, self.runner, depth) if depth > 1 else None

    def _prefix_caching(self) -> bool:
        """Week 14's prefix caching: as asked, or by default on with continuous batching. In a
        learner's workspace it stays off by default until week 14's exercises are written, so the
        earlier weeks never run a stub (nanoserve/course/stubs.py, `stubbed_weeks`)."""
        c = self.config
        if c.enable_prefix_caching is not None:
            return c.enable_prefix_caching

        return c.batching == "continuous" and 14 not in stubbed_weeks()

    def _choose_async_scheduling(self) -> bool:
        """Async scheduling (week 12), as asked, or by default where it pays: with CUDA
        graphs on a GPU (on the CPU every operation finishes before the next starts, so there is
        nothing to overlap), once week 12 is done in a learner's workspace. Not with speculation
        (its guesses are built from the tokens on the host). With tensor parallelism (week 20) the
        workers get the sampled tokens from the driver's GPU (`Workers.run_step`)."""
        c = self.config
        conflicts = [name for name, on in (("pipeline parallelism", c.pipeline_parallel_size > 1),
                                           ("speculative decoding", self.speculator is not None)) if on]
        if c.async_scheduling is not None:
            if c.async_scheduling and conflicts:
                raise ValueError(f"async scheduling does not work with {' or '.join(conflicts)}")
            return c.async_scheduling

        graphs = self.runner.graphs
        return graphs is not None and graphs.capture and not conflicts and 12 not in stubbed_weeks()

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    stream: bool = True, priority: int = 0, kv_transfer: dict | None = None,
                    lora: str | None = None, arrival_time: float | None = None, hold_kv: bool = False,
                    resume_from: int | None = None) -> int:
        """Queue a prompt (text or token ids); returns its request id. `priority` (lower runs
        first) matters only with `scheduling_policy="priority"`. `kv_transfer` (issue 35, see
        nanoserve/engine/disaggregation.py): on a prefill instance `{"send": True}` keeps the
        prompt's KV for a decode instance; on a decode instance, what the prefill instance answered
        (then `prompt` is ignored: the prompt is the one whose KV comes). `lora` names a loaded
        adapter (week 23) to run it under; None: the base model. `arrival_time` (issue 38, on
        `time.perf_counter()`'s clock): when a server got it; its queue time and TTFT count from there.

        Issue 38, held KV (nanoserve/scheduler/held.py): with `hold_kv`, a request that ends by stop or
        length keeps its KV blocks, held under its request id (an int, as returned here) until a
        request resumes from it, `release_held` frees it, or the pool needs the room. `resume_from` (a
        request id) starts this request from that entry's KV: only the prompt past their longest common
        prefix is prefilled; an entry that is gone means a plain prefill. The outputs tell how it went
        (`RequestOutput.num_resumed_tokens`, `.resume_outcome`).

        With `stream=False` the request produces one output, when it finishes, its text decoded
        once at the end (unless it has stop strings, which must be looked for as the text grows)."""
        params = params or SamplingParams()
        lora_id = self.adapters.id_of(lora)
        if self.workers is not None and self.workers.failed is not None:
            raise WorkerFailed(self.workers.failed)
        transfer = check_kv_transfer(self.config.kv_role, kv_transfer, params, self.model.config.vocab_size)  # issue 35
        if transfer is not None:
            prompt = transfer.prompt_token_ids
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len}")
        vocab_size = self.model.config.vocab_size
        if any(t >= vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias names token {max(params.logit_bias)}; this model's vocabulary has "
                             f"{vocab_size} tokens")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        constraint = None
        if params.grammar is not None:  # structured output: the grammar also ends the request
            constraint = TokenConstraint(self.grammar_tokenizer(), params.grammar, vocab_size, frozenset(stop_ids))
        seq = Sequence(ids, params, stop_ids=frozenset(stop_ids), priority=priority, lora_id=lora_id,
                       keep_kv=self.kv_prefill is not None and kv_transfer is not None,
                       arrival_time=time.perf_counter() if arrival_time is None else arrival_time, hold_kv=hold_kv)
        self.output_processor.add(seq, stream, constraint)  # its text, and its stop checker
        self.scheduler.add(seq)  # (which refuses a request that can never fit)
        if resume_from is not None and transfer is None:  # issue 38 (static and admit-all batching: no resume)
            self.scheduler.held.attach(seq, resume_from, reuse=self.scheduler.batching == "continuous")
        if transfer is not None:  # issue 35: its KV comes from a prefill instance; it waits outside the queue
            self.scheduler.waiting.remove(seq)
            self.kv_decode.add(seq, transfer)
        self.sampler.add(seq.seq_id, params, seq.prompt_len, constraint)
        self.sequences[seq.seq_id] = seq
        if params.grammar is not None or params.presence_penalty or params.frequency_penalty \
                or params.repetition_penalty != 1.0:
            self._needs_tokens.add(seq.seq_id)  # async scheduling: its steps wait for the host to see each token
        return seq.seq_id

    def land_transfers(self) -> list[RequestOutput]:
        """Issue 35, on a decode instance: requests whose KV has landed join the scheduler; each gets
        its first output (the prefill instance's token), and each whose transfer failed its last
        (finish reason "error")."""
        outputs = []
        for seq, landed in self.kv_decode.poll(self.scheduler):
            transfer = dict(num_bytes=landed.num_bytes, seconds=landed.seconds)
            if landed.error is not None:
                out = self.output_processor.abort(seq)
                out.finish_reason, out.error, out.kv_transfer = "error", landed.error, transfer
                outputs.append(out)
                self._forget(seq.seq_id)
                continue
            for out in self.output_processor.outputs(Batch([seq], [0]), [seq.output_ids]):
                out.kv_transfer = transfer
                outputs.append(out)
                if out.finished:
                    self._forget(out.request_id)
        return outputs

    def grammar_tokenizer(self):
        """Structured output's view of the tokenizer (`nanoserve.sampling.grammar.make_tokenizer`),
        built the first time a request asks for it."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = make_tokenizer(self.tokenizer.hf)
        return self._grammar_tokenizer

    def abort(self, request_id: int) -> RequestOutput | None:
        """Cancel a request now: its KV blocks go back to the pool at once. Returns its final
        output (finish reason "abort"), or None if it had already finished."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        if self.kv_decode is not None:  # issue 35: its KV may still be on its way
            self.kv_decode.abort(request_id)
        self.scheduler.finish(seq, "abort")
        self._forget(request_id)
        return self.output_processor.abort(seq)

    def release_held(self, request_id: int) -> bool:
        """Issue 38: free the KV held for `request_id`. False if none was held (or it is gone)."""
        return self.scheduler.held.release(request_id)

    @property
    def requests(self) -> dict:
        """The requests in the engine (finished ones leave it), by request id."""
        return self.output_processor.requests

    def _forget(self, request_id: int) -> None:
        """A request finished or was aborted: drop what the engine, the sampler and the runner
        kept for it (its text left the output processor with its last output)."""
        del self.sequences[request_id]
        self.sampler.release(request_id)
        self._needs_tokens.discard(request_id)
        self.runner.prompt_logprobs.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or \
            (self.pipelined is not None and self.pipelined.busy) or \
            (self.kv_decode is not None and bool(self.kv_decode.arrivals))

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (week 18), if any, and the KV connector's thread
        (issue 35). Idempotent."""
        if self.pipelined is not None and self.workers is not None and not self.workers.closed:
            try:  # week 20: the steps in flight end before the group does
                self.pipelined.abandon()
            except WorkerFailed:
                pass
        if self.workers is not None:
            stop_workers(self.runner, self.workers)
        for side in (self.kv_prefill, self.kv_decode):
            if side is not None:
                side.connector.close()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule a batch, run it, count it, deliver. Returns an output for
        every request that got a token (with async scheduling: in the step launched before this
        one, which this one resolves)."""
        start = time.perf_counter()
        if self.kv_decode is not None and self.kv_decode.arrivals:  # issue 35: requests whose KV has come join
            landed = self.land_transfers()                           # (they run from the next step on)
            if landed:
                return landed
            if not self.scheduler.has_unfinished() and self._in_flight is None:  # only transfers to wait for:
                self.kv_decode.connector.wait_for_landing(0.01)                  # no busy loop
                return []
        if self.pipelined is not None:  # week 20: launch one lane's step, land the steps whose lanes come next
            batch, landed = self.pipelined.step(self.sample)
            if batch.seqs:
                self._count_step(start, batch)
            return [out for done in landed for out in self.deliver(done)]
        run_async = self.async_scheduling and not self._needs_tokens
        if self._in_flight is not None and not run_async:  # a request that needs its tokens on the host came in
            return self.deliver(self.resolve_in_flight())
        batch = self.scheduler.schedule()
        if run_async:  # week 12: launch this batch, then resolve the step launched before it
            done = self.run_step_async(batch)
        elif batch.seqs:
            done = batch, self.run_step(batch)
        else:
            return []
        if batch.seqs:
            self._count_step(start, batch)
        return self.deliver(done)

    def run_step(self, batch: Batch) -> list[list[int]]:
        """Run a scheduled batch: one forward pass, the tokens it samples, handed to the
        scheduler. Returns each sequence's new tokens. With speculative decoding (week 17) the
        decodes also run the speculator's guesses, and get the guesses the target accepts."""
        spec = self.speculator if self._speculating() else None
        drafts = spec.propose(batch) if spec is not None else None  # the guesses join the batch
        try:
            logits = self.runner.execute(batch)  # [rows to sample, vocab]
        finally:
            if drafts is not None:  # between steps, token_ids hold real tokens only
                self.scheduler.remove_drafts(batch, drafts.tokens)
        tokens = self.sample(logits, batch) if spec is None else spec.verify(logits, batch, drafts)
        self.scheduler.update(batch, tokens)
        if spec is not None:
            spec.after_update(batch, drafts)
        return tokens

    def sample(self, logits: torch.Tensor, batch: Batch) -> list[list[int]]:
        """The tokens each sequence of `batch` samples, one list per sequence (empty for those
        that sample nothing). `logits` has `num_samples[i]` consecutive rows for sequence i, in
        batch order."""
        # >>> week05: engine-step
        rows = [s for s, n in zip(batch.seqs, batch.num_samples) for _ in range(n)]  # the sequence of each row
        flat = self.sampler(logits, [s.seq_id for s in rows], [s.params for s in rows],
                            [s.token_ids for s in rows]).tolist()  # the step's one device->host copy
        tokens, i = [], 0
        for n in batch.num_samples:  # back to one list per sequence
            tokens.append(flat[i : i + n])
            i += n
        return tokens
        # <<< week05: engine-step

    def _count_step(self, start: float, batch: Batch) -> None:
        """Count a step that ran (with async scheduling: was launched), and keep its StepRecord
        when tracing (with async scheduling, its end is when the step before it was resolved)."""
        self.num_steps += 1
        if self.trace is not None:
            self.trace.append(StepRecord(self.num_steps - 1, start, time.perf_counter(), [s.seq_id for s in batch.seqs],
                                         list(batch.num_new_tokens), len(self.scheduler.waiting),
                                         self.scheduler.allocator.num_used))

    def deliver(self, done: tuple[Batch, list[list[int]]] | None) -> list[RequestOutput]:
        """The outputs of a step whose tokens the host has (`done`: its batch and each sequence's
        new tokens; None: no step), in batch order. A request that finished leaves the engine."""
        if done is None:
            return []
        outputs = self.output_processor.outputs(*done)
        for out in outputs:
            if out.finished:
                if self.kv_prefill is not None:  # issue 35: its prompt's KV goes to a decode instance
                    transfer = self.kv_prefill.send(self.sequences[out.request_id], self.scheduler)
                    out.kv_transfer = transfer.to_dict() if transfer is not None else None
                held = self.scheduler.held.entries.get(out.request_id)  # issue 38
                out.num_held_blocks = len(held.blocks) if held is not None else 0
                self._forget(out.request_id)
        return outputs

    def _speculating(self) -> bool:
        """Whether this step runs with guesses (week 17). Verification samples with neither the
        raw logits at hand for logprobs, nor the output tokens for presence and frequency
        penalties, and its greedy path skips `logit_bias`. So while a request asking for any of
        these is in the engine, every step is a plain one: no guesses, for anybody. The same while
        a request with structured output is in: its grammar would have to check every guess (and
        roll back the rejected)."""
        return self.speculator is not None and not any(
            p.logprobs is not None or p.prompt_logprobs is not None or p.presence_penalty or p.frequency_penalty
            or p.logit_bias or p.grammar is not None for p in (s.params for s in self.sequences.values()))

    # -- async scheduling (week 12): the loop one step ahead of the GPU -------------------------------

    def run_step_async(self, batch: Batch) -> tuple[Batch, list[list[int]]] | None:
        """Launch `batch` while the GPU still runs the step in flight, then wait for that step's
        tokens and hand them to the scheduler. Returns the step resolved (as `resolve_in_flight`).
        The GPU never waits for the host between steps; the host's scheduling, staging and output
        work hide behind the GPU's forward pass. Tokens and outputs are exactly those of
        `run_step`: stop checks run one step late, and the token a sequence sampled after its end
        is dropped."""
        # >>> week12: step-ahead
        launched = None
        if batch.seqs:
            try:
                launched = self._launch(batch)
            except BaseException:
                self._in_flight = None  # the step before it is lost too: its requests get aborted
                raise
        done = self.resolve_in_flight()
        self._in_flight = launched
        return done
        # <<< week12: step-ahead

    def resolve_in_flight(self) -> tuple[Batch, list[list[int]]] | None:
        """Wait for the step in flight and hand its tokens to the scheduler. Returns it, as its
        batch and each sequence's new tokens (None: nothing was in flight). Afterwards no token is
        on the GPU that the host has not seen."""
        if self._in_flight is None:
            return None
        f, self._in_flight = self._in_flight, None
        if f.event is not None:
            f.event.synchronize()
        flat = f.host.tolist()
        tokens = [[flat[f.rows[s.seq_id]]] if s.seq_id in f.rows else [] for s in f.batch.seqs]
        self.scheduler.resolve(f.batch, tokens, f.before)  # stop checks, one step late
        return f.batch, tokens

    def _launch(self, batch: Batch) -> _InFlight:
        """Run the forward pass and the sampler for `batch` without waiting for either: the
        sampled tokens stay on the device (the next step reads its inputs from there), and a
        copy of them to the host is queued behind them."""
        last = None if self._in_flight is None else (self._in_flight.tokens, self._in_flight.rows)
        logits = self.runner.execute(batch, last)
        sampling = [s for s, k in zip(batch.seqs, batch.num_samples) if k]
        tokens = self.sampler(logits, [s.seq_id for s in sampling], [s.params for s in sampling])
        host, event = tokens, None
        if tokens.is_cuda:  # into one of two reused pinned buffers (the other may still be in use)
            self._host_tokens.reverse()
            if self._host_tokens[0].numel() < tokens.numel():
                self._host_tokens[0] = torch.empty(max(tokens.numel(), 256), dtype=torch.long, pin_memory=True)
            host = self._host_tokens[0][: tokens.numel()]
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        before = self.scheduler.launched(batch)
        return _InFlight(batch, tokens, {s.seq_id: i for i, s in enumerate(sampling)}, host, event, before)


class LLM:
    """Offline generation: give it prompts, get completions, in order.

        llm = LLM("tiny")
        outs = llm.generate(["The list", "A dictionary"], SamplingParams(max_tokens=20))
        print(outs[0].text)
    """

    def __init__(self, model: str | os.PathLike | EngineConfig = "tiny", **engine_config):
        """`model` names the model (with `engine_config`: any other field of `EngineConfig`, such
        as device, dtype or num_blocks), or is a whole `EngineConfig`."""
        config = model if isinstance(model, EngineConfig) else EngineConfig(model=model, **engine_config)
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's other ranks (with tensor parallelism); nothing to do otherwise."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_lora(self, name: str, path: str | os.PathLike) -> None:
        """Week 23: load a PEFT LoRA adapter under `name`, for `generate(..., lora=name)`."""
        self.engine.adapters.add(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.adapters.remove(name)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Complete every prompt. `lora` (week 23): the adapter every prompt runs under, or one per
        prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(params) != len(prompts) or len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params and {len(loras)} adapters")
        ids = [self.engine.add_request(p, sp, stream=False, lora=a) for p, sp, a in zip(prompts, params, loras)]
        results: dict[int, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(prompts) >= 32
        from tqdm.auto import tqdm

        with tqdm(total=len(ids), desc="generate", unit="req", disable=not show) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]


