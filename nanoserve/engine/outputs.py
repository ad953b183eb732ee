"""What a request gets back, and the engine's side that builds it: `RequestOutput` and
`RequestMetrics`, each request's text and logprob state (`_Request`), and the `OutputProcessor`,
which turns a step's tokens into outputs (detokenizing, stop strings, held-back text, logprobs)."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from nanoserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from nanoserve.runner.runner import ModelRunner
from nanoserve.sampling.grammar import TokenConstraint
from nanoserve.sampling.sampler import Sampler, TokenLogprob
from nanoserve.scheduler.sequence import Batch, Sequence


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
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    delta: str = ""  # the text this step added (for streaming)
    metrics: RequestMetrics | None = None  # on the finished output only
    # Logprobs (week 10), when the request asks (SamplingParams.logprobs, .prompt_logprobs):
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids
    delta_logprobs: list[TokenLogprob] | None = None  # those of the tokens whose text `delta` completes
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token (the first: logprob None)
    # Issue 35, disaggregated serving: on a prefill instance, what the decode instance needs (a
    # `KVTransfer`'s dict); on a decode instance, the first output's transfer (num_bytes, seconds).
    kv_transfer: dict | None = None
    error: Exception | None = None  # finish reason "error": why (a KV transfer that failed)
    stop_string: str | None = None  # finish reason "stop" at one of the request's stop strings: which (issue 38)
    # Issue 38, held KV (Engine.add_request's hold_kv and resume_from): the prompt tokens not prefilled
    # (found in held KV or the prefix cache) and those of them from held KV; what came of resume_from
    # ("resumed", "evicted": the entry was gone, "mismatch": nothing reusable; None: not asked); on the
    # finished output, the blocks now held under this request's id (0: nothing held).
    num_cached_tokens: int = 0
    num_resumed_tokens: int = 0
    resume_outcome: str | None = None
    num_held_blocks: int = 0


@dataclass
class _Request:
    """A request's text: the detokenizer, the stop strings, what was already delivered."""

    detok: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters of `text` already delivered as deltas
    stop: list[str] = field(default_factory=list)
    stream: bool = True  # False: no output until the end, and the text is decoded once
    cut: bool = False  # the text was cut at a stop string
    stop_string: str | None = None  # the one it was cut at (issue 38: Anthropic's `stop_sequence`)
    # Logprobs (week 10): those of the output tokens so far (None: not asked), how many of them were
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
        return self.stop_at_string()

    def stop_at_string(self) -> bool:
        """`cut_at_stop_string`, and the stop string it cut at remembered (`stop_string`)."""
        full = self.text
        cut = self.cut_at_stop_string()
        if cut and self.stop_string is None:
            self.stop_string = next((s for s in self.stop if full.startswith(s, len(self.text))), None)
        return cut

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


