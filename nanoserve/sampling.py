"""Week 3: turning logits into tokens, with every request's own settings.

A batch holds sequences from different requests, and each request brings its own
`SamplingParams`. The sampler works on the whole `[num_seqs, vocab]` block of logits at once,
with the per-row settings as columns of tensors, in the order HuggingFace applies them:

    repetition penalty -> temperature -> top-k -> top-p -> softmax -> draw

Temperature 0 means greedy. A request with a `seed` draws from its own random generator, so it
gets the same tokens on every run, whatever else shares its batch.
"""

from __future__ import annotations

import torch

from nanoserve.sampling_params import SEED_MAX, SEED_MIN, SamplingParams  # noqa: F401 (SEED_*: re-exported)


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
                    seen: list[list[int]] | None = None) -> torch.Tensor:
    """Everything but the draw: penalty, temperature, top-k, top-p. Greedy rows are only penalized.

    Which steps a batch needs is decided from `params`, on the host: asking the GPU ("does any
    row have a penalty?") would make the host wait for it.
    """
    device = logits.device
    logits = logits.float()
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
           seen: list[list[int]] | None = None) -> torch.Tensor:
    """Draw one token per row. logits [N, V] -> token ids [N] (int64, on logits' device).

    `generators[i]`, when given, is row i's private generator (seeded requests); other rows
    share the global one. `seen[i]` lists row i's tokens so far, for the repetition penalty.
    """
    # >>> week03: sample
    logits = filtered_logits(logits, params, seen)
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
    """The engine's sampler: `sample` for a batch, plus each seeded request's private generator
    (kept here, with the tensors, so that the scheduler's sequences hold none)."""

    def __init__(self, device: torch.device | str):
        self.device = device
        self.generators: dict[int, torch.Generator] = {}

    def add(self, seq_id: int, params: SamplingParams) -> None:
        generator = make_generator(params.seed, self.device)
        if generator is not None:
            self.generators[seq_id] = generator

    def release(self, seq_id: int) -> None:
        """The sequence is finished or aborted: forget its generator."""
        self.generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
                 seen: list[list[int]] | None = None) -> torch.Tensor:
        """logits [N, V], row i for sequence seq_ids[i] -> token ids [N]."""
        return sample(logits, params, [self.generators.get(i) for i in seq_ids], seen)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
