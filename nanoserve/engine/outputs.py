"""What a request gets back: its outputs, metrics, and the per-request text and logprob state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nanoserve.engine.tokenizer import IncrementalDetokenizer
from nanoserve.sampling.grammar import TokenConstraint
from nanoserve.sampling.sampler import TokenLogprob
from nanoserve.scheduler.sequence import Sequence


@dataclass
class RequestMetrics:
    """A finished request's timeline (`time.perf_counter` seconds) and sizes: what week 16's
    metrics and request logs are made of."""

    arrival_time: float
    first_scheduled_time: float | None  # None: it never got KV blocks (aborted in the queue)
    token_times: list[float]  # when each output token came out
    finished_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        return cls(seq.arrival_time, seq.first_scheduled_time, list(seq.token_times), time.perf_counter(),
                   seq.prompt_len, seq.num_output_tokens, seq.num_preemptions)


@dataclass
class RequestOutput:
    """What a request produced so far (`finished` tells whether that is all)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    delta: str = ""  # the text this step added (for streaming)
    metrics: RequestMetrics | None = None  # on the finished output only
    # Issue 17, when the request asks (SamplingParams.logprobs, .prompt_logprobs):
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids
    delta_logprobs: list[TokenLogprob] | None = None  # those of the tokens whose text `delta` completes
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token (the first: logprob None)


@dataclass
class _Request:
    """A request's text: the detokenizer, the stop strings, what was already delivered."""

    detok: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters of `text` already delivered as deltas
    stop: list[str] = field(default_factory=list)
    stream: bool = True  # False: no output until the end, and the text is decoded once
    cut: bool = False  # the text was cut at a stop string
    # Issue 17: the logprobs of the output tokens so far (None: not asked), how many of them were
    # delivered, and, per token given to add_token, the length of `text` once its text is there.
    logprobs: list[TokenLogprob] | None = None
    num_delivered: int = 0
    ends: list[int] = field(default_factory=list)
    num_added: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None

    def add_token(self, token: int) -> bool:
        """The sequence's stop checker: decode one more token, True once a stop string appeared."""
        piece = self.detok.add(token)
        self.text += piece
        self.num_added += 1
        if piece:  # this token's text is here, and that of the tokens before it that had none yet
            self.ends += [len(self.text)] * (self.num_added - len(self.ends))
        return self.cut_at_stop_string()

    def cut_at_stop_string(self) -> bool:
        """Cut the text before the earliest stop string in it, if any; True if it did."""
        # >>> week05: stop-strings
        found = [i for i in (self.text.find(s, self.emitted) for s in self.stop) if i != -1]
        if found:  # the stop string is not part of the output
            self.text = self.text[: min(found)]
            self.cut = True
        return bool(found)
        # <<< week05: stop-strings


def _with_grammar(stop_checker, constraint: TokenConstraint):
    """A sequence's stop check that also feeds its grammar each token appended: it stops on a
    stop string, or once the grammar is complete."""

    def check(token: int) -> bool:
        stopped = stop_checker(token) if stop_checker is not None else False
        return constraint.consume(token) or stopped  # consume first: every token goes to the grammar

    return check


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest

