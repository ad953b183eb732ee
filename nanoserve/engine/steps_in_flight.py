"""Week 20: several engine steps in flight through the stages of a pipeline.

One step at a time through P stages keeps each stage busy 1/P of the time: stage 1 waits while
stage 0 runs the step, then stage 0 waits while stage 1 does. Micro-batches (nanoserve/runner/
pipeline.py) cut *one* step into M pieces that follow each other through the stages, idling each
stage (P - 1) / (M + P - 1) of the step; but in a decode step each piece re-reads the stage's
weights, which costs a memory-bound GPU about as much as the whole step, so the step gets no
shorter (week 20's lesson, section 9). Steps in flight fill the stages with *other steps* instead:

    time       t0        t1        t2        t3                 P = 2 stages, lanes A and B
    stage 0    step 0/A  step 1/B  step 2/A  step 3/B
    stage 1    .         step 0/A  step 1/B  step 2/A
    driver     .         .         lands 0   lands 1    (head + sampling on stage 0, then schedules A again)

Each stage reads its half of the weights once per step and every stage works on some step all the
time: in a steady stream the bubble is gone (only the first P - 1 slots, and the last, are idle),
and each step still decodes a whole lane in one pass over the weights.

The engine's turn with D steps in flight (D = L lanes, nanoserve/scheduler/lanes.py):

    lane = k mod D
    while lane has a step in flight: land the oldest step   # its tokens: sampled, scheduler.update
    batch = schedule(lane)                                  # only that lane's sequences, plus admissions
    if batch: launch it (stage 0 runs its layers, sends on; nobody waits)
    else: land the oldest step, if any                      # draining: the lane is empty

A step lands on the driver when its rows come back from the last stage: stage 0 runs the final
norm and lm_head over them, the sampler picks the tokens, and `Scheduler.update` appends them,
checks stops and frees what finished, as in a step without a pipeline. So the tokens and their
order per request are exactly those of one step at a time: each sequence runs the same steps,
only interleaved with another lane's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from nanoserve.scheduler.lanes import Lanes
from nanoserve.scheduler.sequence import Batch


@dataclass
class Flight:
    """A launched step: its batch and its lane (the runner keeps its tensors, in the same order)."""

    batch: Batch
    lane: int


class StepsInFlight:
    """The driver's steps in flight: lanes over the scheduler, and the steps launched and not landed."""

    def __init__(self, scheduler, runner, depth: int):
        self.scheduler, self.runner = scheduler, runner
        self.lanes = Lanes(scheduler, depth)
        self.flights: deque[Flight] = deque()
        self.turn = 0  # the next step's number: its lane is turn mod depth

    @property
    def busy(self) -> bool:
        """Whether a step is in flight."""
        return bool(self.flights)

    def step(self, sample: Callable[[torch.Tensor, Batch], list[list[int]]]
             ) -> tuple[Batch, list[tuple[Batch, list[list[int]]]]]:
        """One turn (the module's docstring): returns the batch launched (maybe empty) and the steps
        landed meanwhile, each as its batch and each sequence's new tokens. `sample(logits, batch)`
        picks the tokens (`Engine.sample`)."""
        lane = self.turn % self.lanes.num_lanes
        self.turn += 1
        done = []
        while lane in self.lanes.in_flight:
            done.append(self.land(sample))
        batch = self.lanes.schedule(lane)
        if batch.seqs:
            self.runner.launch(batch)
            self.flights.append(Flight(batch, lane))
            self.lanes.launched(lane)
        elif self.flights:
            done.append(self.land(sample))
        return batch, done

    def land(self, sample) -> tuple[Batch, list[list[int]]]:
        """Land the oldest step: its logits from the runner, its tokens sampled and handed to the
        scheduler. A sequence aborted while it was in flight gets none (nor samples: its sampler
        state is gone)."""
        flight = self.flights.popleft()
        self.lanes.landed(flight.lane)
        logits = self.runner.land_oldest()
        batch = flight.batch
        live, rows, first = [], [], 0
        for i, (seq, k) in enumerate(zip(batch.seqs, batch.num_samples)):
            if not seq.is_finished:
                live.append(i)
                rows += range(first, first + k)
            first += k
        alive = Batch([batch.seqs[i] for i in live], [batch.num_new_tokens[i] for i in live],
                      [batch.num_samples[i] for i in live])
        sampled = sample(logits[torch.tensor(rows, dtype=torch.long, device=logits.device)], alive)
        tokens = [[] for _ in batch.seqs]
        for i, t in zip(live, sampled):
            tokens[i] = t
        self.scheduler.update(batch, tokens)
        return batch, tokens

    def abandon(self) -> None:
        """At close: wait for the steps in flight (their transfers end before the group does),
        dropping their tokens."""
        while self.flights:
            self.lanes.landed(self.flights.popleft().lane)
            self.runner.land_oldest()
