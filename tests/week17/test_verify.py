"""Week 17: speculative decoding's building blocks: the n-gram proposer, the batched verifier (greedy,
and rejection sampling checked by statistics), and the counters."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sampler import filtered_logits, make_generator, sample
from nanoserve.engine.speculative import NgramProposer, SpecStats
from nanoserve.sampling.rejection import expected_tokens_per_step, verify

GREEDY = SamplingParams(temperature=0)

# ---------------------------------------------------------------------------------------------
# The n-gram (prompt-lookup) proposer


@pytest.mark.exercise("ngram-propose")
@pytest.mark.parametrize(
    "tokens,k,max_n,expected",
    [
        ([1, 2, 3, 4, 1, 2], 2, 4, [3, 4]),  # "1 2" seen before: propose what followed it
        ([5, 9, 7, 3, 9, 8, 0, 5, 9], 1, 4, [7]),  # "5 9" (n=2) beats the more recent "9" (n=1)
        ([5, 9, 7, 3, 9, 8, 0, 5, 9], 1, 1, [8]),  # ... which wins when n is capped at 1
        ([1, 2, 7, 1, 2, 8, 1, 2], 1, 4, [8]),  # two earlier "1 2": the most recent one
        ([1, 2, 3, 1, 2], 5, 4, [3, 1, 2]),  # fewer than k: the sequence ends first
        ([4, 4, 4, 4], 3, 4, [4]),  # the match may overlap the suffix
        ([1, 2, 3, 4], 3, 4, []),  # the last token never appeared before
        ([1, 2, 3, 1, 2], 0, 4, []),  # k = 0
        ([], 3, 4, []),
        ([7], 3, 4, []),
    ],
)
def test_ngram_proposer_hand_made(tokens, k, max_n, expected):
    assert NgramProposer(max_n=max_n).propose(tokens, k) == expected


@pytest.mark.exercise("ngram-propose")
def test_ngram_proposer_min_n_and_batch():
    assert NgramProposer(min_n=1).propose([1, 2, 3, 1], 3) == [2, 3, 1]
    assert NgramProposer(min_n=2).propose([1, 2, 3, 1], 3) == []  # only a 1-gram matches
    proposer = NgramProposer()
    assert proposer.propose_batch([[1, 2, 1], [3, 4], [5, 6, 5]], [1, 2, 0]) == [[2], [], []]
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(max_n=2, min_n=3)


def brute_force_propose(tokens, k, max_n, min_n):
    """The definition, spelled out: longest n first, then the latest earlier start."""
    if k == 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.exercise("ngram-propose")
@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), k=st.integers(0, 6),
       max_n=st.integers(1, 5), data=st.data())
def test_ngram_proposer_matches_brute_force(tokens, k, max_n, data):
    min_n = data.draw(st.integers(1, max_n))
    got = NgramProposer(max_n=max_n, min_n=min_n).propose(tokens, k)
    assert got == brute_force_propose(tokens, k, max_n, min_n)


# ---------------------------------------------------------------------------------------------
# Greedy verification


def reference_greedy(rows, draft, params, seen):
    """One sequence, the slow way: `sample` on each row, with the drafts before it as seen."""
    for j, row in enumerate(rows):
        token = sample(row[None], [params], seen=[seen + draft[:j]]).item()
        if j == len(draft) or token != draft[j]:
            return draft[:j] + [token]


def test_greedy_accepts_the_prefix_that_matches_the_argmax():
    logits = torch.randn(5, 50)
    best = logits.argmax(-1).tolist()
    wrong = (best[2] + 1) % 50
    assert verify(logits, [[best[0], best[1], wrong, best[3]]], [GREEDY]) == [[best[0], best[1], best[2]]]
    assert verify(logits[:1], [[]], [GREEDY]) == [[best[0]]]  # no drafts: a plain decode
    assert verify(logits, [best[:4]], [GREEDY]) == [best]  # all accepted, plus the bonus token
    assert verify(logits[:2], [[wrong if best[0] == wrong else (best[0] + 1) % 50]], [GREEDY]) == [[best[0]]]


@pytest.mark.exercise("rejection-rule")
def test_greedy_mixed_batch_equals_sample_row_by_row():
    """Sequences with 0..4 drafts, half right, with a repetition penalty, sampled and greedy
    neighbours: every greedy sequence gets what `sample` gives it one row at a time."""
    torch.manual_seed(3)
    V = 40
    lengths = [0, 3, 1, 4, 2, 0, 3]
    params = [SamplingParams(temperature=0, repetition_penalty=1.5 if i % 2 else 1.0) for i in range(len(lengths))]
    params[1] = SamplingParams(temperature=0.7, top_k=10)  # a sampled sequence in the mix
    seen = [torch.randint(0, V, (6,)).tolist() for _ in lengths]
    rows = [torch.randn(n + 1, V) * 3 for n in lengths]
    drafts = []
    for i, n in enumerate(lengths):  # drafts: the right token for the first half, then random
        draft = []
        for j in range(n):
            right = filtered_logits(rows[i][j][None], [params[i]], [seen[i] + draft]).argmax().item()
            draft.append(right if j < (n + 1) // 2 else torch.randint(0, V, ()).item())
        drafts.append(draft)
    out = verify(torch.cat(rows), drafts, params, seen=seen)
    for i, n in enumerate(lengths):
        assert 1 <= len(out[i]) <= n + 1 and out[i][:-1] == drafts[i][: len(out[i]) - 1]
        if params[i].greedy:
            assert out[i] == reference_greedy(rows[i], drafts[i], params[i], seen[i])
    assert any(len(out[i]) > 1 for i in range(len(lengths)) if params[i].greedy)  # some accepted


@pytest.mark.exercise("rejection-rule")
def test_sampling_with_top_k_1_is_greedy():
    """top_k = 1 leaves one token with probability 1: accepted if drafted, drawn if not."""
    logits = torch.randn(9, 30)
    best = logits.argmax(-1).tolist()
    wrong = [(t + 1) % 30 for t in best]
    drafts = [best[0:3], [best[4], wrong[5]], [wrong[7]]]  # rows 0-3, 4-6, 7-8
    params = [SamplingParams(temperature=0.9, top_k=1)] * 3
    assert verify(logits, drafts, params) == [best[0:4], [best[4], best[5]], [best[7]]]


def toy_target(context: list[int], V: int = 16) -> torch.Tensor:
    """A deterministic "model": logits from the last two tokens. Greedy text soon loops, which
    is what an n-gram proposer feeds on."""
    g = torch.Generator().manual_seed(0)
    last, before = torch.randn(V, V, generator=g), torch.randn(V, V, generator=g)
    return 2 * last[context[-1]] + before[context[-2]]


def test_speculative_greedy_loop_equals_plain_greedy_decoding():
    prompt, length = [1, 2, 3], 40
    plain = list(prompt)
    while len(plain) < len(prompt) + length:
        plain.append(sample(toy_target(plain)[None], [GREEDY]).item())

    proposer, stats, tokens = NgramProposer(max_n=3), SpecStats(), list(prompt)
    while len(tokens) < len(prompt) + length:
        draft = proposer.propose(tokens, 4)
        rows = torch.stack([toy_target(tokens + draft[:j]) for j in range(len(draft) + 1)])
        out = verify(rows, [draft], [GREEDY], seen=[tokens])[0]
        stats.add([draft], [out])
        tokens += out
    assert tokens[: len(plain)] == plain
    assert stats.num_accepted > 0 and stats.num_steps < length  # speculation paid off


# ---------------------------------------------------------------------------------------------
# Rejection sampling, by statistics: the emitted tokens follow the target's distribution p.
#
# Chi-square goodness of fit over a tiny vocabulary, many copies of the same rows in one verify
# call. The p-value comes from the chi-square survival function, sf(x; df) = Q(df/2, x/2)
# (torch.special.gammaincc; scipy is not a dependency): see test_chi_square_pvalue_is_right.
# Every check fails when p < ALPHA = 1e-3, its false-alarm rate; the seeds are fixed, so the
# tests are deterministic.

ALPHA = 1e-3
N = 20_000  # copies of the sequence per test


def chi_square_pvalue(groups: list[tuple[list[int], torch.Tensor]]) -> float:
    """Combined chi-square p-value that each group's samples were drawn from its probs [V].
    A sample on a token of probability 0 gives 0."""
    stat, df = 0.0, 0
    for samples, probs in groups:
        counts = torch.bincount(torch.tensor(samples, dtype=torch.long), minlength=len(probs)).double()
        support = probs > 0
        if counts[~support].sum() > 0:
            return 0.0
        expected = probs[support].double() * len(samples)
        assert expected.min() >= 5, "too few samples for a chi-square test"
        stat += ((counts[support] - expected) ** 2 / expected).sum().item()
        df += int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


def test_chi_square_pvalue_is_right():
    # Textbook critical values at 1e-3 (df 1, 4, 6): a statistic exactly there has p = 1e-3.
    for df, critical in [(1, 10.828), (4, 18.467), (6, 22.458)]:
        p = torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(critical / 2)).item()
        assert p == pytest.approx(1e-3, rel=1e-3)


def target_probs(row: torch.Tensor, params: SamplingParams, seen: list[int] | None = None) -> torch.Tensor:
    return filtered_logits(row[None], [params], None if seen is None else [seen])[0].softmax(-1)


SAMPLED = SamplingParams(temperature=0.8, top_k=5, top_p=0.95, repetition_penalty=1.3)


@pytest.mark.exercise("rejection-rule")
@pytest.mark.parametrize("draft_rank", [0, 2])  # the target's favourite, or its third choice
def test_point_mass_drafts_emit_the_target_distribution(draft_rank):
    """An n-gram draft: the first token follows p0, the second (given the first draft was
    accepted) p1, the bonus p2, each row penalized for the drafts before it."""
    torch.manual_seed(10 + draft_rank)
    V, prompt = 6, [0, 1]
    rows = torch.randn(3, V) * 1.5  # [row after prompt, after x1, after x1 x2]
    x1 = rows[0].argsort(descending=True)[draft_rank].item()
    x2 = rows[1].argmax().item()
    p = [target_probs(rows[j], SAMPLED, prompt + [x1, x2][:j]) for j in range(3)]
    assert (p[0] > 0).sum() >= 3 and p[0][x1] > 0  # a real choice, and a draft that can pass

    out = verify(rows.repeat(N, 1), [[x1, x2]] * N, [SAMPLED] * N, seen=[prompt] * N)
    first = [o[0] for o in out]
    second = [o[1] for o in out if len(o) >= 2]
    bonus = [o[2] for o in out if len(o) == 3]
    assert all(o[0] == x1 for o in out if len(o) >= 2)  # a second token only after an accepted x1
    assert chi_square_pvalue([(first, p[0])]) > ALPHA
    assert chi_square_pvalue([(second, p[1])]) > ALPHA
    if draft_rank == 0:  # x1 is accepted often enough to have many bonus tokens
        assert chi_square_pvalue([(bonus, p[2])]) > ALPHA
    # The acceptance rate of a point-mass draft is p(x): accepted at row 0 ~ N p0(x1).
    assert len(second) / N == pytest.approx(p[0][x1].item(), abs=5 * (0.25 / N) ** 0.5)


@pytest.mark.exercise("rejection-rule")
def test_a_draft_the_target_filters_out_is_never_accepted():
    torch.manual_seed(4)
    rows = torch.randn(2, 6)
    x = rows[0].argmin().item()  # outside top-5
    p0 = target_probs(rows[0], SAMPLED, [0])
    out = verify(rows.repeat(N, 1), [[x]] * N, [SAMPLED] * N, seen=[[0]] * N)
    assert all(len(o) == 1 for o in out)
    assert chi_square_pvalue([([o[0] for o in out], p0)]) > ALPHA


def draft_model_case(seed: int):
    """A random "draft model" q over V = 7 and a target that depends on the drafts, N copies.
    q differs from p on purpose: it puts mass on tokens the target filters out and none on one
    token the target likes. Each copy's drafts are drawn from q, as a draft model would."""
    torch.manual_seed(seed)
    V = 7
    params = SamplingParams(temperature=1.3, top_k=5, top_p=0.95)
    target0 = torch.randn(V)
    target1 = torch.randn(V, V)  # target1[x1]: the target's logits after draft x1
    target2 = torch.randn(V, V)  # after x1 x2 (only x2 matters here)
    q0 = torch.rand(V)
    q0[target0.argmax()] = 0  # the draft model never proposes the target's favourite
    q0 /= q0.sum()
    q1 = torch.rand(V, V) ** 2  # q1[x1]: the draft model's distribution after x1
    q1 /= q1.sum(-1, keepdim=True)
    x1 = torch.multinomial(q0, N, replacement=True)  # [N]
    x2 = torch.multinomial(q1[x1], 1)[:, 0]  # [N]
    logits = torch.stack([target0.expand(N, V), target1[x1], target2[x2]], dim=1).reshape(3 * N, V)
    drafts = torch.stack([x1, x2], dim=1).tolist()
    draft_probs = list(torch.stack([q0.expand(N, V), q1[x1]], dim=1))  # N x [2, V]
    p0 = target_probs(target0, params)
    p1 = [target_probs(target1[t], params) for t in range(V)]  # p1[t]: after the first token t
    return logits, drafts, draft_probs, params, q0, p0, p1


