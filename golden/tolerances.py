"""Golden tolerances, each set from measured noise with the reason beside it, and the token-divergence rule.

Two numbers per comparison, as in TRL's invariant tests: ``max_abs`` bounds the worst point-wise |Δ| and
``mean_drift`` bounds |mean Δ| over all positions, which flags a systematic one-sided shift that stays point-wise
small.

Noise measured on this repo's CPU (AMD EPYC, AVX512, torch 2.13.0+cpu, transformers 5.24.0), bundled models, all golden
cases, by ``python -m golden.measure_noise`` (numbers in golden/README.md):
# NOISE-TABLE (filled from measurement)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference import generate as ref_generate
from reference import logprobs as ref_logprobs
from reference.spec import RolloutRequest, gumbel_noise

NEAR_TIE = 1e-4  # DESIGN §4: an fp32 token divergence is accepted only when the two decision scores are this close


@dataclass(frozen=True, slots=True)
class Tolerance:
    max_abs: float
    mean_drift: float
    reason: str

    def __post_init__(self) -> None:
        if not (self.max_abs > 0 and self.mean_drift > 0):
            raise ValueError(f"tolerances must be > 0, got max_abs={self.max_abs}, mean_drift={self.mean_drift}")
        if self.mean_drift > self.max_abs:
            raise ValueError("mean_drift > max_abs can never bind; make it tighter")


# The reference re-run against its own golden (teacher-forced and re-generated log-probs).
REFERENCE: dict[str, Tolerance] = {
    "float32": Tolerance(1e-5, 2e-6, "PLACEHOLDER"),
    "bfloat16": Tolerance(5e-2, 1e-2, "PLACEHOLDER"),
    "float16": Tolerance(5e-2, 1e-2, "PLACEHOLDER"),
}

# Another engine's sampling log-probs against the golden (recorded by the reference) on the common token prefix.
ENGINE: dict[str, Tolerance] = {
    "float32": Tolerance(1e-5, 2e-6, "PLACEHOLDER"),
    "bfloat16": Tolerance(5e-2, 1e-2, "PLACEHOLDER"),
    "float16": Tolerance(5e-2, 1e-2, "PLACEHOLDER"),
}

# The 5-step GRPO trajectory (float32 only), per metric.
TRAJECTORY: dict[str, Tolerance] = {
    "loss": Tolerance(1e-5, 5e-6, "PLACEHOLDER"),
    "grad_norm": Tolerance(1e-4, 5e-5, "PLACEHOLDER"),
    "mean_reward": Tolerance(1e-9, 1e-9, "exact: rewards are 0/1 from identical tokens; any change is a token change"),
}


def engine_tolerance(engine: str, dtype: str) -> Tolerance:
    return REFERENCE[dtype] if engine == "reference" else ENGINE[dtype]


def first_divergence(golden: list[int] | tuple[int, ...], actual: list[int] | tuple[int, ...]) -> int | None:
    """The first position where the token lists differ (including one ending first), or ``None`` when equal."""
    for i, (g, a) in enumerate(zip(golden, actual, strict=False)):  # lengths may differ
        if g != a:
            return i
    return None if len(golden) == len(actual) else min(len(golden), len(actual))


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted: bool
    reason: str

    def __str__(self) -> str:
        return self.reason


def decision_gap(model, request: RolloutRequest, golden_ids: list[int], position: int, other: int) -> float:
    """|score(golden token) - score(other)| at ``position`` under the current model, where score is the raw
    log-softmax (greedy) or processed log-prob + the request's Gumbel noise (sampled): how close the choice was."""
    row = ref_logprobs.completion_logits(model, request.prompt_ids, golden_ids[: position + 1])[position]  # (V,)
    scores = ref_generate.process_logits(row, request.sampling).double()  # (V,)
    if not request.sampling.greedy:
        seeds = torch.tensor([request.seed], dtype=torch.int64, device=row.device)
        scores = scores + gumbel_noise(seeds, torch.tensor([position], device=row.device), row.numel())[0]
    return float((scores[golden_ids[position]] - scores[other]).abs())


def divergence_accepted(
    model, dtype: str, request: RolloutRequest, golden: dict, actual_ids: tuple[int, ...], position: int
) -> Verdict:
    """DESIGN §4's token rule at the first divergence ``position``.

    float32: accepted only at a near tie (decision gap <= ``NEAR_TIE``). bfloat16/float16: accepted when the other
    token is in the golden top-5 at that position (the reverse direction needs the engine's top-5, which a Rollout
    does not carry); comparison stops there either way. One side ending early is never accepted.
    """
    golden_ids = golden["completion_ids"]
    if position >= len(golden_ids) or position >= len(actual_ids):
        longer = "golden" if len(golden_ids) > len(actual_ids) else "actual"
        return Verdict(False, f"lengths differ ({len(golden_ids)} golden vs {len(actual_ids)} actual tokens, {longer} "
                              f"continues; golden finish_reason={golden['finish_reason']})")  # fmt: skip
    g, a = golden_ids[position], actual_ids[position]
    top5 = golden["top5_ids"][position]
    if dtype == "float32":
        gap = decision_gap(model, request, list(golden_ids), position, a)
        ok = gap <= NEAR_TIE
        return Verdict(ok, f"golden token {g} vs {a}, decision gap {gap:.2e} ({'<=' if ok else '>'} near-tie "
                           f"{NEAR_TIE:.0e}); golden top-5 ids {top5}")  # fmt: skip
    ok = a in top5
    return Verdict(ok, f"golden token {g} vs {a}, which is {'' if ok else 'NOT '}in the golden top-5 {top5}")


def compare_trajectory(golden: dict, actual: dict) -> list[str]:
    """Reasons the re-run trajectory differs from the golden one (empty when within ``TRAJECTORY``)."""
    g_steps, a_steps = golden["steps"], actual["steps"]
    if len(g_steps) != len(a_steps):
        return [f"trajectory length {len(a_steps)} != golden {len(g_steps)}"]
    reasons = []
    for metric, t in TRAJECTORY.items():
        deltas = [a[metric] - g[metric] for g, a in zip(g_steps, a_steps, strict=True)]
        worst = max(range(len(deltas)), key=lambda i: abs(deltas[i]))
        mean = sum(deltas) / len(deltas)
        if abs(deltas[worst]) > t.max_abs or abs(mean) > t.mean_drift:
            first = next(i for i, d in enumerate(deltas) if abs(d) > t.max_abs) if abs(deltas[worst]) > t.max_abs \
                else worst  # fmt: skip
            reasons.append(f"{metric}: max |Δ|={abs(deltas[worst]):.3e} (tol {t.max_abs:.1e}), mean Δ={mean:+.3e} "
                           f"(tol {t.mean_drift:.1e}); first divergent step {g_steps[first]['step']} "
                           f"(golden {g_steps[first][metric]!r}, now {a_steps[first][metric]!r})")  # fmt: skip
    return reasons
