"""The tolerance tiers of DESIGN §4, defined once, each with its reason. Tests and ``cbverify verify`` read them here.

Picking a tier: :func:`tier_for` ``(dtype)``: float32 (any device) -> ``FP32``; bf16 / fp16 -> ``LOW_PRECISION``.
Loss and importance-ratio math is compared in float64 against the reference with ``LOSS_RTOL``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from reference.spec import SamplingParams

TokenRule = Literal["exact_or_near_tie", "top5_then_stop"]


@dataclass(frozen=True, slots=True)
class Tier:
    """One row of the DESIGN §4 table (fp32 max log-prob bound widened from 1e-5 to 5e-5 on measurement, see FP32).

    - ``token_rule``: ``exact_or_near_tie``: tokens must be identical; a divergence is accepted (and reported) only
      where the reference's top-2 gap of the decision score at that position is ``<= near_tie_gap`` and the engine's
      token is inside that gap. ``top5_then_stop``: at the first divergence each side's token must be in the other's
      top-5 of the decision score; comparison stops there.
    - ``logprob_max_abs`` / ``logprob_mean_abs``: bounds on |engine log-prob - reference teacher-forced log-prob| over
      all compared tokens (max over tokens, mean over tokens).
    """

    name: str
    token_rule: TokenRule
    near_tie_gap: float
    logprob_max_abs: float
    logprob_mean_abs: float
    reason: str

    def __post_init__(self) -> None:
        if self.token_rule not in ("exact_or_near_tie", "top5_then_stop"):
            raise ValueError(f"unknown token_rule {self.token_rule!r}")
        if min(self.near_tie_gap, self.logprob_max_abs, self.logprob_mean_abs) < 0:
            raise ValueError("tolerances must be >= 0")


FP32 = Tier(
    name="fp32",
    token_rule="exact_or_near_tie",
    near_tie_gap=1e-4,
    logprob_max_abs=5e-5,
    logprob_mean_abs=1e-5,
    reason=(
        "float32 logits differ between engines only by reduction order (padding, packing, a 1-row KV-cached decode "
        "vs a full forward): on the bundled Llama, 48 greedy arithmetic rollouts (1991 tokens) give a p99.9 of "
        "3-5e-6 for every engine, the reference against its own teacher-forcing reaches 6.7e-6, and hf-generate "
        "1.26e-5 (1.66e-5 on a drawn example); DESIGN's 1e-5 max is inside that noise, so the max is 5e-5 "
        "(DESIGN's 1e-5 kept for the mean). A token can flip only where two decision scores are within 1e-4."
    ),
)
LOW_PRECISION = Tier(
    name="bf16/fp16",
    token_rule="top5_then_stop",
    near_tie_gap=0.0,
    logprob_max_abs=5e-2,
    logprob_mean_abs=1e-2,
    reason=(
        "bfloat16 keeps 8 significant bits: logits move by ~1e-2 with reduction order, so sequences legitimately "
        "diverge; a plausible divergence keeps both tokens in each other's top-5, and log-probs stay within 5e-2"
    ),
)


def logprob_scale(sampling: SamplingParams) -> float:
    """Factor applied to |d log-prob| before comparing it with a tier's bounds: ``min(1, T)`` when sampled, else 1.

    Reason: processed log-probs are computed from ``logits / T``, so the same float32 noise on the logits (different
    GEMM shapes: a 1-row decode vs a full-sequence forward) reaches the log-probs multiplied by ``1 / T``. Measured:
    2.05e-5 at T=0.3 for ``hf-generate`` on the bundled Llama where T=1 stays below 7e-6. Scaling by ``T`` compares in
    logit units, so the bounds of the table hold unchanged at T >= 1.
    """
    return 1.0 if sampling.greedy else min(1.0, sampling.temperature)


LOSS_RTOL = 1e-6  # loss / ratio math in float64: only summation order differs, ~1e-12 relative; 1e-6 leaves margin


def tier_for(dtype: torch.dtype | str) -> Tier:
    """The tier for a model dtype (``torch.float32`` or ``"float32"`` -> ``FP32``; bf16/fp16 -> ``LOW_PRECISION``)."""
    name = str(dtype).removeprefix("torch.")
    if name == "float32":
        return FP32
    if name in ("bfloat16", "float16"):
        return LOW_PRECISION
    raise ValueError(f"no tolerance tier for dtype {dtype!r} (float32, bfloat16, float16)")
