"""Week 17: the rejection rule that verifies guesses against the target's distribution."""

from __future__ import annotations

import torch

from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sampler import filtered_logits


def verify(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
           generators: list[torch.Generator | None] | None = None,
           seen: list[list[int]] | None = None,
           draft_probs: list[torch.Tensor | None] | None = None) -> list[list[int]]:
    """Check every sequence's proposed tokens against the target's logits; return the tokens to
    append: the accepted prefix of drafts[i], then one token of the target's own.

    logits [R, V]: sequence i owns len(drafts[i]) + 1 consecutive rows, in batch order; its row j
    holds the target's logits after its tokens plus drafts[i][:j] (R = sum of len(d) + 1).
    params[i], generators[i], seen[i]: as for `sample`; row j of sequence i is penalized for
    seen[i] + drafts[i][:j]. draft_probs[i]: None when the proposer has no distribution (the
    draft is a point mass on the proposed token), else a [len(drafts[i]), V] tensor: row j is
    the distribution drafts[i][j] was drawn from. Greedy sequences ignore it.

    Greedy sequences accept drafts while they equal the argmax, then take the argmax. Sampled
    sequences use the rejection rule of the module docstring. A seeded sequence draws all its
    random numbers from its own generator (len(drafts[i]) uniforms, then its rows' noise), so
    the same seed and drafts give the same tokens whatever shares the batch; with no drafts it
    draws exactly what `sample` would, and returns the same token.
    """
    device = logits.device
    num_rows = [len(d) + 1 for d in drafts]
    _check_verify_args(logits, drafts, params, generators, seen, draft_probs, num_rows)
    starts = [0]  # the first row of each sequence
    for n in num_rows[:-1]:
        starts.append(starts[-1] + n)
    if seen is None and all(p.greedy for p in params):
        # All greedy, no penalty: the argmax of every row, one small copy, and the comparison
        # on the host. (The general path below gives the same tokens with a dozen more kernels,
        # which at batch 1 cost a tenth of a decode step.)
        target = logits.argmax(dim=-1).tolist()
        out = []
        for d, first in zip(drafts, starts):
            n = 0
            while n < len(d) and d[n] == target[first + n]:
                n += 1
            out.append(d[:n] + [target[first + n]])
        return out

    # One row per (sequence, position), described on the host.
    row_params = [p for p, n in zip(params, num_rows) for _ in range(n)]
    row_seen = None if seen is None else [s + d[:j] for s, d in zip(seen, drafts) for j in range(len(d) + 1)]
    row_seq = [i for i, n in enumerate(num_rows) for _ in range(n)]  # which sequence owns the row
    row_j = [j for n in num_rows for j in range(n)]  # the row's position within its sequence
    row_draft = [t for d in drafts for t in d + [0]]  # the token row j checks; 0 on the last row
    row_has_draft = [int(j < len(d)) for d in drafts for j in range(len(d) + 1)]
    row_greedy = [int(p.greedy) for p in row_params]
    # Rows whose q comes from draft_probs (sampled sequences that brought them).
    with_probs = [i for i, probs in enumerate(draft_probs or [])
                  if probs is not None and drafts[i] and not params[i].greedy]
    q_rows = [starts[i] + j for i in with_probs for j in range(len(drafts[i]))]
    draft, has_draft, greedy, row_seq, row_j, first_row, q_rows = _to_device(
        [row_draft, row_has_draft, row_greedy, row_seq, row_j, starts, q_rows], device)
    has_draft, greedy = has_draft.bool(), greedy.bool()

    logits = filtered_logits(logits, row_params, row_seen)  # [R, V] float32
    target_argmax = logits.argmax(dim=-1)  # [R]
    if all(p.greedy for p in params):  # decided on the host, as in `sample`
        accept = has_draft & (draft == target_argmax)
        emit = target_argmax
    else:
        q_given = torch.cat([draft_probs[i] for i in with_probs]).to(device, torch.float32) if with_probs else None
        accept, drawn = _rejection_sample(logits, draft, has_draft, q_rows, q_given,
                                          drafts, params, generators, starts)
        accept = has_draft & torch.where(greedy, draft == target_argmax, accept)
        emit = torch.where(greedy, target_argmax, drawn)

    # Accepted drafts of a sequence = index of its first row that does not accept (its last row
    # never does): the minimum over its rows of (j if the row stops here, else R).
    R = len(row_j)
    stop_at = torch.where(accept, R, row_j)  # [R]
    num_accepted = torch.full((len(drafts),), R, device=device).scatter_reduce(
        0, row_seq, stop_at, reduce="amin")  # [S]
    last_token = emit[first_row + num_accepted]  # [S]
    num_accepted, last_token = torch.stack([num_accepted, last_token]).tolist()  # the one device->host copy
    return [d[:n] + [t] for d, n, t in zip(drafts, num_accepted, last_token)]


