"""A sequence (one request's tokens and state) and a batch (who runs this step, with how many tokens)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

from nanoserve.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, no KV blocks
    RUNNING = "running"  # holds blocks, runs every step
    PREEMPTED = "preempted"  # lost its blocks to make room; goes back to the front of the queue
    FINISHED = "finished"  # done: blocks returned


PENDING = -1  # async scheduling: the place of a token sampled on the GPU that the host has not seen yet


class StopChecker(Protocol):
    """What a sequence's text looks like is the engine's business (it owns the tokenizer). It
    hands the scheduler this hook, called with every token appended (stop tokens excepted);
    True means the text now holds one of the request's stop strings."""

    def __call__(self, token: int) -> bool:
        ...


_ids = itertools.count()


@dataclass
class Sequence:
    """One request's tokens and state, from arrival to its last token.

    `token_ids` is the one list of the sequence's tokens: the prompt, then every token it
    produced. The first `num_computed` of them have their K/V in the cache.
    """

    token_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()  # EOS and the request's stop tokens
    stop_checker: StopChecker | None = None  # stop strings: see StopChecker
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    block_table: list[int] = field(default_factory=list)
    block_table_version: int = 0  # bumped when the table is given back: until then it only grows
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_hashes: list[bytes] = field(default_factory=list)  # week 14: names of its first full blocks
    priority: int = 0  # the "priority" scheduling policy: lower runs first
    steps_waiting: int = 0  # steps spent in the queue so far (priority scheduling ages it)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None  # when it first got KV blocks (its queue time ends)
    token_times: list[float] = field(default_factory=list)  # when each output token came out
    num_preemptions: int = 0
    num_pending: int = 0  # async scheduling: trailing placeholders (PENDING) for tokens still on the GPU
    keep_kv: bool = False  # issue 35, on a prefill instance: its blocks outlive it until their KV is sent
    lora_id: int = 0  # week 23: the adapter it runs under (the engine's id for it), 0 for the base model
    # Issue 38, held KV (nanoserve/scheduler/held.py): keep its blocks when it ends normally; the blocks
    # of a held entry it resumes from, until its admission, and how many tokens they hold; what came of
    # the resume ("resumed", "evicted", "mismatch"; None: not asked); the prompt tokens it did not
    # prefill at its first admission, from held KV, and from held KV or the prefix cache.
    hold_kv: bool = False
    resume_blocks: list[int] | None = None
    resume_len: int = 0
    resume_outcome: str | None = None
    num_resumed: int = 0
    num_cached_tokens: int = 0
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.prompt_len = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens together."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_ids(self) -> list[int]:
        """The tokens it produced (not the placeholders of tokens still on the GPU)."""
        return self.token_ids[self.prompt_len : len(self.token_ids) - self.num_pending]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first output token, in seconds."""
        return None if not self.token_times else self.token_times[0] - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive output tokens, in seconds."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def cache_salt(self) -> bytes | None:
        """Week 23: what seeds its prefix cache's hash chain: under an adapter the same tokens have other
        K/V, so its blocks must never be found by the base model's prompts or another adapter's."""
        return f"lora:{self.lora_id}".encode() if self.lora_id else None

    def ended_by(self, token: int, num_tokens: int, max_model_len: int) -> str | None:
        """Why `token`, the sequence's `num_tokens`-th, ends it ("stop" or "length"), or None."""
        if token in self.stop_ids:
            return "stop"
        if self.stop_checker is not None and self.stop_checker(token):
            return "stop"
        if num_tokens - self.prompt_len >= self.params.max_tokens or num_tokens >= max_model_len:
            return "length"
        return None

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold: prompt + max_tokens."""
        return self.prompt_len + self.params.max_tokens


@dataclass
class Batch:
    """One step's work. For sequence i: run its tokens num_computed .. num_computed + n_i - 1
    through the model (n_i = num_new_tokens[i]), then sample `num_samples[i]` tokens from the
    logits of its last `num_samples[i]` positions (1 after a whole prompt or a decode; 0 after a
    prompt chunk that is not the last; k + 1 to verify k speculated tokens)."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_samples: list[int] = field(default_factory=list)  # default: 1 per sequence

    def __post_init__(self) -> None:
        if not self.num_samples:
            self.num_samples = [1] * len(self.seqs)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens through the model this step, all sequences together."""
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    # Issue 35, the CPU tier behind the prefix cache (nanoserve/scheduler/cpu_tier.py): block copies
    # to run before the forward pass, offloads (GPU block, CPU slot) first, then reloads (CPU slot, GPU block).
    offloads: list[tuple[int, int]] = field(default_factory=list)
    reloads: list[tuple[int, int]] = field(default_factory=list)
