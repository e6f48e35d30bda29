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
the null is the *set* of processed distributions within that noise of the reference's, cut boundaries included
(:func:`noise_bounds`): with ``d`` the tier's per-logit noise divided by T, a kept token's weight may move by
``e^(±d)``, a token whose membership in the processed support can flip within the noise
(``divergence.boundary_tokens``) anywhere from 0 to its kept weight times ``e^d``, and the weights are renormalised
together (a top-p / min-p cut moving changes the kept mass for every token). A node's statistic is the smallest over
that set (:func:`min_chi_square_box`, exact: a convex problem), whose p-value bounds that of the engine's true
distribution, so a correct engine's false-alarm rate stays <= alpha at any sample size. The draws of tokens at a cut
are counted (``NodeTest.at_cut``). Power is lost only against faults whose effect stays inside the tier's noise;
``python -m property_tests.measure_distribution`` measures both (docs/guide.md has the numbers).

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
from cbverify.engines import Engine, declared_processing
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


def min_chi_square(f_obs: Sequence[float], masses: Sequence[float], shift: float) -> float:
    """The smallest Pearson statistic ``sum (o_b - n q_b)^2 / (n q_b)`` over every bin distribution ``q`` within
    ``shift`` of ``masses`` (``m``): ``q_b ∝ m_b e^(δ_b)`` with ``|δ_b| <= shift``, what noise of up to ``shift`` on
    each score of a bin's tokens can make of it (a bin's mass is a weighted mean of its tokens' ``e^δ``).
    :func:`min_chi_square_box` with weights in ``[m_b e^-shift, m_b e^shift]``; ``shift == 0``: the plain statistic."""
    if shift <= 0:
        m = [x / sum(masses) for x in masses]
        n = sum(f_obs)
        return sum((o - n * q) ** 2 / (n * q) for o, q in zip(f_obs, m, strict=True))
    lo = [x * math.exp(-shift) for x in masses]
    return min_chi_square_box(f_obs, lo, [x * math.exp(shift) for x in masses])


def min_chi_square_box(f_obs: Sequence[float], lo: Sequence[float], hi: Sequence[float]) -> float:
    """The smallest Pearson statistic over every bin distribution ``q_b = w_b / sum(w)`` with each weight ``w_b`` in
    ``[lo_b, hi_b]`` (``0 <= lo_b <= hi_b``, ``hi_b > 0``; ``lo_b = 0``: the bin's tokens may all be cut).

    That set is ``{q in the simplex: lo_b s <= q_b <= hi_b s for all b, some s > 0}``, convex in ``(q, s)`` jointly,
    and the statistic is convex in ``q``: for fixed ``s`` the minimum over the box ``∩`` simplex is a separable convex
    problem (KKT: ``q_b = clip(o_b / sqrt(n (n - λ)), lo_b s, hi_b s)``, ``λ`` found by bisection so ``sum q = 1``),
    and that minimum is convex in ``s`` (a convex function minimised over a convex set's slices), so a golden-section
    search over ``s`` (where the box meets the simplex) finds the global one."""
    import numpy as np

    o = np.asarray(f_obs, dtype=np.float64)
    lo_w, hi_w = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    n = float(o.sum())

    def stat(q):
        safe = np.where(q > 0, q, 1.0)
        terms = np.where(q > 0, (o - n * q) ** 2 / (n * safe), np.where(o > 0, np.inf, 0.0))
        return float(terms.sum())

    def inner(s: float) -> float:
        lo_q, hi_q = lo_w * s, hi_w * s
        if lo_q.sum() >= 1:
            return stat(lo_q / lo_q.sum())
        if hi_q.sum() <= 1:
            return stat(hi_q / hi_q.sum())

        def q_of(lam):  # lam < n; increasing in lam
            return np.clip(o / math.sqrt(n * (n - lam)), lo_q, hi_q)

        a = -1.0
        while q_of(a).sum() > 1:
            a *= 2
        step = 1.0
        while q_of(n - step).sum() < 1 and step > 1e-300:
            step /= 4
        b = n - step
        for _ in range(200):
            mid = (a + b) / 2
            if q_of(mid).sum() < 1:
                a = mid
            else:
                b = mid
            if b - a <= 1e-12 * max(1.0, abs(a)):
                break
        q = q_of((a + b) / 2)
        return stat(q / q.sum())

    x = -math.log(hi_w.sum())  # log s: the box reaches the simplex from s = 1 / sum(hi) ...
    y = -math.log(max(lo_w.sum(), hi_w.sum() * 1e-12))  # ... to s = 1 / sum(lo) (any s when every lo is 0)
    if y - x <= 1e-15:
        return inner(math.exp(x))
    g = (math.sqrt(5) - 1) / 2  # a monotone map of s keeps a convex function unimodal: search log s
    c, d = y - g * (y - x), x + g * (y - x)
    fc, fd = inner(math.exp(c)), inner(math.exp(d))
    for _ in range(100):
        if fc <= fd:
            y, d, fd = d, c, fc
            c = y - g * (y - x)
            fc = inner(math.exp(c))
        else:
            x, c, fc = c, d, fd
            d = x + g * (y - x)
            fd = inner(math.exp(d))
    return min(fc, fd, inner(math.exp(x)), inner(math.exp(y)))


