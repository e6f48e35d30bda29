"""Mismatch metrics: how far a rollout engine's log-probs are from the trainer's on the same tokens.

``trainer_logps`` are teacher-forced trainer-side log-probs (``reference.logprobs``), ``sampler_logps`` what the
engine reported for the same tokens; only real tokens (``mask == 1``) whose sampler log-prob is not NaN count
(TRL 1.16 drops NaN tokens from ``sampling/sampling_logp_difference/*`` the same way). With the token log-ratio
``r = trainer - sampler`` and the token IS weight ``w = exp(r)``:

- ``logprob_abs_diff_mean`` / ``logprob_abs_diff_max``: ``mean |r|`` / ``max |r|``
  (TRL ``sampling/sampling_logp_difference/mean|max``);
- ``prob_abs_diff_mean``: ``mean |exp(trainer) - exp(sampler)|`` (the probability gap);
- ``mismatch_kl``: ``mean (exp(r) - r - 1)``, the k3 estimate of KL(sampler || trainer) (verl ``rollout_corr/k3_kl``);
- ``is_weight_min`` / ``is_weight_mean`` / ``is_weight_max``: of the raw ``w``, before any truncation or masking
  (TRL ``sampling/importance_sampling_ratio/min|mean|max`` in token modes, which TRL logs after clipping);
- ``ess``: ``1 / mean((w / mean w)^2)`` in (0, 1] (verl ``rollout_corr/rollout_is_eff_sample_size``, unclamped);
- ``ppl_ratio``: mean over non-empty sequences of ``exp(mean_t sampler - mean_t trainer)``, i.e. trainer perplexity
  over sampler perplexity per sequence (verl ``rollout_corr/ppl_ratio``).

``ess`` equals the textbook ``1 / mean(w^2)`` when the weights have mean 1 (their expectation under the sampler); the
normalisation by ``mean w`` is verl's. Simplifications versus verl: no ``SAFETY_BOUND`` clamp of log-ratios (the
metrics are computed in float64 and reported as they are), no rejection-sampling or threshold fractions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

METRIC_KEYS = (
    "logprob_abs_diff_mean", "logprob_abs_diff_max", "prob_abs_diff_mean", "mismatch_kl",
    "is_weight_min", "is_weight_mean", "is_weight_max", "ess", "ppl_ratio",
)  # fmt: skip


def pad_rows(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence 1-D tensors -> right-padded float64 (B, T) values and (B, T) int64 mask."""
    width = max((len(r) for r in rows), default=0)
    values = torch.zeros((len(rows), width), dtype=torch.float64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        values[i, : len(row)] = torch.as_tensor(row, dtype=torch.float64).cpu()
        mask[i, : len(row)] = 1
    return values, mask


def mismatch_metrics(
    trainer_logps: torch.Tensor | Sequence[torch.Tensor],  # (B, T) or B tensors of shape (L_i,)
    sampler_logps: torch.Tensor | Sequence[torch.Tensor],  # same layout
    mask: torch.Tensor | None = None,  # (B, T); None when per-sequence tensors are given
) -> dict[str, float]:
    """The metrics of the module docstring, as Python floats keyed by :data:`METRIC_KEYS`.

    Raises ``ValueError`` when no token counts (an empty batch has no mismatch to report).
    """
    if mask is None:
        if isinstance(trainer_logps, torch.Tensor) or isinstance(sampler_logps, torch.Tensor):
            raise ValueError("pass mask with (B, T) tensors, or per-sequence 1-D tensors without a mask")
        if [len(t) for t in trainer_logps] != [len(s) for s in sampler_logps]:
            raise ValueError("trainer and sampler log-prob sequences have different lengths")
        trainer, mask = pad_rows(trainer_logps)
        sampler, _ = pad_rows(sampler_logps)
    else:
        trainer = trainer_logps.detach().to(torch.float64).cpu()
        sampler = sampler_logps.detach().to(torch.float64).cpu()
        mask = mask.cpu()
    if trainer.shape != sampler.shape or trainer.shape != mask.shape:
        raise ValueError(f"shapes differ: trainer {tuple(trainer.shape)}, sampler {tuple(sampler.shape)}, "
                         f"mask {tuple(mask.shape)}")  # fmt: skip
    counted = (mask == 1) & ~torch.isnan(sampler)  # (B, T)
    if not counted.any():
        raise ValueError("no token to compare: the mask is empty or every sampler log-prob is NaN")

    r = (trainer - sampler)[counted]  # (N,) the counted tokens, flattened
    w = torch.exp(r)
    normalised = w / w.mean()
    per_seq = []
    for b in range(trainer.shape[0]):
        row = counted[b]
        if row.any():
            per_seq.append(math.exp(float(sampler[b][row].mean() - trainer[b][row].mean())))
    return {
        "logprob_abs_diff_mean": float(r.abs().mean()),
        "logprob_abs_diff_max": float(r.abs().max()),
        "prob_abs_diff_mean": float((torch.exp(trainer[counted]) - torch.exp(sampler[counted])).abs().mean()),
        "mismatch_kl": float((torch.exp(r) - r - 1).mean()),
        "is_weight_min": float(w.min()),
        "is_weight_mean": float(w.mean()),
        "is_weight_max": float(w.max()),
        "ess": float(1.0 / (normalised**2).mean()),
        "ppl_ratio": sum(per_seq) / len(per_seq),
    }
