"""The sampling-distribution test's own contracts (``cbverify.distribution``): the replicated requests, the binning and
p-value of one node (``chi_square_node``), which nodes are tested and what they report (``node_tests``), the Holm
step-down (``holm``) and ``distribution_test``'s defaults and argument checks, on hand-made counts, a stand-in model
whose logits are a fixed table and a scripted engine (no real model runs).

Expected values are computed independently: the bins of each case are worked out by hand in its comment (tokens in
decreasing expected count, a bin closes once it expects >= 5, a short last bin joins the previous one) and their
p-value is ``scipy.stats.chisquare`` applied directly to them; the worst token is the largest Pearson residual
``|o - e| / sqrt(e)`` in plain ``math``; Holm's rejections are those of closed testing with Bonferroni local tests,
brute-forced over every subset.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import combinations

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from scipy import stats

from cbverify import distribution
from cbverify.distribution import NodeTest, chi_square_node, holm, node_tests
from cbverify.tolerances import DISTRIBUTION_ALPHA
from property_tests.helpers import TableModel
from reference.spec import Rollout, RolloutRequest, SamplingParams

PROMPT = (1, 2)
P = [0.1, 0.5, 0.4]  # the processed distribution of the stand-in model at every position; token 3 is cut by top-k
SAMPLING = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3)


def table_model() -> TableModel:
    """A stand-in causal LM whose logits are the same row at every position: log(P) and, for token 3, a logit below
    all of them (raw probability ~0.05), so top-k 3 keeps exactly P."""
    return TableModel(torch.log(torch.tensor([*P, 0.05])).expand(16, -1))  # rows: prompt + longest prefix + 1 <= 16


class ScriptedEngine:
    """Copy ``k`` of the batch gets completion ``plan[k % len(plan)]``; records the batches it is asked for."""

    name = "scripted"

    def __init__(self, plan) -> None:
        self.plan, self.batches = plan, []

    def generate(self, requests):
        self.batches.append(list(requests))
        plans = [self.plan[k % len(self.plan)] for k in range(len(requests))]
        return [
            Rollout(r.request_id, r.prompt_ids, c, [0.0] * len(c), "length")
            for r, c in zip(requests, plans, strict=True)
        ]


def _probs(p) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.float32)


def test_replicated_copies_get_numbered_ids_and_consecutive_seeds_and_keep_everything_else():
    request = RolloutRequest("q", PROMPT, SAMPLING, seed=7, eos_token_ids=(3,))
    copies = distribution.replicate(request, 3)
    assert [(c.request_id, c.seed) for c in copies] == [("q#0", 7), ("q#1", 8), ("q#2", 9)]
    assert all((c.prompt_ids, c.sampling, c.eos_token_ids) == (PROMPT, SAMPLING, (3,)) for c in copies)


def test_a_token_outside_the_support_observed_even_once_gives_p_zero_and_is_reported_with_expected_zero():
    assert chi_square_node(Counter({0: 10, 3: 1}), _probs([0.5, 0.5, 0.0, 0.0])) == (0.0, 3, 1, 0.0)


# (probs, observed, hand-made bins as token lists or None for one bin, worst token); n = sum(observed).
NODE_CASES = {
    # e = [5, 5, 5, 5]: every token closes its own bin at exactly 5, and a last bin of exactly 5 stays alone.
    "four-bins-of-exactly-five": ([0.25] * 4, {0: 9, 1: 5, 2: 4, 3: 2}, [[0], [1], [2], [3]], 0),
    # e = [12, 10, 8, 3, 3, 2, 2]: [0] [1] [2] [3, 4] (3 + 3 = 6) then [5, 6] expects 4, so joins [3, 4].
    # Residuals: 8/sqrt(12) = 2.31 is the largest (then 4/sqrt(8) = 1.41).
    "short-last-bin-joins-the-previous": (
        [0.3, 0.25, 0.2, 0.075, 0.075, 0.05, 0.05],
        {0: 20, 1: 8, 2: 4, 3: 1, 4: 2, 5: 3, 6: 2},
        [[0], [1], [2], [3, 4, 5, 6]],
        0,
    ),
    # e = [16, 4]: [0] then [1] expects 4 and joins it: one bin, no test. Residuals 7/4 < 7/2: token 1.
    "two-tokens-one-bin": ([0.8, 0.2], {0: 9, 1: 11}, None, 1),
    # e = [1.5, 0.5]: one bin expecting 2. Residuals 0.5/sqrt(1.5) = 0.41 < 0.5/sqrt(0.5) = 0.71: unseen token 1.
    "fewer-than-five-expected-in-all": ([0.75, 0.25], {0: 2}, None, 1),
    # e = [10, 9, 1]: [0] [1, 2]. Residuals 1/sqrt(10) = 0.32, 0, and 1/sqrt(1) = 1 for the unseen token 2.
    "unseen-rare-token-is-worst": ([0.5, 0.45, 0.05], {0: 11, 1: 9}, [[0], [1, 2]], 2),
    # e = [4, 16, 20]: [2] [1] then [0] expects 4 and joins [1]. Residuals 2/2 = 1, 5/4 = 1.25, 3/sqrt(20) = 0.67:
    # token 1 (by |o - e| / e it would be token 0).
    "pearson-residual-not-relative-error": ([0.1, 0.4, 0.5], {0: 6, 1: 11, 2: 23}, [[2], [1, 0]], 1),
}


@pytest.mark.parametrize("case", list(NODE_CASES))
def test_a_bin_is_closed_once_it_expects_at_least_five_counts_and_a_short_last_bin_joins_the_previous_one(case):
    probs, observed, bins, _ = NODE_CASES[case]
    n = sum(observed.values())
    p_value = chi_square_node(Counter(observed), _probs(probs))[0]
    if bins is None:
        assert p_value == 1.0, "a single bin is no test: the node passes"
    else:
        f_obs = [sum(observed.get(t, 0) for t in b) for b in bins]
        f_exp = [n * sum(probs[t] for t in b) for b in bins]
        assert p_value == pytest.approx(stats.chisquare(f_obs, f_exp).pvalue, rel=1e-6)


@pytest.mark.parametrize("case", list(NODE_CASES))
def test_the_reported_token_has_the_largest_pearson_residual_with_its_observed_and_expected_counts(case):
    probs, observed, _, worst = NODE_CASES[case]
    n = sum(observed.values())
    _, got_worst, got_observed, got_expected = chi_square_node(Counter(observed), _probs(probs))
    assert (got_worst, got_observed) == (worst, observed.get(worst, 0))
    assert got_expected == pytest.approx(n * probs[worst], rel=1e-6)


@given(
    weights=st.lists(st.integers(1, 20), min_size=1, max_size=8),
    counts=st.lists(st.integers(0, 15), min_size=8, max_size=8),
)
def test_the_worst_token_maximises_the_residual_and_fewer_than_ten_samples_never_make_a_test(weights, counts):
    probs = [w / sum(weights) for w in weights]
    observed = Counter({t: c for t, c in enumerate(counts[: len(weights)]) if c})
    if not observed:
        observed[0] = 1
    n = sum(observed.values())
    p_value, worst, seen, expected = chi_square_node(observed, _probs(probs))
    exp = [n * float(_probs(probs)[t]) for t in range(len(probs))]
    residual = [abs(observed[t] - exp[t]) / math.sqrt(exp[t]) for t in range(len(probs))]
    assert residual[worst] == pytest.approx(max(residual), rel=1e-12)
    assert (seen, expected) == (observed[worst], pytest.approx(exp[worst], rel=1e-12))
    assert 0.0 <= p_value <= 1.0
    if n < 10:  # two bins of >= 5 each need >= 10 expected counts
        assert p_value == 1.0


def _samples(*groups) -> list[Rollout]:
    return [Rollout("r", PROMPT, c, [0.0] * len(c), "length") for count, c in groups for _ in range(count)]


def test_nodes_seen_at_least_min_count_times_are_tested_in_order_of_position_then_prefix_with_their_report():
    # Prefixes first seen in the order (), (2,), (1,), (1, 2), (0,); (0,) is seen 5 times, (2,) exactly min_count.
    samples = _samples((25, (2, 3)), (30, (1, 2, 0)), (5, (0, 1)))
    tests = node_tests(table_model(), RolloutRequest("r", PROMPT, SAMPLING), samples, min_count=25)
    got = [(t.request_id, t.position, t.prefix, t.num_samples, t.worst_token, t.observed) for t in tests]
    assert got == [
        # {0: 5, 1: 30, 2: 25} vs e = [6, 30, 24]: residuals 1/sqrt(6) = 0.41, 0, 1/sqrt(24) = 0.20
        ("r", 0, (), 60, 0, 5),
        # {2: 30} vs e = [3, 15, 12]: residuals 3/sqrt(3) = 1.73, 15/sqrt(15) = 3.87, 18/sqrt(12) = 5.20
        ("r", 1, (1,), 30, 2, 30),
        ("r", 1, (2,), 25, 3, 25),  # token 3 is cut by top-k: outside the support
        # {0: 30} vs e = [3, 15, 12]: residuals 27/sqrt(3) = 15.6, 15/sqrt(15), 12/sqrt(12)
        ("r", 2, (1, 2), 30, 0, 30),
    ]
    assert [t.expected for t in tests] == pytest.approx([6.0, 12.0, 0.0, 3.0], rel=1e-5)
    # Bins: e = [6, 30, 24] -> [1] [2] [0]; e = [3, 15, 12] -> [1] [2, 0] (3 < 5 joins 12).
    want = [stats.chisquare([30, 25, 5], [30, 24, 6]).pvalue, stats.chisquare([0, 30], [15, 15]).pvalue, 0.0]
    assert [t.p_value for t in tests] == pytest.approx([want[0], want[1], 0.0, want[1]], rel=1e-5, abs=1e-300)
    with pytest.raises(ValueError, match="for sampled requests; greedy tokens are compared exactly"):
        node_tests(table_model(), RolloutRequest("r", PROMPT, SamplingParams(temperature=0.0)), samples, min_count=1)


def _closed_bonferroni(p_values: list[float], alpha: float) -> set[int]:
    """Closed testing with Bonferroni local tests (Holm's step-down is its shortcut): H_i falls iff every
    intersection H_S with i in S falls, i.e. min_{j in S} p_j <= alpha / |S|."""
    m = range(len(p_values))
    subsets = [s for r in range(1, len(p_values) + 1) for s in combinations(m, r)]
    return {i for i in m if all(min(p_values[j] for j in s) <= alpha / len(s) for s in subsets if i in s)}


A = 0.05
BOUNDARY = st.integers(1, 6).map(lambda k: A / k)  # p-values exactly at a Holm threshold


@given(p_values=st.lists(st.one_of(st.floats(0.0, 1.0), BOUNDARY, st.sampled_from([0.0, 1e-4])), max_size=6))
@example(p_values=[A])  # exactly at its threshold: rejected
@example(p_values=[A / 2, A])  # both exactly at their thresholds alpha/2 then alpha: both rejected
@example(p_values=[0.04, 0.04])  # 0.04 > alpha/2: the step-down stops at once, nothing rejected
def test_holm_rejects_exactly_what_closed_testing_with_bonferroni_rejects_smallest_p_value_first(p_values):
    tests = [NodeTest("r", i, (), 50, p, 0, 0, 0.0) for i, p in enumerate(p_values)]
    rejected = holm(tests, A)
    assert all(isinstance(t, NodeTest) for t in rejected)
    assert {t.position for t in rejected} == _closed_bonferroni(p_values, A)
    assert [t.p_value for t in rejected] == sorted(t.p_value for t in rejected)


PLAN = [(1,)] * 5 + [(2,)] * 4 + [(0,)]  # exactly P: a correct engine
REQUEST = RolloutRequest("q", PROMPT, SAMPLING, seed=5)


def test_by_default_each_request_is_sampled_two_hundred_times_and_a_node_seen_fifty_times_is_tested():
    engine = ScriptedEngine(PLAN)
    result = distribution.distribution_test(engine, table_model(), [REQUEST])
    (batch,) = engine.batches
    assert [r.request_id for r in batch] == [f"q#{k}" for k in range(200)]
    assert result.alpha == DISTRIBUTION_ALPHA and result.passed
    assert [(t.prefix, t.num_samples) for t in result.tests] == [((), 200)]
    result = distribution.distribution_test(ScriptedEngine(PLAN), table_model(), [REQUEST], num_samples=50)
    (test,) = result.tests  # {1: 25, 2: 20, 0: 5} = 50 P exactly
    assert (test.prefix, test.num_samples, test.p_value) == ((), 50, pytest.approx(1.0))


def test_a_sample_outside_the_support_is_rejected_at_the_given_alpha_and_num_samples_may_equal_min_count():
    engine = ScriptedEngine([(3,), *PLAN[1:]])  # one copy in ten draws the cut token 3
    result = distribution.distribution_test(engine, table_model(), [REQUEST], num_samples=30, min_count=30, alpha=0.2)
    assert result.alpha == 0.2 and [t.worst_token for t in result.rejected] == [3]


class MustNotRun:
    def generate(self, requests):
        raise AssertionError("arguments are checked before anything is sampled")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"alpha": 0.0}, r"alpha must be in \(0, 1\), got 0.0"), ({"alpha": 1.0}, r"alpha must be in \(0, 1\), got 1.0"),
     ({"alpha": 1.5}, r"alpha must be in \(0, 1\), got 1.5"),
     ({"num_samples": 49}, r"num_samples \(49\) < min_count \(50\): nothing would be tested")],
)  # fmt: skip
def test_alpha_outside_the_open_unit_interval_or_fewer_samples_than_min_count_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        distribution.distribution_test(MustNotRun(), table_model(), [REQUEST], **kwargs)


@pytest.mark.parametrize(("n", "bins"), [(60, 2), (200, 4), (500, 8)])
def test_the_stated_power_is_what_a_simulated_chi_square_test_achieves(n, bins):
    """``detectable_effect`` says which shift the test catches 80% of the time; simulate it: draw ``n`` samples from a
    distribution shifted by exactly that Cohen's w away from uniform ``bins`` bins, run scipy's chi-square test at the
    same level, and count rejections over 4,000 runs (80% +- 3%, a 5-sigma band)."""
    import math

    import numpy as np
    from scipy import stats

    from cbverify.distribution import detectable_effect

    level = 1e-3 / 10
    w = detectable_effect(n, bins, level)
    p0 = np.full(bins, 1 / bins)
    direction = np.array([1.0] * (bins // 2) + [-1.0] * (bins - bins // 2))
    direction -= direction.mean()
    direction /= math.sqrt(((direction**2) / p0).sum())  # unit Cohen's w
    p1 = p0 + w * direction
    assert (p1 > 0).all() and abs(math.sqrt((((p1 - p0) ** 2) / p0).sum()) - w) < 1e-9
    rng = np.random.default_rng(0)
    counts = rng.multinomial(n, p1, size=4000)
    rejected = stats.chisquare(counts, n * p0, axis=1).pvalue <= level
    assert abs(rejected.mean() - 0.8) <= 0.03, (w, rejected.mean())
    assert detectable_effect(n, 1, level) == math.inf


def _brute_min_chi_square(f_obs, masses, shift, starts: int = 12) -> float:
    """The smallest Pearson statistic over ``q ∝ m e^δ``, ``|δ| <= shift``, by scipy's bounded L-BFGS-B from the
    centre and from random corners of the box (an independent optimiser on another parametrisation)."""
    import numpy as np
    from scipy.optimize import minimize

    o, m = np.asarray(f_obs, float), np.asarray(masses, float) / sum(masses)
    n = o.sum()

    def stat(delta):
        q = m * np.exp(delta)
        q = q / q.sum()
        return float(np.sum((o - n * q) ** 2 / (n * q)))

    rng = np.random.default_rng(0)
    best = stat(np.zeros(len(m)))
    for k in range(starts):
        x0 = np.zeros(len(m)) if k == 0 else rng.choice([-shift, shift], len(m))
        best = min(best, minimize(stat, x0, bounds=[(-shift, shift)] * len(m), method="L-BFGS-B").fun)
    return best


@given(
    masses=st.lists(st.floats(0.01, 1.0), min_size=2, max_size=6),
    counts=st.lists(st.integers(0, 80), min_size=6, max_size=6),
    shift=st.sampled_from([0.0, 1e-3, 0.05, 0.3, 1.0]),
)
def test_the_smallest_statistic_within_the_noise_is_the_global_minimum_over_that_set(masses, counts, shift):
    """``min_chi_square`` against scipy: at shift 0 the plain statistic; otherwise no point of the set (the box's
    centre and corners) is below it, and a bounded multi-start optimiser finds no lower value (1e-6 relative)."""
    f_obs = [float(c) for c in counts[: len(masses)]]
    assume(sum(f_obs) > 0)
    got = distribution.min_chi_square(f_obs, masses, shift)
    m = [x / sum(masses) for x in masses]
    plain = float(stats.chisquare(f_obs, [x * sum(f_obs) for x in m]).statistic)
    if shift == 0:
        assert got == pytest.approx(plain, rel=1e-9)
        return
    assert got <= plain * (1 + 1e-9)
    brute = _brute_min_chi_square(f_obs, m, shift)
    assert brute * (1 - 1e-6) - 1e-9 <= got <= brute * (1 + 1e-6) + 1e-9


@given(
    masses=st.lists(st.floats(0.02, 1.0), min_size=2, max_size=6),
    signs=st.lists(st.floats(-1.0, 1.0), min_size=6, max_size=6),
    shift=st.sampled_from([0.01, 0.2, 0.7]),
)
def test_counts_of_a_distribution_inside_the_noise_give_zero_and_one_just_outside_does_not(masses, signs, shift):
    """Counts exactly ``n q`` for ``q ∝ m e^δ``: zero statistic when ``|δ| <= shift``; when the same direction is
    stretched to 1.5x the set's reach (a pair of bins 3 shift apart in log ratio) the statistic is positive."""
    import numpy as np

    m = np.asarray(masses) / sum(masses)
    delta = np.asarray(signs[: len(m)])
    assume(delta.max() - delta.min() > 0.5)
    delta = (delta - (delta.max() + delta.min()) / 2) / (delta.max() - delta.min()) * 2  # range exactly [-1, 1]
    for scale, inside in ((shift, True), (1.5 * shift, False)):
        q = m * np.exp(scale * delta)
        f_obs = list(1e4 * q / q.sum())
        got = distribution.min_chi_square(f_obs, list(m), shift)
        assert (got < 1e-6) if inside else (got > 1e-6), (scale, got)


def test_a_node_under_a_tier_judges_against_every_distribution_within_its_noise():
    """The stand-in model's P = [0.1, 0.5, 0.4] at T = 1; a tier whose noise is 0.1 per logit (``near_tie_gap`` 0.2 in
    float32's absolute units). Counts from P with token 1's score raised by 0.15 (ratios to the others moved by 0.15 <=
    2 x 0.1): fails the plain test at 20,000 draws, passes under the tier; raised by 0.45 (beyond 0.2): fails both."""
    from dataclasses import replace

    from cbverify.tolerances import FP32

    tier = replace(FP32, near_tie_gap=0.2)
    request = RolloutRequest("r", PROMPT, SAMPLING)
    for raise_by, passes in ((0.15, True), (0.45, False)):
        q = torch.tensor(P, dtype=torch.float64) * torch.tensor([1.0, math.exp(raise_by), 1.0])
        q = q / q.sum()
        counts = [round(20000 * float(x)) for x in q]
        samples = _samples(*((c, (t,)) for t, c in enumerate(counts)))
        (plain,) = node_tests(table_model(), request, samples, min_count=50)
        (judged,) = node_tests(table_model(), request, samples, min_count=50, tier=tier)
        (cut_only,) = node_tests(table_model(), request, samples, min_count=50, tier=tier, within_noise=False)
        assert plain.p_value < 1e-6 and cut_only.p_value < 1e-6
        assert (judged.p_value > 0.5) if passes else (judged.p_value < 1e-6), (raise_by, judged)
