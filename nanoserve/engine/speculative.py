"""Speculative decoding: guess several tokens cheaply, then check them all in one target step.

A decode step runs the whole model to produce one token, and on a GPU it is limited by reading
the weights, not by arithmetic: checking k + 1 positions costs about as much as checking one.
So a cheap *proposer* guesses k tokens, the target model runs once over the sequence plus the
guesses (k + 1 rows of logits), and `verify` keeps the longest prefix of guesses the target
agrees with, plus one token of the target's own. Every step emits at least one token, so nothing
is lost when the guesses are bad; when they are good, one step emits up to k + 1.

This module holds the proposers and the engine's hooks:

    NgramProposer    "prompt lookup": if the last few tokens appeared earlier, guess that what
                     followed them then follows them again (code, quotes, summaries repeat)
    SpecStats        counts proposed / accepted tokens, for the acceptance rate
    DraftModelProposer   guesses from a smaller model with its own paged cache
    SpecDecoder      the hooks `Engine.run_step` calls: `propose` (guesses added to the batch),
                     `verify` (the tokens each sequence appends), `after_update`

The acceptance rule itself, `verify`, is in nanoserve/sampling/rejection.py: greedy rows compare
with the argmax; sampled rows use rejection sampling, so the tokens emitted follow exactly the
distribution the target alone would sample from.

The rejection rule (Leviathan et al. 2023, Chen et al. 2023). The target's distribution at a
position is p, the proposer's is q, and the proposed token x was drawn from q. Accept x with
probability min(1, p(x) / q(x)); at the first rejection, draw instead from max(0, p - q)
renormalised, and stop. Then P(emit y) = q(y) min(1, p(y)/q(y)) + P(reject) norm(p - q)+(y)
= min(q(y), p(y)) + (p(y) - q(y))+ = p(y): the output follows p whatever q is. If every guess
is accepted, the row after the last guess gives one more token, drawn from p: the bonus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.model.loader import load_model, resolve_model_dir
from nanoserve.runner.runner import ModelRunner
from nanoserve.sampling.rejection import verify
from nanoserve.sampling.sampler import Sampler, filtered_logits, make_generator, sample
from nanoserve.scheduler.blocks import BlockAllocator, blocks_needed
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Batch, Sequence


class NgramProposer:
    """Prompt-lookup proposer: continue the sequence the way it went on the last time its final
    tokens appeared.

    For n = max_n down to min_n: take the last n tokens, find their most recent earlier
    occurrence, and propose the (up to) k tokens that followed it. Longest n first, because a
    longer match is stronger evidence that the text repeats; the most recent occurrence, because
    text repeats what it said lately (the current function, the paragraph being quoted).
    The earlier occurrence may overlap the suffix itself: in "a b a b a b" the suffix "a b" last
    occurred two tokens before the end, and what followed it is "a b".

    Cost: a reverse scan for the earlier copies of the last token, in C (`list.index`), and a
    short Python check at each, stopping at the first full max_n match. On a 4,000-token list
    one call took 30 us (random tokens: no match), 50 us (20 distinct tokens) and 220 us (the
    last token is every other token, with no longer match) on the development CPU.
    """

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k guessed next tokens for `token_ids` (fewer if the match is near the end,
        [] if no n-gram of min_n..max_n tokens matches or k == 0)."""
        # >>> week17: ngram-propose
        if k <= 0 or len(token_ids) < 2:
            return []
        last = len(token_ids) - 1
        reversed_ids = token_ids[::-1]  # list.index only searches forwards: search the reverse
        end_of_match: dict[int, int] = {}  # match length n -> where its most recent match ends
        i = 0  # position in reversed_ids; 0 is the last token itself, never a match
        while self.max_n not in end_of_match:
            try:
                i = reversed_ids.index(token_ids[last], i + 1)
            except ValueError:
                break  # no earlier occurrence of the last token left
            end = last - i  # token_ids[end] == token_ids[last], end < last
            n = 1  # how many tokens match, backwards from `end` and from `last`
            while n < self.max_n and n <= end and token_ids[end - n] == token_ids[last - n]:
                n += 1
            end_of_match.setdefault(n, end)  # scanning backwards: the first one is the most recent
        for n in range(self.max_n, self.min_n - 1, -1):
            if n in end_of_match:
                start = end_of_match[n] + 1
                return list(token_ids[start : start + k])
        return []
        # <<< week17: ngram-propose

    def propose_batch(self, token_lists: list[list[int]], ks: list[int]) -> list[list[int]]:
        """`propose` for every sequence of a batch: token_lists[i] gets up to ks[i] tokens."""
        if len(token_lists) != len(ks):
            raise ValueError(f"{len(token_lists)} sequences but {len(ks)} values of k")
        return [self.propose(ids, k) for ids, k in zip(token_lists, ks)]