class OutputProcessor:
    """The engine's text side. Per request: the detokenizer, the stop strings, the text and the
    logprobs not yet delivered (a `_Request`). Per step: a `RequestOutput` for each sequence
    that got tokens. The scheduler appends the tokens and runs the stop checks; this turns them
    into what a caller reads."""

    def __init__(self, tokenizer: Tokenizer, sampler: Sampler, runner: ModelRunner):
        self.tokenizer = tokenizer
        self.sampler = sampler  # keeps the sampled tokens' logprobs until they are delivered
        self.runner = runner  # keeps the prompt logprobs
        self.requests: dict[int, _Request] = {}  # request id (its sequence's seq_id) -> its text

    def add(self, seq: Sequence, stream: bool, constraint: TokenConstraint | None = None) -> None:
        """Follow a new request, and give its sequence the stop checker the scheduler calls with
        every token: the request's stop strings and, with structured output, its grammar, which
        also ends it. A request that is not streamed and has no stop strings gets no checker:
        its text is decoded once, at the end."""
        params = seq.params
        req = _Request(IncrementalDetokenizer(self.tokenizer), stop=params.stop, stream=stream or bool(params.stop))
        if params.logprobs is not None:
            req.logprobs = []
        stop_checker = req.add_token if req.stream else None
        if constraint is not None:  # structured output: the grammar also ends the request
            stop_checker = _with_grammar(stop_checker, constraint)
        seq.stop_checker = stop_checker
        self.requests[seq.seq_id] = req

    def outputs(self, batch: Batch, new_tokens: list[list[int]]) -> list[RequestOutput]:
        """The outputs of a step whose tokens the host has (`new_tokens[i]` for `batch.seqs[i]`),
        in batch order: one for each sequence that got tokens and has an output."""
        return [self.process(seq) for seq, tokens in zip(batch.seqs, new_tokens) if tokens and self.has_output(seq)]

    def has_output(self, seq: Sequence) -> bool:
        """Whether the sequence's request gets an output now: it is still in, and streamed or done."""
        req = self.requests.get(seq.seq_id)  # None: aborted meanwhile
        return req is not None and (req.stream or seq.is_finished)

    def process(self, seq: Sequence) -> RequestOutput:
        """Build the request's output: its text so far, and the part of it not yet delivered."""
        req = self.requests[seq.seq_id]
        if seq.is_finished:
            if not req.stream:  # offline, no stop strings: decode the whole output once, at the end
                output = seq.output_ids
                stopped_by_token = seq.finish_reason == "stop" and output and output[-1] in seq.stop_ids
                req.text = self.tokenizer.decode(output[:-1] if stopped_by_token else output)
            elif not req.cut:  # a character still held back by the detokenizer, and its stop strings
                req.text += req.detok.flush()
                if req.stop_at_string():
                    seq.finish_reason = "stop"  # even if the same token hit max_tokens
        # Deliver text that can no longer turn out to be the start of a stop string.
        end = len(req.text) if seq.is_finished else len(req.text) - _held_back(req.text, req.stop)
        delta, req.emitted = req.text[req.emitted : max(end, req.emitted)], max(end, req.emitted)
        logprobs, delta_logprobs, prompt_logprobs = self._take_logprobs(seq, req)
        if seq.is_finished:
            del self.requests[seq.seq_id]
        return RequestOutput(request_id=seq.seq_id, prompt_token_ids=seq.prompt_ids, token_ids=seq.output_ids,
                             text=req.text, finished=seq.is_finished, finish_reason=seq.finish_reason, delta=delta,
                             metrics=RequestMetrics.of(seq) if seq.is_finished else None, logprobs=logprobs,
                             delta_logprobs=delta_logprobs, prompt_logprobs=prompt_logprobs,
                             stop_string=req.stop_string if seq.is_finished else None,
                             num_cached_tokens=seq.num_cached_tokens, num_resumed_tokens=seq.num_resumed,
                             resume_outcome=seq.resume_outcome)

    def abort(self, seq: Sequence) -> RequestOutput | None:
        """The final output of a request the scheduler has just finished with "abort" (None if it
        had already finished)."""
        req = self.requests.pop(seq.seq_id, None)
        if req is None:
            return None
        return RequestOutput(request_id=seq.seq_id, prompt_token_ids=seq.prompt_ids, token_ids=seq.output_ids,
                             text=req.text, finished=True, finish_reason="abort", metrics=RequestMetrics.of(seq),
                             num_cached_tokens=seq.num_cached_tokens, num_resumed_tokens=seq.num_resumed,
                             resume_outcome=seq.resume_outcome)

    def _take_logprobs(self, seq: Sequence, req: _Request) -> tuple:
        """Logprobs, for a request that asked: (all output logprobs so far, those `delta`
        delivers, the prompt's), else Nones. A token goes out with the delta that completes its text
        (`req.ends`): one whose text is held back (a possible stop string, half a character, a
        special token with no text) waits for it, and at the end every token goes out, the stop
        token and any past a stop string included. So the deltas' logprobs add up to `logprobs`."""
        if seq.params.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = self.runner.take_prompt_logprobs(seq)  # its prompt has run: it sampled
        if req.logprobs is None:
            return None, None, req.prompt_logprobs
        delivered = len(seq.token_ids) - seq.num_pending - seq.prompt_len  # (not those still on the GPU)
        req.logprobs += self.sampler.take_logprobs(seq.seq_id, delivered - len(req.logprobs))
        covered = len(req.logprobs) if seq.is_finished else bisect.bisect_right(req.ends, req.emitted)
        delta, req.num_delivered = req.logprobs[req.num_delivered : covered], max(covered, req.num_delivered)
        return list(req.logprobs), delta, req.prompt_logprobs
