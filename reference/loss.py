"""The GRPO objective and the generation-vs-training importance-sampling (IS) correction, as in TRL 1.16.0.

Inputs are padded (B, T) tensors, ``completion_mask`` is 1 on real completion tokens, ``advantages`` is (B,).
Names follow TRL: ``per_token_logps`` (current policy, differentiable), ``old_per_token_logps`` (the policy that
generated the batch, as recomputed by the trainer; ``None`` means on-policy, i.e. ``per_token_logps.detach()``),
``ref_per_token_logps`` (reference model, for the KL term), ``sampling_per_token_logps`` (what the rollout engine
reported; used only by the IS correction).

Per token, with ``A`` the sequence's advantage:

1. log-ratio ``r = logp - old_logp``; ``importance_sampling_level="token"`` uses it per token, ``"sequence"`` (GSPO)
   uses the masked mean of ``r`` over the sequence, one ratio per sequence: ``ratio = exp(r)``.
2. KL (k3 estimator): ``kl = exp(ref - logp) - (ref - logp) - 1 >= 0``; times ``ratio`` when
   ``use_bias_correction_kl``.
3. policy term: ``grpo/bnpo/dr_grpo/dapo/luspo``: ``-min(ratio' * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A)``
   where ``ratio' = min(ratio, delta)`` when ``delta`` is set (two-sided clipping), else ``ratio``;
   ``cispo``: ``-stopgrad(min(ratio, eps_high)) * A * logp`` (here ``epsilon_high`` bounds the ratio itself).
4. IS correction (``is_correction`` set): the term is multiplied by a weight ``w`` computed from
   ``d = (old_logp - sampling_logp) * mask`` with NaN -> 0 (an unscored token gets ``w = 1``):
   ``token_*``: ``w = exp(d)`` per token; ``sequence_*``: ``w = exp(sum_t d)`` per sequence;
   ``*_truncate``: ``w = clamp(w, clip_min, clip_max)``; ``*_mask``: ``w = 0`` where ``w < clip_min`` or
   ``w > clip_max`` (a bound of ``None`` is no bound).
5. ``loss_token = policy_term * m * w + beta * kl``, where ``m`` is an optional 0/1 ``policy_mask`` (TRL's entropy
   mask: it removes a token's policy term, not its KL term, and not the token from the normaliser).

Normalisers (how the masked (B, T) ``loss_token`` becomes one number):

- ``grpo``: mean over sequences of (sum over the sequence's tokens / its token count, at least 1);
- ``bnpo``: sum over all tokens / number of tokens in this batch (at least 1);
- ``dr_grpo``: sum over all tokens / (B * ``max_completion_length``), a constant;
- ``dapo`` and ``cispo``: sum over all tokens / ``num_items_in_batch``, the token count of the whole generation
  batch (defaults to this batch's; TRL divides it by processes, scales by accumulation steps over
  steps_per_generation, which is 1 for one process and one micro-batch per generation);
- ``luspo``: mean over sequences of (sum over the sequence's tokens), not divided by its length: a sequence weighs
  by its length (length-unbiased GSPO, meant for ``"sequence"`` level, where the term is one value per sequence).

With ``"sequence"`` level, the (B, 1) per-sequence term is broadcast over the sequence's tokens before the
normaliser, as TRL does (so ``dapo``/``bnpo``/``luspo`` weight sequences by length).

RLOO (:func:`rloo_loss`, TRL's ``RLOOTrainer``) clips whole sequences instead: one ratio per sequence from the
summed log-probs, the loss the mean over sequences; its KL penalty is part of the reward, not of the loss.

Simplifications versus TRL: no entropy bonus, no off-policy sequence mask, no ``sapo`` or ``vespo`` losses, no tool
mask, no gradient-accumulation or multi-process scaling; float64 welcome.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "luspo")
IS_LEVELS = ("token", "sequence")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True, slots=True)
class LossConfig:
    """GRPO loss settings; defaults are TRL 1.16.0's ``GRPOConfig`` defaults (except ``is_correction``, which TRL
    applies only with vLLM). ``epsilon_high=None`` means ``epsilon_high = epsilon_low``."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True
    is_correction: str | None = None
    is_clip_min: float | None = None
    is_clip_max: float | None = 3.0
    max_completion_length: int | None = None

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IS_LEVELS}, got {self.importance_sampling_level!r}"
            )
        if self.is_correction is not None and self.is_correction not in IS_MODES:
            raise ValueError(f"is_correction must be None or one of {IS_MODES}, got {self.is_correction!r}")
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon_low)
        for name in ("epsilon_low", "epsilon_high", "beta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.delta is not None and not (math.isfinite(self.delta) and self.delta > 0):
            raise ValueError(f"delta must be a finite number > 0 (TRL recommends > 1 + epsilon), got {self.delta!r}")
        length = self.max_completion_length
        if self.loss_type == "dr_grpo" and not (isinstance(length, int) and length >= 1):
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (an int >= 1) as normaliser")
        lo, hi = self.is_clip_min, self.is_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"is_clip_min ({lo}) must be < is_clip_max ({hi}) (TRL's rule)")
        if self.is_correction is not None and self.is_correction.endswith("truncate") and lo is None and hi is None:
            raise ValueError(f"is_correction={self.is_correction!r} needs is_clip_min or is_clip_max")