@dataclass
class SpecStats:
    """Running counts of speculative decoding, one `add` per verify call.

    A step of a sequence proposes len(draft) tokens, accepts len(output) - 1 of them and emits
    len(output). Note that `acceptance_rate` counts every proposed token, also those after the
    first rejection that were never looked at, so it is below the per-token alpha of
    `expected_tokens_per_step` (it is the figure vLLM reports as the draft acceptance rate).
    """

    num_proposed: int = 0  # draft tokens sent to verification
    num_accepted: int = 0  # of those, accepted
    num_emitted: int = 0  # tokens appended: accepted ones plus one of the target's per step
    num_steps: int = 0  # sequence-steps verified (a sequence in one target forward pass)

    def add(self, drafts: list[list[int]], outputs: list[list[int]]) -> None:
        """Count one verify call: its drafts and what it returned (before any stop truncation)."""
        for draft, out in zip(drafts, outputs, strict=True):
            self.num_proposed += len(draft)
            self.num_accepted += len(out) - 1
            self.num_emitted += len(out)
            self.num_steps += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before anything was proposed)."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a sequence gains per target step (1 without speculation)."""
        return self.num_emitted / self.num_steps if self.num_steps else 0.0


# ------------------------------------------------------------------ inside the engine (week 17)


class DraftModelProposer:
    """Guesses from a smaller model with the same tokenizer, run ahead k tokens per step.

    The draft keeps its own paged KV cache (its own `ModelRunner` and block pool) and one shadow
    `Sequence` per target sequence: the same tokens, its own block table and computed length.
    Each step it catches up on the tokens the target emitted since (one prefill-like pass), then
    runs k - 1 more one-token steps, sampling each guess with the request's own settings (greedy
    requests: the argmax). After verification the shadow takes the target's tokens, and its
    computed length rolls back to the last guess the target accepted; blocks past it are freed.
    """

    def __init__(self, model_dir, *, dtype: torch.dtype, device: str, block_size: int, num_blocks: int,
                 max_model_len: int, attention_backend: str, fused_kernels: bool, vocab_size: int):
        model = load_model(model_dir, dtype=dtype, device=device)
        if model.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary has {model.config.vocab_size} tokens, the target's "
                             f"{vocab_size}: a draft must share the target's tokenizer")
        self.runner = ModelRunner(model, num_blocks, block_size, attention_backend=attention_backend,
                                  max_model_len=max_model_len, fused_kernels=fused_kernels)
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.shadows: dict[int, object] = {}  # target seq_id -> its shadow Sequence
        self.generators: dict[int, torch.Generator] = {}  # seeded requests: the draft's own draws

    def propose(self, seqs: list, ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to ks[i] guesses for seqs[i], and the distributions they were drawn from (None for
        greedy requests, whose guesses are argmaxes)."""
        shadows, want, owners = [], [], {}
        for seq, k in zip(seqs, ks):
            shadow = self.shadows.get(seq.seq_id)
            if shadow is None:
                shadow = self.shadows[seq.seq_id] = Sequence(seq.token_ids, seq.params)
                generator = make_generator(None if seq.params.seed is None else seq.params.seed + 1,
                                           self.runner.device)
                if generator is not None:
                    self.generators[seq.seq_id] = generator
            shadow.token_ids = list(seq.token_ids)
            needed = blocks_needed(len(shadow.token_ids) + k, self.block_size) - len(shadow.block_table)
            if k and needed <= self.allocator.num_free:  # out of draft blocks: no guess this step
                for _ in range(max(0, needed)):
                    shadow.block_table.append(self.allocator.allocate())
                shadows.append(shadow)
                want.append(k)
                owners[id(shadow)] = seq.seq_id
        drafts: dict[int, list[int]] = {id(s): [] for s in shadows}
        probs: dict[int, list[torch.Tensor]] = {id(s): [] for s in shadows}
        active = list(zip(shadows, want))
        while active:  # round r: every shadow still short of its k runs its new tokens, samples one
            batch = Batch([s for s, _ in active], [s.num_tokens - s.num_computed for s, _ in active])
            logits = self.runner.execute(batch)
            params = [s.params for s, _ in active]
            generators = [self.generators.get(owners[id(s)]) for s, _ in active]
            tokens = sample(logits, params, generators).tolist()
            if not all(p.greedy for p in params):
                distributions = filtered_logits(logits, params).softmax(dim=-1)
            for row, ((shadow, k), token) in enumerate(zip(active, tokens)):
                shadow.num_computed = shadow.num_tokens
                shadow.token_ids.append(token)
                drafts[id(shadow)].append(token)
                if not shadow.params.greedy:
                    probs[id(shadow)].append(distributions[row])
            active = [(s, k) for s, k in active if len(drafts[id(s)]) < k]
        out_drafts, out_probs, by_seq = [], [], {owners[id(s)]: s for s in shadows}
        for seq in seqs:
            shadow = by_seq.get(seq.seq_id)
            out_drafts.append(drafts[id(shadow)] if shadow is not None else [])
            greedy = shadow is None or seq.params.greedy
            out_probs.append(None if greedy else torch.stack(probs[id(shadow)]))
        return out_drafts, out_probs

    def after_step(self, seqs: list, drafts: list[list[int]], live: set[int]) -> None:
        """After verification: each shadow keeps the K/V of the guesses the target accepted and
        takes the target's tokens; shadows of finished or aborted sequences are freed."""
        for seq, draft in zip(seqs, drafts):
            shadow = self.shadows.get(seq.seq_id)
            if shadow is None or not draft:
                continue
            old = shadow.token_ids[: len(shadow.token_ids) - len(draft)]  # its tokens before the guesses
            accepted = 0
            while accepted < len(draft) and len(old) + accepted < len(seq.token_ids) \
                    and seq.token_ids[len(old) + accepted] == draft[accepted]:
                accepted += 1
            # computed: the old tokens and the guesses fed back in (all but the last), if accepted
            shadow.num_computed = min(shadow.num_computed, len(old) + accepted, len(seq.token_ids) - 1)
            shadow.token_ids = list(seq.token_ids)
            keep = blocks_needed(max(shadow.num_tokens, 1), self.block_size)
            while len(shadow.block_table) > keep:
                self.allocator.free(shadow.block_table.pop())
            shadow.block_table_version += 1
        for seq_id in [sid for sid in self.shadows if sid not in live]:
            self.release(seq_id)

    def release(self, seq_id: int) -> None:
        shadow = self.shadows.pop(seq_id, None)
        self.generators.pop(seq_id, None)
        if shadow is not None:
            for block in shadow.block_table:
                self.allocator.free(block)


@dataclass
class Drafts:
    """One step's guesses, as scheduled: `tokens[i]` for the batch's sequence i (none for most),
    and `probs[i]`, the distributions a draft model drew them from (None: greedy, or guessed from
    tokens alone)."""

    tokens: list[list[int]]
    probs: list[torch.Tensor | None]


class SpecDecoder:
    """Speculative decoding's hooks in the engine's step (week 17). `Engine.run_step` calls them
    around week 5's forward pass:

        batch   = scheduler.schedule()                      # as always
        drafts  = speculator.propose(batch)                 # k guesses per decode, added to the batch:
                                                            # decodes become k + 1 tokens, k + 1 rows
        logits  = runner.execute(batch)                     # one target pass over everything
        tokens  = speculator.verify(logits, batch, drafts)  # accepted guesses + one target token
        scheduler.update(batch, tokens)                     # rejected guesses' K/V rolled back
        speculator.after_update(batch, drafts)              # the draft model rolls back too

    Speculation is switched off for a step whose batch has more than `max_batch` decodes: the
    guesses' extra rows are nearly free only while the step is limited by reading the weights.
    """

    def __init__(self, method: str, num_tokens: int, max_batch: int, *, runner: ModelRunner,
                 scheduler: Scheduler, sampler: Sampler, max_model_len: int, attention_backend: str,
                 draft_model=None, ngram_min: int = 2):
        if method not in ("ngram", "draft"):
            raise ValueError(f"unknown speculative method {method!r}: choose ngram or draft")
        if num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
        if method == "draft" and draft_model is None:
            raise ValueError("speculative decoding with a draft model needs --draft-model")
        self.method, self.k, self.max_batch = method, num_tokens, max_batch
        self.runner, self.scheduler, self.sampler = runner, scheduler, sampler
        # Guesses from tokens alone: anything with `propose_batch(token_lists, ks)` (the benchmark
        # plugs in an oracle here); or from the draft model, with the distributions drawn from.
        self.proposer = NgramProposer(min_n=ngram_min) if method == "ngram" else None
        self.draft = None
        if method == "draft":
            block_size = runner.cache.block_size
            self.draft = DraftModelProposer(
                resolve_model_dir(draft_model), dtype=runner.model.embed_tokens.weight.dtype,
                device=str(runner.device), block_size=block_size,
                num_blocks=min(scheduler.allocator.num_blocks, max_batch * blocks_needed(max_model_len, block_size)),
                max_model_len=max_model_len, attention_backend=attention_backend,
                fused_kernels=runner.fused, vocab_size=runner.model.config.vocab_size)
        self.stats = SpecStats()

    def propose(self, batch: Batch) -> Drafts:
        """Guesses for the batch's decodes (none for prompts, or for a batch too large), added to
        the batch (`Scheduler.add_drafts`, which cuts them to what fits)."""
        decodes = [i for i, (n, m) in enumerate(zip(batch.num_new_tokens, batch.num_samples)) if n == 1 and m == 1]
        drafts: list[list[int]] = [[] for _ in batch.seqs]
        probs: list[torch.Tensor | None] = [None for _ in batch.seqs]
        if not decodes or len(decodes) > self.max_batch:
            return Drafts(drafts, probs)
        seqs = [batch.seqs[i] for i in decodes]
        ks = [max(0, min(self.k, s.params.max_tokens - s.num_output_tokens - 1)) for s in seqs]
        if self.draft is None:
            guessed, guessed_probs = self.proposer.propose_batch([s.token_ids for s in seqs], ks), [None] * len(seqs)
        else:
            guessed, guessed_probs = self.draft.propose(seqs, ks)
        graphs = self.runner.graphs
        if graphs is not None and graphs.verify_sizes and any(guessed):
            # A verification step replays a CUDA graph only if every sequence runs the same number
            # of tokens: fill short guesses up (repeating the last token). A filler guess is a
            # guess like any other, checked like any other; on a GPU at small batch it costs
            # next to nothing, and it keeps the step on a graph.
            guessed = [g + [(g or s.token_ids)[-1]] * (k - len(g)) for g, s, k in zip(guessed, seqs, ks)]
        for i, d, p in zip(decodes, guessed, guessed_probs):
            drafts[i], probs[i] = d, p
        drafts = self.scheduler.add_drafts(batch, drafts)  # cut to what fits
        self.scheduler.attach_copies(batch)  # (room for the guesses may have evicted blocks to the CPU tier)
        return Drafts(drafts, [None if p is None else p[: len(d)] for p, d in zip(probs, drafts)])

    def verify(self, logits: torch.Tensor, batch: Batch, drafts: Drafts) -> list[list[int]]:
        """The tokens each sequence of the batch appends ([] for those that sample nothing):
        the guesses the target accepts, then one token of its own."""
        sampled = [i for i, m in enumerate(batch.num_samples) if m]
        guesses = [drafts.tokens[i] for i in sampled]
        out = self.accept(logits, guesses, [batch.seqs[i] for i in sampled], [drafts.probs[i] for i in sampled])
        self.stats.add([g for g in guesses if g], [o for g, o in zip(guesses, out) if g])
        tokens: list[list[int]] = [[] for _ in batch.seqs]
        for i, o in zip(sampled, out):
            tokens[i] = o
        return tokens

    def accept(self, logits, drafts, seqs, probs) -> list[list[int]]:
        """The acceptance rule for the sampled sequences (the benchmark overrides this to force
        acceptance, for the ceiling)."""
        penalized = any(s.params.repetition_penalty != 1.0 for s in seqs)
        return verify(logits, drafts, [s.params for s in seqs], [self.sampler.generators.get(s.seq_id) for s in seqs],
                      seen=[s.token_ids for s in seqs] if penalized else None, draft_probs=probs)

    def after_update(self, batch: Batch, drafts: Drafts) -> None:
        """Once the scheduler has the step's tokens: the draft model's shadows take them, and
        roll back to the guesses the target accepted."""
        if self.draft is not None:
            live = {s.seq_id for s in self.scheduler.running} | {s.seq_id for s in self.scheduler.waiting}
            self.draft.after_step(batch.seqs, drafts.tokens, live)