def chi_square_node(
    observed: Counter, probs: torch.Tensor, shift: float = 0.0, bounds: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[float, int, int, float]:
    """``(p_value, worst_token, observed, expected)`` for counts ``observed`` against probabilities ``probs`` (V,).
    ``shift``: the null is every distribution whose scores lie within ``shift`` of ``probs``' (a tier's logit noise,
    divided by T); ``bounds``: ``(lo, hi)`` (V,) each, the null is every ``w / sum(w)`` with ``lo <= w <= hi``
    token-wise (``probs`` then only sets the bins). Either way the p-value is that of the smallest statistic over the
    null set (:func:`min_chi_square_box`), a valid test of it (the true distribution's statistic is never below
    the smallest)."""
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
    if bounds is not None or shift > 0:
        if bounds is None:
            lo, hi = probs.double() * math.exp(-shift), probs.double() * math.exp(shift)
        else:
            lo, hi = (x.double().cpu() for x in bounds)
        stat = min_chi_square_box(f_obs, [float(lo[b].sum()) for b in bins], [float(hi[b].sum()) for b in bins])
        return float(stats.chi2.sf(stat, len(f_obs) - 1)), worst, observed.get(worst, 0), float(expected[worst])
    scale = sum(f_obs) / sum(f_exp)  # remove float rounding so scipy's sum check passes
    p = float(stats.chisquare(f_obs, [e * scale for e in f_exp]).pvalue)
    return p, worst, observed.get(worst, 0), float(expected[worst])


def noise_bounds(logits: torch.Tensor, sampling, noise: float,
                 process=process_logits) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(basis, lo, hi)`` (V,) each: the set of processed distributions within ``noise`` per logit of ``logits``'
    under ``sampling``, cut boundaries included, as token weights: a kept token's weight ``v`` (its processed
    probability) may move to ``v e^(±d)`` (``d = noise / T``), a token at a cut (``divergence.boundary_tokens``) to
    anything in ``[0, v e^d]`` (``v``: its probability after temperature over the reference's kept mass, as if the
    cut had kept it; a kept one may be cut), every other token stays at 0. ``basis``: ``v`` normalised, the
    reference's distribution extended to the cut tokens, from which the bins are built. The set holds every
    ``process(logits + ε)``, ``|ε| <= noise`` (a kept set changes only by cut tokens, and the renormalisation is the
    common ``sum(w)``); it is larger where the cuts' choices are tied, so the test stays valid. ``process``: a
    declared deviation's processing instead of the spec's (its cut tokens are still found by the spec's processors)."""
    from reference.generate import apply_temperature

    d = noise / sampling.temperature
    processed = process(logits, sampling).exp().double()  # (V,)
    kept = processed > 0  # (V,)
    full = torch.softmax(apply_temperature(logits.double(), sampling.temperature), dim=-1)  # (V,)
    v = torch.where(kept, processed, full / full[kept].sum())  # (V,)
    edge = boundary_tokens(logits, sampling, noise)  # (V,)
    member = kept | edge  # (V,)
    v = torch.where(member, v, torch.zeros_like(v))
    lo = torch.where(kept & ~edge, v * math.exp(-d), torch.zeros_like(v))
    return v / v.sum(), lo, v * math.exp(d)


def node_tests(model, request: RolloutRequest, samples: Sequence[Rollout], *, min_count: int, tier: Tier | None = None,
               within_noise: bool = True, process=process_logits) -> list[NodeTest]:  # fmt: skip
    """Chi-square tests at every (position, prefix) node visited by at least ``min_count`` samples; with ``tier``,
    the null is every distribution within its noise of the reference's, cut boundaries included (:func:`noise_bounds`;
    ``NodeTest.at_cut`` counts the draws of tokens at a cut). ``within_noise=False``: the earlier test, the cut's
    tokens left out on both sides and the reference's distribution over the others, for measuring against it."""
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
        probs = process(logits, request.sampling).exp()  # (V,), processed on the host: no per-op device sync
        at_cut, bounds = 0, None
        if tier is not None:
            noise = tier.near_tie_gap / 2 * tier.unit(float(logits.abs().max()))  # logit units, as compare's
            edge = boundary_tokens(logits, request.sampling, noise)  # (V,)
            at_cut = sum(c for t, c in counts.items() if edge[t])
            if within_noise:  # the null: every distribution within the noise, cut tokens in or out
                probs, lo, hi = noise_bounds(logits, request.sampling, noise, process)
                bounds = (lo, hi)
            elif bool(edge.any()):  # the cut's tokens left out on both sides, the reference's distribution otherwise
                counts = Counter({t: c for t, c in counts.items() if not edge[t]})
                probs = probs.masked_fill(edge, 0.0)
                probs = probs / probs.sum() if float(probs.sum()) > 0 else probs
                if sum(counts.values()) < min_count:
                    continue
        p, worst, obs, exp = chi_square_node(counts, probs, bounds=bounds)
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
    ``tier``: leave out the tokens at a processor cut within its noise (module docstring). A request in the domain of
    a deviation the engine declares is tested against that deviation's distribution
    (``cbverify.engines.declared_processing``)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if num_samples < min_count:
        raise ValueError(f"num_samples ({num_samples}) < min_count ({min_count}): nothing would be tested")
    batch = [copy for request in requests for copy in replicate(request, num_samples)]
    rollouts = engine.generate(batch)
    tests: list[NodeTest] = []
    for k, request in enumerate(requests):
        declared = getattr(getattr(engine, "capabilities", None), "deviations", ())
        _, process = declared_processing(declared, request.sampling)
        tests += node_tests(model, request, rollouts[k * num_samples : (k + 1) * num_samples], min_count=min_count,
                            tier=tier, process=process)  # fmt: skip
    return DistributionResult(alpha, tuple(tests), holm(tests, alpha))