@dataclass(frozen=True, slots=True)
class LossOutput:
    """The scalar loss and what TRL logs next to it (``clip_ratio/*``, ``kl``, ``importance_sampling_ratio``)."""

    loss: torch.Tensor  # () differentiable
    clip_fraction: float  # TRL's clip_ratio/region_mean (cispo: cispo_clip_ratio)
    clip_low_fraction: float  # clip_ratio/low_mean (0 for cispo)
    clip_high_fraction: float  # clip_ratio/high_mean (cispo: cispo_clip_ratio)
    kl: float | None  # masked mean of the (bias-corrected) k3 term; None when beta == 0
    is_weights: torch.Tensor | None  # (B, T) token modes, (B, 1) sequence modes; None without correction
    ratio: torch.Tensor  # (B, T) token level, (B, 1) sequence level; the policy ratio exp(log-ratio)


def k3_kl(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || ref): ``exp(d) - d - 1`` with ``d = ref - logp``; >= 0, 0 iff equal.

    Written ``expm1(d) - d`` (same value; keeps small nonzero ``d`` strictly positive instead of rounding to 0).
    """
    d = ref_per_token_logps - per_token_logps
    return torch.expm1(d) - d


def importance_weights(old_per_token_logps, sampling_per_token_logps, completion_mask, config: LossConfig):
    """IS correction weights, (B, T) for token modes or (B, 1) for sequence modes (step 4 of the module docstring)."""
    diff = (old_per_token_logps - sampling_per_token_logps) * completion_mask  # (B, T)
    diff = torch.nan_to_num(diff, nan=0.0)  # a token the engine could not score: no correction
    if config.is_correction.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)  # (B, 1)
    weights = torch.exp(diff)
    lo = -math.inf if config.is_clip_min is None else config.is_clip_min
    hi = math.inf if config.is_clip_max is None else config.is_clip_max
    if config.is_correction.endswith("truncate"):
        return weights.clamp(min=lo, max=hi)
    outside = (weights < lo) | (weights > hi)
    return weights.masked_fill(outside, 0.0)


def masked_mean(values: torch.Tensor, completion_mask: torch.Tensor) -> float:
    """Mean over real tokens of a (B, T) tensor; a (B, 1) per-sequence tensor (sequence level, T > 1) is averaged
    over sequences, as TRL logs it. A (B, 1) tensor with T == 1 is per token and uses the mask."""
    if values.shape[1] == 1 and completion_mask.shape[1] != 1:
        return float(values.sum() / max(values.shape[0], 1))
    values = values.expand_as(completion_mask)
    return float((values * completion_mask).sum() / completion_mask.sum().clamp(min=1.0))


def grpo_loss(
    per_token_logps: torch.Tensor,  # (B, T)
    old_per_token_logps: torch.Tensor | None,  # (B, T)
    ref_per_token_logps: torch.Tensor | None,  # (B, T)
    sampling_per_token_logps: torch.Tensor | None,  # (B, T)
    advantages: torch.Tensor,  # (B,)
    completion_mask: torch.Tensor,  # (B, T)
    config: LossConfig,
    *,
    num_items_in_batch: float | None = None,
    policy_mask: torch.Tensor | None = None,  # (B, T) 0/1: tokens whose policy term counts (entropy mask)
) -> LossOutput:
    """The GRPO loss of the module docstring, with the numbers TRL logs next to it."""
    mask = completion_mask.to(per_token_logps.dtype)  # (B, T)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps  # (B, T)
    adv = advantages.to(per_token_logps.dtype)[:, None]  # (B, 1)

    log_ratio = per_token_logps - old  # (B, T)
    if config.importance_sampling_level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    ratio = torch.exp(log_ratio)
    policy_ratio = ratio.detach()  # before delta capping, for the caller

    kl_per_token = None
    if config.beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("beta != 0 needs ref_per_token_logps")
        kl_per_token = k3_kl(per_token_logps, ref_per_token_logps)  # (B, T)
        if config.use_bias_correction_kl:
            kl_per_token = kl_per_token * ratio

    if config.loss_type == "cispo":
        capped = torch.clamp(ratio, max=config.epsilon_high).detach()
        policy_term = -capped * adv * per_token_logps  # (B, T)
        clipped_high = (ratio > config.epsilon_high) & (adv > 0)
        clipped_low = torch.zeros_like(clipped_high)
    else:
        clipped_ratio = torch.clamp(ratio, 1 - config.epsilon_low, 1 + config.epsilon_high)
        if config.delta is not None:
            ratio = torch.clamp(ratio, max=config.delta)
        policy_term = -torch.min(ratio * adv, clipped_ratio * adv)
        clipped_low = (ratio < 1 - config.epsilon_low) & (adv < 0)
        clipped_high = (ratio > 1 + config.epsilon_high) & (adv > 0)

    if policy_mask is not None:
        policy_term = policy_term * policy_mask.to(policy_term.dtype)

    is_weights = None
    if config.is_correction is not None:
        if sampling_per_token_logps is None:
            raise ValueError(f"is_correction={config.is_correction!r} needs sampling_per_token_logps")
        is_weights = importance_weights(old, sampling_per_token_logps, mask, config)
        policy_term = policy_term * is_weights

    loss_token = policy_term if kl_per_token is None else policy_term + config.beta * kl_per_token
    masked_sum_per_seq = (loss_token * mask).sum(-1)  # (B,)
    tokens_per_seq = mask.sum(-1)  # (B,)
    if config.loss_type == "grpo":
        loss = (masked_sum_per_seq / tokens_per_seq.clamp(min=1.0)).mean()
    elif config.loss_type == "bnpo":
        loss = masked_sum_per_seq.sum() / tokens_per_seq.sum().clamp(min=1.0)
    elif config.loss_type == "dr_grpo":
        loss = masked_sum_per_seq.sum() / (mask.shape[0] * config.max_completion_length)
    elif config.loss_type == "luspo":
        loss = masked_sum_per_seq.mean()
    else:  # dapo, cispo
        items = float(tokens_per_seq.sum()) if num_items_in_batch is None else float(num_items_in_batch)
        loss = masked_sum_per_seq.sum() / max(items, 1.0)

    return LossOutput(
        loss=loss,
        clip_fraction=masked_mean((clipped_low | clipped_high).to(mask.dtype), mask),
        clip_low_fraction=masked_mean(clipped_low.to(mask.dtype), mask),
        clip_high_fraction=masked_mean(clipped_high.to(mask.dtype), mask),
        kl=None if kl_per_token is None else masked_mean(kl_per_token.detach(), mask),
        is_weights=is_weights,
        ratio=policy_ratio,
    )


def rloo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, epsilon_low: float,
              epsilon_high: float | None = None) -> LossOutput:  # fmt: skip
    """TRL's ``RLOOTrainer`` objective: PPO clipping on whole sequences. ``logps`` / ``old_logps`` are (B,) sums of a
    sequence's (masked) token log-probs, current (differentiable) and generating policy; ``ratio = exp(logps -
    old_logps)``, the loss the mean over sequences of ``-min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) *
    A)``. Clip fractions count sequences (low: ratio below ``1 - eps_low`` with ``A < 0``; high: above ``1 +
    eps_high`` with ``A > 0``)."""
    high = epsilon_low if epsilon_high is None else epsilon_high
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + high)
    loss = (-torch.min(ratio * advantages, clipped * advantages)).mean()
    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (advantages < 0)).double()
        up = ((ratio > 1 + high) & (advantages > 0)).double()
    return LossOutput(loss=loss, clip_fraction=float((low + up).clamp(max=1).mean()),
                      clip_low_fraction=float(low.mean()), clip_high_fraction=float(up.mean()), kl=None,
                      is_weights=None, ratio=ratio.detach()[:, None])  # fmt: skip
