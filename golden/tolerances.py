"""Golden tolerances, each set from measured noise with the reason beside it.

Token divergences are judged by ``cbverify.compare.compare_tokens`` with the DESIGN §4 tier of the case's dtype
(``cbverify.tolerances.tier_for``); this module holds only the golden-specific log-prob and trajectory bounds.

Two numbers per comparison, as in TRL's invariant tests: ``max_abs`` bounds the worst point-wise |Δ| and
``mean_drift`` bounds |mean Δ| over all positions, which flags a systematic one-sided shift that stays point-wise
small.

Noise measured on this repo's CPU (AMD EPYC, AVX512, torch 2.13.0+cpu, transformers 5.24.0), bundled models, all golden
cases, by ``python -m golden.measure_noise`` (numbers in golden/README.md):
# NOISE-TABLE (filled from measurement)
"""

from __future__ import annotations

from dataclasses import dataclass


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
