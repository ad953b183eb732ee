"""Week 20: lanes, the running sequences split so that several steps can be in flight at once.

With P pipeline stages, one step at a time leaves P - 1 stages idle while the step is elsewhere.
Steps in flight (nanoserve/engine/steps_in_flight.py) fix that by giving every stage a step of its
own: while stage 1 runs step N, stage 0 runs step N + 1. Step N + 1 must then not need step N's
tokens, so it holds *other* sequences. Lanes make that a rule: the running sequences are split
into L disjoint lanes, and step k schedules lane k mod L only, by the ordinary policies
(continuous batching, chunked prefill, preemption), which see that lane's sequences as the whole
running set:

    step      0    1    2    3    4   ...          L = 2
    lane      0    1    0    1    0
                        ^ lane 0 again: step 0 has landed (its tokens are on the host)

So a sequence is in one lane, and is never scheduled while a step of it is in flight; its tokens
come back before its lane's next turn, and the scheduler updates it as it would without lanes
(no placeholders, stop checks as usual).

Admission: a waiting request joins the lane being scheduled (the only one whose sequences are not
in flight) while that lane holds fewer than its share, ceil(sequences / L), where sequences
counts the running and the waiting, up to max_num_seqs. Five requests over two lanes: three in
lane 0, at step 0, and two in lane 1, at step 1. A lane that shrank (its sequences finished) is
filled first, the next time its turn comes.

Preemption stays inside the lane: only its sequences are visible, so only they can be preempted.
A sequence of another lane has a step in flight whose writes into its blocks are under way: its
blocks must not change hands. A preempted sequence leaves its lane; when it is admitted again,
it joins whichever lane admits it.

The KV pool is shared: a lane's sequences hold their own blocks (disjoint, as every sequence's
are), and an abort frees a sequence's blocks at once even with a step of it in flight. That is
safe because every stage runs the steps in the order they were launched: the step in flight writes
into the freed blocks before any later step of the block's next owner, which reads only the slots
it wrote itself (a block is named for the prefix cache only once the step that filled it landed).
"""

from __future__ import annotations

from nanoserve.scheduler.sequence import Batch, Sequence


class Lanes:
    """The lanes over a `Scheduler`'s running sequences, and which of them has a step in flight."""

    def __init__(self, scheduler, num_lanes: int):
        self.scheduler = scheduler
        self.num_lanes = num_lanes
        self.lane_of: dict[int, int] = {}  # sequence id -> its lane, for the running sequences
        self.in_flight: list[int] = []  # lanes whose step is launched and not landed, oldest first

    def members(self, lane: int) -> list[Sequence]:
        """The running sequences of `lane`, in admission order."""
        return [s for s in self.scheduler.running if self.lane_of.get(s.seq_id) == lane]

    def share(self, lane: int) -> int:
        """How many sequences `lane` may hold after admitting: its share of the running and waiting
        sequences (rounded up), never past max_num_seqs over all lanes."""
        s = self.scheduler
        running = len(s.running)
        wanted = min(s.max_num_seqs, running + len(s.waiting))
        others = running - len(self.members(lane))
        return max(0, min(-(-wanted // self.num_lanes), s.max_num_seqs - others))

    def schedule(self, lane: int) -> Batch:
        """Lane `lane`'s batch for this step, chosen by the scheduler's policy over that lane's
        sequences as if they were all that runs; the sequences it admits join the lane."""
        assert lane not in self.in_flight, f"lane {lane} is scheduled while its last step is in flight"
        s = self.scheduler
        self.lane_of = {x.seq_id: self.lane_of[x.seq_id] for x in s.running if x.seq_id in self.lane_of}
        mine = self.members(lane)
        others = [x for x in s.running if self.lane_of.get(x.seq_id) != lane]
        limit, cap = s.max_num_seqs, self.share(lane)
        s.running, s.max_num_seqs = mine, cap
        try:
            batch = s.schedule()
        finally:
            mine, s.running, s.max_num_seqs = s.running, others, limit
            s.running += mine  # (the policies may have preempted some of them, and admitted others)
        for x in mine:
            self.lane_of[x.seq_id] = lane
        return batch

    def launched(self, lane: int) -> None:
        self.in_flight.append(lane)

    def landed(self, lane: int) -> None:
        self.in_flight.remove(lane)

    def check(self, batch: Batch, lane: int) -> None:
        """The invariants (for tests): the batch is lane `lane`'s, and no sequence of it is in another lane."""
        for seq in batch.seqs:
            assert self.lane_of.get(seq.seq_id) == lane, f"sequence {seq.seq_id} ran in lane {lane}, not its own"
