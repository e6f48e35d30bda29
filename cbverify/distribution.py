"""Sampling-distribution test for engines with their own RNG (``hf-generate``, ``transformers-cb``).

Method. One sampled request is replicated ``num_samples`` times in a single ``generate`` call (each copy gets its own
draws from the engine's RNG). At every completion position ``j`` the copies are grouped by their prefix
``completion[:j]``; each prefix seen at least ``min_count`` times is a *node*, and the next tokens observed at a node
are an i.i.d. sample from the engine's conditional distribution there. That is compared with the reference's
processed distribution (``reference.generate.process_logits`` on the teacher-forced logits after that prefix) by a
chi-square goodness-of-fit test (``scipy.stats.chisquare``; rare tokens are pooled with their neighbours in
probability so every bin expects >= 5 counts and the chi-square approximation holds). A token the reference gives
probability 0 (outside the processed support: cut by top-k / top-p / min-p) observed even once makes the node's
p-value 0. Under a tier with logit noise (bf16: the engine's logits may differ from the reference's by a few units),
a token whose membership in the processed support can flip within that noise (``divergence.boundary_tokens``) is left
out of the node on both sides: its observations are dropped and the reference's distribution is renormalised over
the other tokens. Given that a draw is not a boundary token, both distributions are the same conditional one, so the
test stays exact; the dropped draws are counted (``NodeTest.at_cut``).

False alarms. All node p-values of one call (every position, prefix and request) form one family, corrected with
Holm-Bonferroni: the probability that a *correct* engine fails one call is <= ``alpha`` (default
``DISTRIBUTION_ALPHA``) whatever the
dependence between nodes. A test suite that makes ``m`` such calls has a false-alarm rate <= ``m * alpha`` (union
bound); Hypothesis' ``ci`` profile is derandomised and the engines are seeded, so a run is also reproducible.

Oracle: the reference's processed distribution (``reference.generate.process_logits``).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from scipy import stats

from cbverify.divergence import boundary_tokens
from cbverify.engines import Engine
from cbverify.tolerances import DISTRIBUTION_ALPHA, Tier
from reference import logprobs as ref_logprobs
from reference.generate import process_logits
from reference.spec import Rollout, RolloutRequest

MIN_EXPECTED = 5.0  # the usual validity condition of the chi-square approximation


@dataclass(frozen=True, slots=True)
class NodeTest:
    """One chi-square test: request, position, prefix, sample size, p-value, and the worst-fitting token."""

    request_id: str
    position: int
    prefix: tuple[int, ...]
    num_samples: int
    p_value: float
    worst_token: int
    observed: int
    expected: float
    bins: int = 0  # chi-square bins (1: the node can only catch a token outside the support)
    at_cut: int = 0  # draws of tokens at a processor cut within the tier's noise, left out of the test


@dataclass(frozen=True, slots=True)
class DistributionResult:
    """Holm-corrected outcome of all node tests; ``rejected`` lists the nodes that fail at family-wise ``alpha``."""

    alpha: float
    tests: tuple[NodeTest, ...]
    rejected: tuple[NodeTest, ...]

    @property
    def passed(self) -> bool:
        return not self.rejected

    def power(self) -> str:
        """The test's power on this model and config, in one line: per node, the smallest shift of the distribution
        (Cohen's w, the root of sum (p1 - p0)^2 / p0 over the bins) it detects with 80% probability at the strictest
        Holm level ``alpha / tests``; the best node's and the median node's, and how many nodes had one bin (a
        near-deterministic position: only a token outside the support can fail there)."""
        if not self.tests:
            return "no node test: no power"
        level = self.alpha / len(self.tests)
        ws = sorted(detectable_effect(t.num_samples, t.bins, level) for t in self.tests)
        single = sum(t.bins < 2 for t in self.tests)
        finite = [w for w in ws if w < math.inf]
        if not finite:
            return f"every one of {len(ws)} nodes has one bin: only tokens outside the support can fail"
        best, median = finite[0], finite[len(finite) // 2]
        return (
            f"80% power against a shift of w >= {best:.2f} at the best node, {median:.2f} at the median; {single} "
            "one-bin node(s)"
        )

    def describe(self) -> str:
        head = f"{len(self.tests)} node tests, Holm family-wise alpha {self.alpha:g}: {len(self.rejected)} rejected"
        at_cut = sum(t.at_cut for t in self.tests)
        lines = [f"{head}; {self.power()}" + (f"; {at_cut} draw(s) at a processor cut left out" if at_cut else "")]
        for t in self.rejected[:5]:
            lines.append(
                f"  request {t.request_id!r} position {t.position} prefix {list(t.prefix)}: p={t.p_value:.3g} "
                f"(n={t.num_samples}; token {t.worst_token} seen {t.observed}x, expected {t.expected:.1f})"
            )
        return "\n".join(lines)


def replicate(request: RolloutRequest, num_samples: int) -> list[RolloutRequest]:
    """``num_samples`` copies of a request with ids ``<id>#k`` and seeds ``seed + k`` (ignored by RNG engines)."""
    rid = request.request_id
    return [replace(request, request_id=f"{rid}#{k}", seed=request.seed + k) for k in range(num_samples)]


def chi_square_bins(expected: torch.Tensor) -> tuple[list[int], list[list[int]]]:
    """``(support, bins)`` for expected counts (V,): tokens in decreasing expected count (ties: lower id first), each
    bin closed once it expects >= MIN_EXPECTED (``float(expected[bin].sum())``); a short last bin is merged into the
    previous one. Frequent tokens get a bin each, rare ones are pooled with their neighbours.

    Linear in V: each bin's sum is kept as it grows, and torch is asked for the bin's sum only when that running sum
    is too close to MIN_EXPECTED to tell (:func:`_reaches`), so the bins are the ones the definition gives."""
    values = expected.tolist()  # float64 -> Python floats, exactly
    support = sorted((t for t, e in enumerate(values) if e > 0), key=lambda t: -values[t])
    bins: list[list[int]] = [[]]
    running = 0.0  # the open bin's expected count, summed in support order
    for t in support:
        if _reaches(expected, bins[-1], running):
            bins.append([])
            running = 0.0
        bins[-1].append(t)
        running += values[t]
    if len(bins) > 1 and not _reaches(expected, bins[-1], running):
        last = bins.pop()
        bins[-1] += last
    return support, bins


def _reaches(expected: torch.Tensor, tokens: list[int], running: float) -> bool:
    """``float(expected[tokens].sum()) >= MIN_EXPECTED``, given ``running``, the same non-negative terms summed in
    another order: two summation orders of n such terms differ by at most 2 (n - 1) eps of the sum (< 1e-9 of it for
    any vocabulary under a million), so torch's sum is computed only inside that margin of the threshold."""
    if abs(running - MIN_EXPECTED) > 1e-9 * max(running, MIN_EXPECTED):
        return running >= MIN_EXPECTED
    return float(expected[tokens].sum()) >= MIN_EXPECTED


def detectable_effect(num_samples: int, bins: int, level: float, power: float = 0.8) -> float:
    """The smallest effect (Cohen's w) a chi-square test of ``bins`` bins on ``num_samples`` samples detects with
    probability ``power`` at ``level``: the noncentrality n w^2 at which the noncentral chi-square passes the critical
    value that often; infinite for one bin (no chi-square test)."""
    from scipy.optimize import brentq

    if bins < 2 or num_samples < 1:
        return math.inf
    df = bins - 1
    critical = stats.chi2.isf(level, df)
    noncentrality = brentq(lambda lam: stats.ncx2.sf(critical, df, lam) - power, 1e-9, 1e7)
    return math.sqrt(noncentrality / num_samples)


def chi_square_node(observed: Counter, probs: torch.Tensor) -> tuple[float, int, int, float]:
    """``(p_value, worst_token, observed, expected)`` for counts ``observed`` against probabilities ``probs`` (V,)."""
    n = sum(observed.values())
    expected = probs.double().cpu() * n  # (V,)
    outside = [t for t in observed if expected[t] == 0]
    if outside:
        return 0.0, outside[0], observed[outside[0]], 0.0
    support, bins = chi_square_bins(expected)
    values = expected.tolist()  # exact: read once, not one tensor index per token
    f_obs = [float(sum(observed.get(t, 0) for t in b)) for b in bins]
    f_exp = [float(expected[b].sum()) for b in bins]
    residuals = {t: abs(observed.get(t, 0) - values[t]) / values[t] ** 0.5 for t in support}
    worst = max(residuals, key=residuals.get)
    if len(f_obs) < 2:
        return 1.0, worst, observed.get(worst, 0), float(expected[worst])
    scale = sum(f_obs) / sum(f_exp)  # remove float rounding so scipy's sum check passes
    p = float(stats.chisquare(f_obs, [e * scale for e in f_exp]).pvalue)
    return p, worst, observed.get(worst, 0), float(expected[worst])


def node_tests(model, request: RolloutRequest, samples: Sequence[Rollout], *, min_count: int,
               tier: Tier | None = None) -> list[NodeTest]:  # fmt: skip
    """Chi-square tests at every (position, prefix) node visited by at least ``min_count`` samples; with ``tier``,
    tokens at a processor cut within its noise are left out on both sides (module docstring)."""
    if request.sampling.greedy:
        raise ValueError("the distribution test is for sampled requests; greedy tokens are compared exactly")
    nodes: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for rollout in samples:
        for j, token in enumerate(rollout.completion_ids):
            nodes[rollout.completion_ids[:j]][token] += 1
    tests = []
    for prefix, counts in sorted(nodes.items(), key=lambda kv: (len(kv[0]), kv[0])):
        if sum(counts.values()) < min_count:
            continue
        logits = ref_logprobs.completion_logits(model, request.prompt_ids, [*prefix, 0])[-1].cpu()  # (V,)
        probs = process_logits(logits, request.sampling).exp()  # (V,), processed on the host: no per-op device sync
        at_cut = 0
        if tier is not None:
            noise = tier.near_tie_gap / 2 * tier.unit(float(logits.abs().max()))  # logit units, as compare's
            edge = boundary_tokens(logits, request.sampling, noise)  # (V,)
            if bool(edge.any()):
                at_cut = sum(c for t, c in counts.items() if edge[t])
                counts = Counter({t: c for t, c in counts.items() if not edge[t]})
                probs = probs.masked_fill(edge, 0.0)
                probs = probs / probs.sum() if float(probs.sum()) > 0 else probs
                if sum(counts.values()) < min_count:
                    continue
        p, worst, obs, exp = chi_square_node(counts, probs)
        n = sum(counts.values())
        bins = len(chi_square_bins(probs.double().cpu() * n)[1])
        tests.append(NodeTest(request.request_id, len(prefix), prefix, n, p, worst, obs, exp, bins, at_cut))
    return tests


def holm(tests: Sequence[NodeTest], alpha: float) -> tuple[NodeTest, ...]:
    """Holm-Bonferroni step-down: the tests rejected at family-wise error rate ``alpha``."""
    ordered = sorted(tests, key=lambda t: t.p_value)
    rejected = []
    for rank, test in enumerate(ordered):
        if test.p_value > alpha / (len(ordered) - rank):
            break
        rejected.append(test)
    return tuple(rejected)


def distribution_test(
    engine: Engine,
    model,
    requests: Sequence[RolloutRequest],
    *,
    num_samples: int = 200,
    min_count: int = 50,
    alpha: float = DISTRIBUTION_ALPHA,
    tier: Tier | None = None,
) -> DistributionResult:
    """Sample each (sampled) request ``num_samples`` times through ``engine`` in one call, test every node, Holm;
    ``tier``: leave out the tokens at a processor cut within its noise (module docstring)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if num_samples < min_count:
        raise ValueError(f"num_samples ({num_samples}) < min_count ({min_count}): nothing would be tested")
    batch = [copy for request in requests for copy in replicate(request, num_samples)]
    rollouts = engine.generate(batch)
    tests: list[NodeTest] = []
    for k, request in enumerate(requests):
        tests += node_tests(model, request, rollouts[k * num_samples : (k + 1) * num_samples], min_count=min_count,
                            tier=tier)  # fmt: skip
    return DistributionResult(alpha, tuple(tests), holm(tests, alpha))
