"""Week 20: one pipeline stage's runner. A step's batch, cut into micro-batches, flows through the
stages so that they work at the same time on different micro-batches.

Every rank gets the same step description (the driver broadcasts a `StepInput`, as in week 18) and
cuts it the same way (`micro_batches`), so every receiver knows the shape of what comes to it and
nothing but the tensors themselves crosses a link. Per step and micro-batch i of T_i tokens:

    stage s -> stage s+1    the stream after stage s's layers, [T_i, hidden] (one tensor: model/pipeline.py)
    last stage -> stage 0   the stream of the rows sampled or scored (prompt logprobs), [rows_i, hidden]

then stage 0 (the driver's stage) runs the final norm and lm_head over those rows, and the driver
samples as it does with one GPU. (Each rank of a stage's tensor-parallel group talks to the rank of
the same tp_rank in the next stage: all of them hold the whole stream.)

The schedule (`pipeline_schedule`). With P stages and M micro-batches, in time slot t stage s runs
micro-batch t - s, when there is one:

    slot        0     1     2     3           P = 2, M = 3
    stage 0    mb0   mb1   mb2    .
    stage 1     .    mb0   mb1   mb2

Micro-batch i reaches stage s at slot i + s, right after stage s-1 finished it; a stage runs one at
a time, in order. A step takes M + P - 1 slots, and every stage is busy in M of them, so each one
idles (P - 1) / (M + P - 1) of the step: the *bubble*. One micro-batch (M = 1) idles every stage
(P - 1) / P of the time, a relay race with one baton; more micro-batches shrink the bubble.

The number of micro-batches (`--pipeline-micro-batches`) is P by default with one step in flight
(1 with several: nanoserve/engine/steps_in_flight.py fills the stages with other steps): the bubble drops from
(P - 1) / P to (P - 1) / (2P - 1) (from 1/2 to 1/3 with two stages), while each micro-batch keeps
1/P of the batch's rows. More cost something: a micro-batch is cut by whole sequences, so there can
be no more than the step's sequences, and each extra one re-reads the stage's weights, which in a
decode step (memory-bound on a GPU) costs about as much as a micro-batch of many rows. Fewer than P
leaves more than a third of every stage idle. The bubble each stage really saw is measured
(`PipelineRunner.bubble_stats`, `Engine.pipeline_stats`); `nanoserve bench` can print it.

Between two slots every rank posts its transfers of that boundary together, as one group
(`dist.batch_isend_irecv`): stage s's send of what it just ran, its receive of what it runs next,
and on stage 0 the rows the last stage just finished. Posted as one group, a send and a receive
between two neighbours cannot wait on each other (NCCL runs the operations of one pair of GPUs in
order; two neighbours each sending first would deadlock on large tensors). On the CPU the same
code runs over gloo.

With `cuda_graphs` (the default on CUDA with the Triton backend, as with one GPU), a decode
micro-batch replays the stage's own graph of its layers, padded to a captured size as week 12 pads
a batch; the transfers stay outside the graphs, and only the real rows travel
(nanoserve/runner/stage_graphs.py). Prefill and mixed micro-batches run eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoserve.model.pipeline import final_hidden, stage_forward
from nanoserve.runner.runner import ModelRunner
from nanoserve.runner.stage_graphs import StageGraphs
from nanoserve.runner.step import StepInput

TIMING_TAG = 7  # the tag of each stage's busy time on its way to the driver (never mistaken for the rows)

# ------------------------------------------------------------------------------- the schedule


def pipeline_schedule(num_stages: int, num_micro: int) -> list[list[tuple[int, int]]]:
    """Time slot t -> the (stage, micro-batch) pairs that run in it: stage s runs micro-batch t - s.
    M + P - 1 slots."""
    # >>> week20: pipeline-schedule
    return [[(s, t - s) for s in range(num_stages) if 0 <= t - s < num_micro]
            for t in range(num_micro + num_stages - 1)]
    # <<< week20: pipeline-schedule


def bubble_fraction(num_stages: int, num_micro: int) -> float:
    """The share of a step each stage idles under `pipeline_schedule`: (P - 1) / (M + P - 1)."""
    return (num_stages - 1) / (num_micro + num_stages - 1)


def stage_timeline(schedule: list[list[tuple[int, int]]], stage: int) -> list[int | None]:
    """The micro-batch `stage` runs in each slot of `schedule` (None: it idles)."""
    return [dict(cells).get(stage) for cells in schedule]


# -------------------------------------------------------------------------- the micro-batches


def split_sequences(num_tokens: list[int], num_micro: int) -> list[tuple[int, int]]:
    """Cut a step's sequences (their token counts, in batch order) into min(num_micro, sequences)
    runs [first, last) of consecutive sequences, each run as near a share of the tokens as whole
    sequences allow: a prompt of 500 tokens and ten decodes make two micro-batches, the prompt and
    the decodes, not five sequences each."""
    n = len(num_tokens)
    m = min(num_micro, n)
    total, seen, bounds = sum(num_tokens), 0, [0]
    for i in range(1, n):
        cuts_left = m - len(bounds)  # cuts still to place
        if cuts_left == 0:
            break
        seen += num_tokens[i - 1]
        # Cut once the tokens so far reach the next share, or when every sequence left must start a run.
        if seen * m >= total * len(bounds) or n - i == cuts_left:
            bounds.append(i)
    return list(zip(bounds, bounds[1:] + [n]))


@dataclass
class MicroBatch:
    """A run of a step's sequences: its own step (rows numbered from 0), and the rows of it whose
    stream stage 0 needs back (sampled, or scored by prompt logprobs), in order."""

    step: StepInput
    start: int  # its first row among the step's packed tokens
    rows: list[int]


def micro_batches(step: StepInput, prompt_rows: list[tuple], num_micro: int) -> list[MicroBatch]:
    """`step` cut into micro-batches by `split_sequences`: every rank cuts the same step the same way."""
    qsl = step.query_start_loc
    wanted = sorted(set(step.sample_rows) | {r[0] for r in prompt_rows})
    parts = []
    for a, b in split_sequences([qsl[i + 1] - qsl[i] for i in range(step.num_seqs)], num_micro):
        t0, t1 = qsl[a], qsl[b]
        part = StepInput(step.input_ids[t0:t1], step.positions[t0:t1], step.slot_mapping[t0:t1],
                         [q - t0 for q in qsl[a : b + 1]], step.context_lens[a:b], step.block_tables[a:b],
                         step.table_ids[a:b], sample_rows=[r - t0 for r in step.sample_rows if t0 <= r < t1])
        parts.append(MicroBatch(part, t0, [r - t0 for r in wanted if t0 <= r < t1]))
    return parts


# ------------------------------------------------------------------------------ the transfers


class Boundary:
    """The sends and receives one rank posts between two time slots, posted as one group."""

    def __init__(self):
        self.ops: list[dist.P2POp] = []
        self.received: list[Received] = []

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self.ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer))

    def receive(self, shape: tuple[int, int], like: torch.Tensor, peer: int) -> Received:
        box = Received(like.new_empty(shape))
        self.ops.append(dist.P2POp(dist.irecv, box.tensor, peer))
        self.received.append(box)
        return box

    def post(self) -> list:
        """Post every transfer; returns the sends' handles (their tensors must live until they end)."""
        if not self.ops:
            return []
        works = dist.batch_isend_irecv(self.ops)
        if len(works) == 1 < len(self.ops):  # NCCL coalesces the group into one work, done when all its transfers are
            works = works * len(self.ops)
        assert len(works) == len(self.ops), f"{len(self.ops)} transfers posted, {len(works)} handles back"
        receives = iter(self.received)
        sends = []
        for op, work in zip(self.ops, works):
            if op.op is dist.irecv:
                next(receives).work = work
            else:
                sends.append((work, op.tensor))
        return sends