def test_draft_model_drafts_emit_the_target_distribution():
    logits, drafts, draft_probs, params, q0, p0, p1 = draft_model_case(seed=5)
    out = verify(logits, drafts, [params] * N, draft_probs=draft_probs)
    assert chi_square_pvalue([([o[0] for o in out], p0)]) > ALPHA
    # Second token, given the first one t (an accepted draft): p1[t]. All t with enough samples.
    groups = []
    for t in range(len(p0)):
        second = [o[1] for o in out if len(o) >= 2 and o[0] == t]
        if len(second) * p1[t][p1[t] > 0].min() >= 5:
            groups.append((second, p1[t]))
    assert len(groups) >= 3
    assert chi_square_pvalue(groups) > ALPHA
    # The first draft is accepted with probability sum_x min(p(x), q(x)) (1 - the total variation).
    accepted = sum(len(o) >= 2 for o in out) / N
    assert accepted == pytest.approx(torch.minimum(p0, q0).sum().item(), abs=5 * (0.25 / N) ** 0.5)


def test_the_statistical_tests_catch_wrong_rules():
    """Power: plausible bugs give a first-token distribution that the same chi-square test
    rejects by far, with the same number of samples; the right rule, written the same way, passes."""
    logits, drafts, draft_probs, params, q0, p0, p1 = draft_model_case(seed=5)
    x1 = torch.tensor([d[0] for d in drafts])  # drawn from q0
    q_x, p_x = q0[x1], p0[x1]
    u = torch.rand(N)
    residual = (p0 - q0).clamp(min=0)
    from_residual = torch.multinomial(residual / residual.sum(), N, replacement=True)
    from_p = torch.multinomial(p0, N, replacement=True)
    wrong_rules = {
        "always accept": x1,
        "on rejection, draw from p": torch.where(u * q_x < p_x, x1, from_p),
        "ratio upside down, min(1, q/p)": torch.where(u * p_x < q_x, x1, from_residual),
    }
    for name, first in wrong_rules.items():
        assert chi_square_pvalue([(first.tolist(), p0)]) < 1e-9, name
    right = torch.where(u * q_x < p_x, x1, from_residual)
    assert chi_square_pvalue([(right.tolist(), p0)]) > ALPHA


