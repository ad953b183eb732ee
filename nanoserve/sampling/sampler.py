"""Week 3: turning logits into tokens, with every request's own settings.

A batch holds sequences from different requests, and each request brings its own
`SamplingParams`. The sampler works on the whole `[num_seqs, vocab]` block of logits at once,
with the per-row settings as columns of tensors, in the order HuggingFace applies them:

    repetition penalty -> temperature -> top-k -> top-p -> softmax -> draw

Temperature 0 means greedy. A request with a `seed` draws from its own random generator, so it
gets the same tokens on every run, whatever else shares its batch.

The wider OpenAI surface (week 10) adds two edits in front of that chain, both additive (so
their order does not matter): `logit_bias` (added to the listed tokens' logits, as HF's
`SequenceBiasLogitsProcessor` does before its repetition penalty) and OpenAI's presence and
frequency penalties (over the tokens the request generated, not its prompt):

    logit bias, presence/frequency penalties -> repetition penalty -> temperature -> top-k -> top-p

Logprobs, when a request asks for them, are read before all of it: `log_softmax` of the raw
float32 logits, the model's own distribution whatever the request's sampling settings.

Structured output (week 10, `nanoserve/sampling/grammar.py`) goes first of all: a constrained row's
logits are -inf for every token its grammar does not allow next, so no later edit can bring one
back (they all keep -inf at -inf) and the draw never picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.sampling.grammar import (
    TokenConstraint,
    apply_token_bitmasks,
    token_bitmasks,
)
from nanoserve.sampling.params import SEED_MAX, SEED_MIN, SamplingParams  # noqa: F401 (SEED_*: re-exported)


@dataclass
class TokenLogprob:
    """One position's log-probabilities (logprobs, week 10): the token there, its logprob, and the most
    likely tokens at that position with theirs, most likely first. Plain host data. (The first
    token of a prompt has logprob None and no alternatives: nothing predicts it.)"""

    token: int
    logprob: float | None
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor | list[int],
                   num_top: list[int]) -> list[TokenLogprob]:
    """log_softmax of each row of raw logits [N, V], in float32: the logprob of token_ids[i] in
    row i, and the num_top[i] most likely tokens of that row with theirs."""
    logp = logits.float().log_softmax(dim=-1)  # [N, V]
    ids = torch.as_tensor(token_ids, device=logp.device)[:, None]  # [N, 1]
    top, top_ids = logp.topk(min(max(num_top, default=0), logp.shape[-1]), dim=-1)  # [N, k], most likely first
    # One device->host copy for everything; token ids are exact as float64 (< 2**53).
    table = torch.cat([ids.double(), logp.gather(1, ids).double(), top.double(), top_ids.double()], dim=1).tolist()
    k = top.shape[1]
    return [TokenLogprob(int(row[0]), row[1], [(int(t), lp) for t, lp in zip(row[2 + k : 2 + k + n], row[2 : 2 + n])])
            for row, n in zip(table, num_top)]


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float]]) -> torch.Tensor:
    """Add each row's `logit_bias` to its tokens' logits. logits [N, V]; biases[i] maps token ids
    to the numbers added in row i. (OpenAI's scale: -100 all but bans a token, +100 all but forces it.)"""
    device = logits.device
    rows = torch.tensor([i for i, bias in enumerate(biases) for _ in bias], dtype=torch.long, device=device)
    cols = torch.tensor([t for bias in biases for t in bias], dtype=torch.long, device=device)
    values = torch.tensor([v for bias in biases for v in bias.values()], dtype=logits.dtype, device=device)
    return logits.index_put((rows, cols), values, accumulate=True)  # a new tensor: the raw logits stay


def apply_presence_frequency_penalties(logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                                       generated: list[list[int]]) -> torch.Tensor:
    """OpenAI's penalties, over the tokens each row has generated so far (its output, not its prompt):

        logit[t] -= frequency * count[t] + presence * (count[t] > 0)

    logits [N, V]; presence, frequency [N]; generated[i] lists row i's output token ids. Unlike the
    repetition penalty, they subtract (the same for positive and negative logits), and the
    frequency penalty grows with every repetition.
    """
    N, V = logits.shape
    rows = torch.tensor([i for i, ids in enumerate(generated) for _ in ids], dtype=torch.long, device=logits.device)
    cols = torch.tensor([t for ids in generated for t in ids], dtype=torch.long, device=logits.device)
    counts = torch.zeros(N, V, device=logits.device).index_put(
        (rows, cols), torch.ones(len(cols), device=logits.device), accumulate=True)  # [N, V]
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def apply_repetition_penalty(logits: torch.Tensor, penalties: torch.Tensor,
                             seen: list[list[int]]) -> torch.Tensor:
    """Scale down the logits of every token already seen by a row.

    logits [N, V]; penalties [N]; seen[i] is row i's prompt + output token ids. Positive logits
    are divided by the penalty and negative ones multiplied, so the token always becomes less
    likely (the CTRL paper's rule, as HuggingFace implements it).
    """
    # >>> week03: repetition-penalty
    N, V = logits.shape
    mask = torch.zeros(N, V, dtype=torch.bool, device=logits.device)
    for i, ids in enumerate(seen):
        if ids and penalties[i] != 1.0:
            mask[i, torch.tensor(ids, device=logits.device)] = True
    p = penalties[:, None].to(logits.dtype)  # [N, 1]
    penalized = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(mask, penalized, logits)
    # <<< week03: repetition-penalty


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside its row's top-k and top-p sets.

    logits [N, V] (already divided by temperature); top_k [N] (0 = off); top_p [N] (1 = off).
    """
    # >>> week03: top-k-top-p
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V], most likely first
    V = logits.shape[-1]
    rank = torch.arange(V, device=logits.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, V)[:, None]  # [N, 1]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    # top-p on what top-k left: keep a token if the tokens ranked above it hold < top_p.
    probs = sorted_logits.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs  # [N, V]
    sorted_logits = sorted_logits.masked_fill(mass_above >= top_p[:, None], float("-inf"))
    # Undo the sort: put each filtered logit back in its vocabulary slot.
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    # <<< week03: top-k-top-p


def filtered_logits(logits: torch.Tensor, params: list[SamplingParams],
                    seen: list[list[int]] | None = None, generated: list[list[int]] | None = None) -> torch.Tensor:
    """Everything but the draw: bias, penalties, temperature, top-k, top-p. Greedy rows are only
    biased and penalized. `seen[i]`: row i's prompt and output tokens (the repetition penalty);
    `generated[i]`: its output tokens only (presence and frequency penalties).

    Which steps a batch needs is decided from `params`, on the host: asking the GPU ("does any
    row have a penalty?") would make the host wait for it.
    """
    device = logits.device
    logits = logits.float()
    if any(p.logit_bias for p in params):
        logits = apply_logit_bias(logits, [p.logit_bias for p in params])
    if generated is not None and any(p.presence_penalty or p.frequency_penalty for p in params):
        presence = torch.tensor([p.presence_penalty for p in params], device=device)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
        logits = apply_presence_frequency_penalties(logits, presence, frequency, generated)
    if seen is not None and any(p.repetition_penalty != 1.0 for p in params):
        penalties = torch.tensor([p.repetition_penalty for p in params], device=device)
        logits = apply_repetition_penalty(logits, penalties, seen)
    if any(p.temperature not in (0.0, 1.0) for p in params):
        # Greedy rows get temperature 1 here: only their argmax matters.
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
        logits = logits / temps[:, None]
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None] | None = None,
           seen: list[list[int]] | None = None, generated: list[list[int]] | None = None) -> torch.Tensor:
    """Draw one token per row. logits [N, V] -> token ids [N] (int64, on logits' device).

    `generators[i]`, when given, is row i's private generator (seeded requests); other rows
    share the global one. `seen[i]` lists row i's tokens so far, for the repetition penalty;
    `generated[i]` its output tokens, for the presence and frequency penalties.
    """
    # >>> week03: sample
    logits = filtered_logits(logits, params, seen, generated)
    if all(p.greedy for p in params):  # decided on the host: no waiting for the GPU
        return logits.argmax(dim=-1)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    probs = logits.softmax(dim=-1)  # [N, V]
    # Draw by "exponential race": argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability
    # p_i. Each row's noise can come from its own generator, so a seeded row is reproducible.
    noise = torch.empty_like(probs).exponential_()
    for i, g in enumerate(generators or []):
        if g is not None:
            noise[i].exponential_(generator=g)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # an exact 0 would divide by zero
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)
    # <<< week03: sample


class Sampler:
    """The engine's sampler: `sample` for a batch, plus what it keeps per sequence (here, with the
    tensors, so that the scheduler's sequences hold none): each seeded request's private
    generator, and (the OpenAI fields) where the output of a sequence with presence or frequency penalties
    starts, and the logprobs of the tokens it sampled for the sequences that ask, until the
    engine takes them (`take_logprobs`); and the grammar constraint of a request asking for
    structured output, whose mask it applies before drawing (the sequence's stop check feeds
    the constraint the tokens drawn: `Engine.add_request`)."""

    def __init__(self, device: torch.device | str, one_pass_argmax: bool = False):
        self.device = device
        self.one_pass_argmax = one_pass_argmax  # issue 39: off with --no-fused-kernels (two kernels then)
        self.generators: dict[int, torch.Generator] = {}
        self.prompt_lens: dict[int, int] = {}  # sequences with presence/frequency penalties
        self.logprobs: dict[int, list[TokenLogprob]] = {}
        self.constraints: dict[int, TokenConstraint] = {}

    def add(self, seq_id: int, params: SamplingParams, prompt_len: int = 0,
            constraint: TokenConstraint | None = None) -> None:
        if constraint is not None:
            self.constraints[seq_id] = constraint
        generator = make_generator(params.seed, self.device)
        if generator is not None:
            self.generators[seq_id] = generator
        if params.presence_penalty or params.frequency_penalty:
            self.prompt_lens[seq_id] = prompt_len

    def release(self, seq_id: int) -> None:
        """The sequence is finished or aborted: forget everything about it."""
        self.generators.pop(seq_id, None)
        self.prompt_lens.pop(seq_id, None)
        self.logprobs.pop(seq_id, None)
        self.constraints.pop(seq_id, None)

    def take_logprobs(self, seq_id: int, limit: int | None = None) -> list[TokenLogprob]:
        """The logprobs of the tokens sampled for `seq_id` since the last call, in order; at most
        `limit` of them (async scheduling: the host may be a step behind the sampler, so the newest can
        belong to a token it has not delivered yet)."""
        found = self.logprobs.get(seq_id, [])
        if limit is None or limit >= len(found):
            return self.logprobs.pop(seq_id, [])
        taken, self.logprobs[seq_id] = found[: max(limit, 0)], found[max(limit, 0) :]
        return taken

    def __call__(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
                 seen: list[list[int]] | None = None) -> torch.Tensor:
        """logits [N, V], row i for sequence seq_ids[i] -> token ids [N]."""
        generated = None
        if seen is not None and any(i in self.prompt_lens for i in seq_ids):
            generated = [ids[self.prompt_lens[i]:] if i in self.prompt_lens else [] for i, ids in zip(seq_ids, seen)]
        constrained = [j for j, i in enumerate(seq_ids) if i in self.constraints]
        masked = logits
        if constrained:  # structured output: only what the grammar allows next
            packed = token_bitmasks([self.constraints[seq_ids[j]] for j in constrained], logits.shape[1])
            masked = apply_token_bitmasks(logits, constrained, packed)
        if logits.is_cuda and all(p.greedy for p in params):  # async scheduling: the argmax in Triton
            from nanoserve.kernels.argmax import argmax

            tokens = argmax(filtered_logits(masked, params, seen, generated), one_pass=self.one_pass_argmax)
        else:
            tokens = sample(masked, params, [self.generators.get(i) for i in seq_ids], seen, generated)
        asking = [i for i, p in enumerate(params) if p.logprobs is not None]
        if asking:  # logprobs: from the raw logits, before any bias, penalty or temperature
            rows = torch.tensor(asking, device=logits.device)
            found = token_logprobs(logits[rows], tokens[rows], [params[i].logprobs for i in asking])
            for i, entry in zip(asking, found):
                self.logprobs.setdefault(seq_ids[i], []).append(entry)
        return tokens


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