@dataclass
class Received:
    """A tensor on its way: `get` waits for it."""

    tensor: torch.Tensor
    work: object = None

    def get(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor


class StageClock:
    """Marks in time for the bubble: CUDA events on a GPU, where the work runs behind the host's
    back and is read once it is done; the host's clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def later(self, a, b):
        """The later of two marks (b may be None: a). Both must have happened (on a GPU: their
        events recorded and reached)."""
        if b is None:
            return a
        if not self.cuda:
            return max(a, b)
        return b if a.elapsed_time(b) > 0 else a

    def seconds(self, spans: list[tuple]) -> float:
        """The total length of (start, end) spans."""
        if not self.cuda:
            return sum(end - start for start, end in spans)
        if spans:
            spans[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in spans) / 1000


@dataclass
class Launched:
    """A step this stage has started (`PipelineRunner.start`) and not yet landed: what `land` needs."""

    step: StepInput
    prompt_rows: list[tuple]
    start: object  # the clock's mark at its start
    spans: list  # this stage's busy (start, end) marks for it
    timings: list[Received]  # on the driver: the other stages' busy time for it, on its way
    parts: list[MicroBatch]
    depth: int  # steps this stage had started and not landed when it started, itself included
    returned: list[Received] = None  # on stage 0: the rows the last stage sends back
    sends: list = None  # the handles of its sends


# --------------------------------------------------------------------------------- the runner


class PipelineRunner(ModelRunner):
    """`ModelRunner` for one stage (`model.stage`, set by `cut_stage`): the same KV pool (of the
    stage's layers), `execute` and prompt logprobs; `run` drives the micro-batches through the
    stages. On the driver it returns the logits, like `ModelRunner.run`; elsewhere, nothing."""

    def __init__(self, model, num_blocks: int, block_size: int, micro_batches: int | None = None,
                 cpu_group=None, **runner_args):
        super().__init__(model, num_blocks, block_size, **runner_args)
        self.stage = model.stage
        self.micro_batches = micro_batches or self.stage.num_stages  # default: P (the module's docstring)
        self.cpu_group = cpu_group  # gloo: each stage's busy time travels to the driver on it
        self.clock = StageClock(self.device)
        self.dtype = self.cache.dtype  # the model's (issue 33: an FP8 pool stores another)
        self.like = torch.empty(0, dtype=self.dtype, device=self.device)  # what the stages send: hidden states
        self.pending: list[Launched] = []  # steps started and not landed: the driver's `StepsInFlight`, or `follow`
        self.last_landed = None  # the clock's mark when the last step landed
        self.reset_bubble_stats()

    def reset_bubble_stats(self) -> None:
        """Start counting the bubble afresh (the driver keeps the counts)."""
        self.steps, self.wall_s, self.scheduled_idle_s = 0, 0.0, 0.0
        self.most_in_flight = 1
        self.busy_s = [0.0] * self.stage.num_stages

    @torch.no_grad()
    def run(self, step: StepInput, prompt_rows: list[tuple[int, int, int, int, int]],
            last_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """This stage's share of one step; on stage 0 the head too. Returns the logits of the
        sampled rows on stage 0 (every rank of its tensor-parallel group runs the head), else None."""
        return self.land(self.start(step, prompt_rows, last_tokens))

    @torch.no_grad()
    def start(self, step: StepInput, prompt_rows: list[tuple[int, int, int, int, int]],
              last_tokens: torch.Tensor | None = None) -> "Launched":
        """`run`'s first half: the stage's micro-batches through its layers, their transfers posted.
        On stage 0 nothing here waits for another stage, so the driver can start the next step (of
        other sequences) before this one comes back: steps in flight (nanoserve/engine/steps_in_flight.py)."""
        assert last_tokens is None and not step.from_last, "async scheduling is refused under pipeline parallelism"
        self.copy_blocks(step)  # the CPU tier: this stage's layers of the blocks
        launched = Launched(step, prompt_rows, self.clock.mark(), spans=[], timings=self.expect_timings(),
                            parts=micro_batches(step, prompt_rows, self.micro_batches), depth=len(self.pending) + 1)
        launched.returned, launched.sends = self.flow(launched.parts, launched.spans)
        return launched

    @torch.no_grad()
    def land(self, launched: "Launched") -> torch.Tensor | None:
        """`run`'s second half: wait for the step's transfers; on stage 0, the head over the rows the
        last stage sent back. Returns the logits of the sampled rows on stage 0, else None."""
        for work, _ in launched.sends:  # (the tensors stay referenced until their sends are done)
            work.wait()
        logits = None
        if self.stage.is_first:
            head_start = self.clock.mark()
            logits = self.head(launched.step, launched.prompt_rows, launched.parts,
                               [box.get() for box in launched.returned])
            launched.spans.append((head_start, self.clock.mark()))
        self.count_step(launched)
        return logits

    def follow(self, step: StepInput | None, prompt_rows: list[tuple], lands: int) -> None:
        """A worker's part of steps in flight, in the driver's order: on stage 0 (a tensor-parallel
        rank beside the driver, whose head needs this rank's collectives) land the `lands` oldest
        steps, then start `step` and keep it; on another stage, run `step` whole (`lands` is the
        driver's business: this stage's work on a step needs nothing after it)."""
        if not self.stage.is_first:
            if step is not None:
                self.run(step, prompt_rows)
            return
        for _ in range(lands):
            self.land(self.pending.pop(0))
        if step is not None:
            self.pending.append(self.start(step, prompt_rows))

    def flow(self, parts: list[MicroBatch], spans: list) -> tuple[list[Received], list]:
        """Run this stage's micro-batches in the schedule's slots, posting each boundary's transfers
        between slots. Returns, on stage 0, the receives of each micro-batch's rows the last stage
        sends back, and the sends' handles (`land` waits for both)."""
        st = self.stage
        schedule = pipeline_schedule(st.num_stages, len(parts))
        mine, last = stage_timeline(schedule, st.index), stage_timeline(schedule, st.num_stages - 1)
        inbox: dict[int, Received] = {}
        returned: list[Received] = []
        sends = []
        for t in range(len(schedule)):
            boundary, i = Boundary(), mine[t]
            if i is not None:
                begin = self.clock.mark()
                stream = self.compute(parts[i], None if st.is_first else inbox.pop(i).get())
                spans.append((begin, self.clock.mark()))
                self.send_on(boundary, parts[i], stream)
            upcoming = mine[t + 1] if t + 1 < len(mine) else None
            if not st.is_first and upcoming is not None:  # what this stage runs in the next slot
                shape = (len(parts[upcoming].step.input_ids), self.model.config.hidden_size)
                inbox[upcoming] = boundary.receive(shape, self.like, st.rank_of(st.index - 1))
            if st.is_first and last[t] is not None and parts[last[t]].rows:  # the last stage just finished it
                shape = (len(parts[last[t]].rows), self.model.config.hidden_size)
                returned.append(boundary.receive(shape, self.like, st.rank_of(st.num_stages - 1)))
            sends += boundary.post()
        return returned, sends

    def build_graphs(self, max_model_len: int, max_batch: int, **shapes) -> StageGraphs:
        """This stage's decode graphs (nanoserve/runner/stage_graphs.py). `shapes` is not used: no
        verification step comes (speculation is refused) and mixed steps run eagerly."""
        return StageGraphs(self.model, self.cache, self.scratch_block, max_model_len, max_batch,
                           self.context_class, fused=self.fused)

    def compute(self, part: MicroBatch, received: torch.Tensor | None) -> torch.Tensor:
        """One micro-batch through this stage's layers: its stream out, [T_i, hidden]. A decode
        micro-batch that fits a captured size replays this stage's graph; every stage decides the
        same, from the same micro-batch."""
        if self.graphs is not None and part.step.is_decode and self.graphs.fits(part.step.num_seqs):
            return self.graphs.run_stage(part.step, received)
        input_ids, positions, ctx = self.prepare(part.step)
        return stage_forward(self.model, input_ids if received is None else received, positions, ctx)

    def send_on(self, boundary: Boundary, part: MicroBatch, stream: torch.Tensor) -> None:
        """Queue a micro-batch's stream for the next stage; from the last stage, only its wanted rows,
        back to stage 0."""
        st = self.stage
        if not st.is_last:
            boundary.send(stream, st.rank_of(st.index + 1))
        elif part.rows:
            boundary.send(stream[torch.tensor(part.rows, device=self.device)], st.rank_of(0))

    def head(self, step: StepInput, prompt_rows: list[tuple], parts: list[MicroBatch],
             returned: list[torch.Tensor]) -> torch.Tensor:
        """Stage 0 after the flow: the final norm over the rows sent back, prompt logprobs from them,
        and the logits of the sampled rows, in `step.sample_rows`' order."""
        wanted = [p.start + r for p in parts for r in p.rows]  # the step's rows, in the order they came back
        at = {row: k for k, row in enumerate(wanted)}
        stream = torch.cat(returned) if returned else self.like.new_empty(0, self.model.config.hidden_size)
        hidden = final_hidden(self.model, stream)  # [len(wanted), hidden]
        self.keep_prompt_logprobs([(at[r[0]], *r[1:]) for r in prompt_rows], hidden)
        rows = torch.tensor([at[r] for r in step.sample_rows], dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])

    # -- the bubble, measured --------------------------------------------------------------------

    def expect_timings(self) -> list[Received]:
        """On the driver: the receives of every other stage's busy time for this step (posted
        first, so no stage waits on the driver to hand it over)."""
        if self.stage.index or self.stage.tp_rank or self.cpu_group is None:
            return []
        boxes = []
        for s in range(1, self.stage.num_stages):
            box = Received(torch.zeros(1, dtype=torch.float64))
            box.work = dist.irecv(box.tensor, self.stage.rank_of(s), group=self.cpu_group, tag=TIMING_TAG)
            boxes.append(box)
        return boxes

    def count_step(self, launched: Launched) -> None:
        """The step's busy time: stages other than 0 send theirs to the driver (their first
        tensor-parallel rank does), which adds them, its own and the step's wall time up. With
        steps in flight the steps overlap: a step's wall time runs from its start or the landing
        of the step before, whichever came later, so the walls add up to the time the pipeline ran."""
        busy = self.clock.seconds(launched.spans)
        st = self.stage
        if not st.is_first and st.tp_rank == 0 and self.cpu_group is not None:
            dist.send(torch.tensor([busy], dtype=torch.float64), st.rank_of(0), group=self.cpu_group, tag=TIMING_TAG)
        if not (st.is_first and st.tp_rank == 0):
            return
        end = self.clock.mark()
        wall = self.clock.seconds([(self.clock.later(launched.start, self.last_landed), end)])
        self.last_landed = end
        self.steps += 1
        self.wall_s += wall
        self.most_in_flight = max(self.most_in_flight, launched.depth)
        # The schedule's bubble: with d steps in flight the stages see a stream of d × M micro-batches.
        self.scheduled_idle_s += wall * bubble_fraction(st.num_stages, len(launched.parts) * launched.depth)
        self.busy_s[0] += busy
        for s, box in enumerate(launched.timings, start=1):
            self.busy_s[s] += float(box.get().item())

    # -- steps in flight, on the driver (nanoserve/engine/steps_in_flight.py) -----------------------

    def launch(self, batch) -> None:
        """Start `batch` on every stage (the workers told first) and keep it in `pending`; stage 0's
        part is queued without waiting for the other stages."""
        step = self.step_input(batch)  # (no adapters, no placeholders under a pipeline)
        prompt_rows = self.prompt_rows(batch, step)
        self.pending.append(self.workers.run_in_flight(self.start, step, prompt_rows, lands=0))

    def land_oldest(self) -> torch.Tensor:
        """Land the oldest step in `pending` (tensor-parallel ranks of stage 0 told first): its logits."""
        if self.stage.tp_size > 1:  # they run the head's collectives with the driver: they land it now too
            self.workers.run_in_flight(None, None, [], lands=1)
        return self.workers.guard(self.land, self.pending.pop(0))

    def bubble_stats(self) -> dict:
        """What the stages did since the last reset (on the driver): steps, wall seconds, each
        stage's busy seconds and idle fraction (1 - busy / wall: its bubble, plus whatever waiting
        on the links cost), their mean, and the bubble the schedule alone predicts,
        (P - 1) / (M + P - 1), averaged over the steps by their wall time."""
        idle = [1 - b / self.wall_s if self.wall_s else 0.0 for b in self.busy_s]
        return dict(steps=self.steps, wall_s=self.wall_s, busy_s=list(self.busy_s), idle_fraction=idle,
                    mean_idle_fraction=sum(idle) / len(idle),
                    scheduled_idle_fraction=self.scheduled_idle_s / self.wall_s if self.wall_s else 0.0,
                    num_stages=self.stage.num_stages, micro_batches=self.micro_batches,
                    steps_in_flight=self.most_in_flight)

    def measure_forward(self, step: StepInput) -> None:
        """`measure_step_memory`'s forward pass for one stage alone: its layers over the largest step
        (stage 0: from the embedding, and the head over the sampled rows; elsewhere from a stream
        of zeros). Nothing crosses a link: every stage measures its own peak."""
        input_ids, positions, ctx = self.prepare(step)
        inputs = input_ids if self.stage.is_first else \
            self.like.new_zeros(len(step.input_ids), self.model.config.hidden_size)
        stream = stage_forward(self.model, inputs, positions, ctx)
        if self.stage.is_first:
            rows = torch.tensor(step.sample_rows, device=self.device)
            self.model.compute_logits(final_hidden(self.model, stream[rows]))