def test_drafts_of_a_model_may_be_verified_as_point_masses():
    """Without draft_probs each draft token counts as certain (q = point mass). That is exact
    for any draft, however it was chosen (given x, the rule emits p), only less often accepted."""
    logits, drafts, draft_probs, params, q0, p0, p1 = draft_model_case(seed=8)
    out = verify(logits, drafts, [params] * N)
    assert chi_square_pvalue([([o[0] for o in out], p0)]) > ALPHA


# ---------------------------------------------------------------------------------------------
# Seeds, repetition penalty, argument checks


@pytest.mark.exercise("rejection-rule")
def test_seeded_sequences_reproduce_whatever_shares_the_batch():
    torch.manual_seed(6)
    V = 8
    params = SamplingParams(temperature=1.0, seed=42)
    rows = torch.randn(4, V)
    draft = rows[:3].argmax(-1).tolist()  # likely, but not certain, to be accepted

    def run(batch: str, steps: int = 30) -> list[list[int]]:
        g = make_generator(params.seed, "cpu")
        outs = []
        for _ in range(steps):
            if batch == "alone":
                outs.append(verify(rows, [draft], [params], [g])[0])
            else:  # an unseeded, a greedy and another seeded sequence around it
                others = torch.randn(7, V)
                together = torch.cat([others[:2], rows, others[2:3], others[3:]])
                out = verify(together, [[1], draft, [], [2, 3, 4]],
                             [SamplingParams(temperature=1.0), params, GREEDY, SamplingParams(seed=7)],
                             [None, g, None, make_generator(7, "cpu")])
                outs.append(out[1])
        return outs

    alone = run("alone")
    assert alone == run("alone")
    assert alone == run("in a batch")
    assert len({tuple(o) for o in alone}) > 3  # the draws really vary