def _to_device(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Several lists of ints in one host->device copy (an int64 tensor each): a copy from
    ordinary host memory waits for the GPU to finish its queue, so one is better than seven."""
    flat = torch.tensor([x for values in lists for x in values], dtype=torch.int64, device=device)
    return list(flat.split([len(values) for values in lists]))


def _rejection_sample(logits: torch.Tensor, draft: torch.Tensor, has_draft: torch.Tensor,
                      q_rows: torch.Tensor, q_given: torch.Tensor | None,
                      drafts: list[list[int]], params: list[SamplingParams],
                      generators: list[torch.Generator | None] | None,
                      starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For every row: does it accept its draft token, and the token it emits if it stops there.

    logits [R, V] already filtered; q_given [len(q_rows), V] holds the draft distributions of
    rows q_rows. Returns accept [R] bool (meaningless where has_draft is False) and drawn [R]:
    a draw from norm(max(0, p - q)), which is p itself on a sequence's last row (q = 0 there:
    nothing was proposed).
    """
    R, V = logits.shape
    device = logits.device
    p = logits.softmax(dim=-1)  # [R, V] the target's distributions
    # q [R, V]: the proposer's distributions. A point mass on the draft token where the proposer
    # has none, the given rows where it has, zeros on each sequence's last row.
    q = torch.zeros_like(p).scatter_(1, draft[:, None], has_draft[:, None].to(p.dtype))
    if q_given is not None:
        q[q_rows] = q_given
    p_draft = p.gather(1, draft[:, None])[:, 0]  # [R] p(x)
    q_draft = q.gather(1, draft[:, None])[:, 0]  # [R] q(x)

    # Random numbers: shared generator for all rows, then each seeded sequence's rows redrawn
    # from its own generator (uniforms first, then noise), like `sample` does.
    uniform = torch.rand(R, device=device)  # [R]
    noise = torch.empty_like(p).exponential_()  # [R, V]
    for i, g in enumerate(generators or []):
        if g is not None and not params[i].greedy:
            first, n = starts[i], len(drafts[i])
            uniform[first : first + n] = torch.rand(n, generator=g, device=device)
            noise[first : first + n + 1].exponential_(generator=g)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # an exact 0 would divide by zero

    # >>> week17: rejection-rule
    # Accept x with probability min(1, p(x) / q(x)); written without the division so that
    # q(x) = 0 is no special case, and p(x) = 0 never accepts.
    accept = uniform * q_draft < p_draft  # [R]
    residual = (p - q).clamp(min=0)  # [R, V]
    # Where the residual is empty (never on a real rejection, in exact arithmetic), use p.
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # [R, 1]
    residual = torch.where(empty, p, residual)
    drawn = (residual / noise).argmax(dim=-1)  # exponential race: no need to normalise
    return accept, drawn
    # <<< week17: rejection-rule


def _check_verify_args(logits, drafts, params, generators, seen, draft_probs, num_rows) -> None:
    if logits.dim() != 2 or logits.shape[0] != sum(num_rows):
        raise ValueError(f"logits must be [sum(len(draft) + 1), vocab] = [{sum(num_rows)}, V], "
                         f"got {list(logits.shape)}")
    for name, per_seq in (("params", params), ("generators", generators), ("seen", seen),
                          ("draft_probs", draft_probs)):
        if per_seq is not None and len(per_seq) != len(drafts):
            raise ValueError(f"{len(drafts)} sequences but {len(per_seq)} {name}")
    for i, probs in enumerate(draft_probs or []):
        if probs is not None and tuple(probs.shape) != (len(drafts[i]), logits.shape[1]):
            raise ValueError(f"draft_probs[{i}] must be [{len(drafts[i])}, {logits.shape[1]}] "
                             f"(one row per draft token), got {list(probs.shape)}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one target step emits on average with k guesses, each accepted with probability
    alpha independently: 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0 <= alpha <= 1 or k < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)