def test_seeded_plain_decode_equals_sample():
    """No drafts: a seeded sequence draws exactly what `sample` draws, and gets the same token."""
    logits = torch.randn(1, 100)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    g_sample, g_verify = make_generator(3, "cpu"), make_generator(3, "cpu")
    by_sample = [sample(logits, [params], [g_sample]).item() for _ in range(20)]
    by_verify = [verify(logits, [[]], [params], [g_verify])[0][0] for _ in range(20)]
    assert by_sample == by_verify and len(set(by_sample)) > 3


def test_repetition_penalty_sees_the_drafts_before_each_row():
    """Row 1's raw favourite is the first draft b; penalized for b (a draft, not yet in `seen`),
    it loses to c. So the draft [b, c] is accepted whole only if row 1 sees b."""
    V, a, b, c = 6, 0, 1, 2
    rows = torch.full((3, V), -1.0)
    rows[0, b] = 3.0
    rows[1, b], rows[1, c] = 3.0, 2.5  # 3 / 2 = 1.5 < 2.5 once b is penalized
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    expected = [filtered_logits(rows[j][None], [params], [[a] + [b, c][:j]]).argmax().item() for j in range(3)]
    assert expected[:2] == [b, c]
    assert verify(rows, [[b, c]], [params], seen=[[a]]) == [[b, c, expected[2]]]
    assert verify(rows, [[b, c]], [params], seen=None) == [[b, b]]  # no seen, no penalty


def test_verify_rejects_misshapen_arguments():
    with pytest.raises(ValueError, match="logits must be"):
        verify(torch.randn(3, 5), [[1, 2], []], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="params"):
        verify(torch.randn(3, 5), [[1, 2]], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="draft_probs"):
        verify(torch.randn(3, 5), [[1, 2]], [SamplingParams()], draft_probs=[torch.rand(3, 5)])


# ---------------------------------------------------------------------------------------------
# Counting


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens_per_step(0.999999, 3) == pytest.approx(4.0, rel=1e-5)  # continuous at 1
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 2)


def test_spec_stats_count_a_step():
    stats = SpecStats()
    assert stats.acceptance_rate == 0.0 and stats.tokens_per_step == 0.0
    stats.add([[1, 2, 3], [], [4]], [[1, 2, 9], [5], [7]])
    assert (stats.num_proposed, stats.num_accepted, stats.num_emitted, stats.num_steps) == (4, 2, 5, 3)
    assert stats.acceptance_rate == 0.5
    assert stats.tokens_per_step == pytest.approx(5 / 3)
