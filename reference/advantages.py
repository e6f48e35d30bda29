"""Group-relative advantages (GRPO), written as plain loops over groups so each number can be checked by hand.

``rewards`` is a flat (B,) vector of ``B = num_prompts * num_generations`` rewards, the ``num_generations``
completions of one prompt being contiguous (TRL's layout). For completion ``j`` of group ``g``::

    advantage = (reward - group_mean) / (std + 1e-4)      scale_rewards = "group": std of the group
                                                          scale_rewards = "batch": std of the whole batch
    advantage =  reward - group_mean                      scale_rewards = "none"

``std`` is Bessel-corrected (divides by ``n - 1``).

Unscorable completions (reward NaN) follow TRL 1.16.0 (``GRPOTrainer._generate_and_score_completions``,
``multi_objective_aggregation="sum_then_normalize"``), exactly:

- NaN rewards are *excluded* from every statistic: the mean and the std are over the scorable rewards only, and
  ``n`` is the number of scorable rewards (TRL's ``torch.nanmean`` / ``trl.trainer.utils.nanstd``);
- a std over fewer than 2 scorable rewards is undefined (NaN), so with ``"group"`` a group with at most one scorable
  reward gets advantage 0 for *every* member, and with ``"batch"`` a batch with at most one scorable reward does;
- a group whose rewards are all NaN has an undefined mean, so all its advantages are 0 (any scaling);
- finally every NaN advantage becomes 0 (in particular every unscorable completion's own advantage).

Exceptions copied from TRL: with ``num_generations == 1`` the group std is 0 (not NaN), and with a batch of one
reward the batch std is 0.

Several reward functions (:func:`combine_rewards`, TRL's default ``sum_then_normalize``): a row's reward is the
weighted sum of the functions that scored it (a function returning ``None`` for a row is left out of that row's sum);
a row that no function scored is unscorable (NaN), whatever the weights.

RLOO (:func:`rloo_advantages`, TRL's ``RLOOTrainer``): a completion's advantage is its reward minus the mean reward
of the *other* scorable completions of its group (the leave-one-out baseline), NaN when it is unscorable or has no
scorable sibling; with ``normalize_advantages`` the advantages are then standardised over the batch's non-NaN ones
(mean, Bessel-corrected std ``+ 1e-4``); every NaN becomes 0.

Simplifications versus TRL: no ``normalize_then_sum`` aggregation; no multi-process gather/slice; float64 throughout.
"""

from __future__ import annotations

import math

import torch

SCALE_REWARDS = ("group", "batch", "none")
EPS = 1e-4


def nan_mean(values: list[float]) -> float:
    """Mean of the non-NaN values; NaN when there are none.

    Computed as ``first + mean(v - first)``: the same number, but equal values give exactly that value (a plain
    ``sum / n`` can be one ulp off, and one ulp divided by eps = 1e-4 is a visible nonzero advantage).
    """
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return math.nan
    return kept[0] + sum(v - kept[0] for v in kept) / len(kept)


def nan_std(values: list[float]) -> float:
    """Bessel-corrected std of the non-NaN values; NaN when fewer than two are left."""
    kept = [v for v in values if not math.isnan(v)]
    if len(kept) < 2:
        return math.nan
    mean = nan_mean(kept)
    return math.sqrt(sum((v - mean) ** 2 for v in kept) / (len(kept) - 1))


def compute_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """(B,) rewards -> (B,) float64 advantages (see the module docstring for the exact rule)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be an int >= 1, got {num_generations!r}")
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards must be (B,) with B a multiple of num_generations={num_generations}, got {tuple(rewards.shape)}"
        )
    values = [float(r) for r in rewards.to(torch.float64)]
    batch_std = nan_std(values) if len(values) > 1 else 0.0
    advantages: list[float] = []
    for start in range(0, len(values), num_generations):
        group = values[start : start + num_generations]
        mean = nan_mean(group)
        if scale_rewards == "group":
            std = nan_std(group) if num_generations > 1 else 0.0
        else:
            std = batch_std
        for reward in group:
            advantage = reward - mean
            if scale_rewards != "none":
                advantage = advantage / (std + EPS)
            advantages.append(0.0 if math.isnan(advantage) else advantage)
    return torch.tensor(advantages, dtype=torch.float64, device=rewards.device)  # (B,)


def combine_rewards(rewards_per_func: list[list[float | None]], weights: list[float] | None = None) -> torch.Tensor:
    """(B,) float64 rewards from ``rewards_per_func[f][b]`` (function ``f``'s reward for row ``b``, ``None`` if it did
    not score the row): the weighted sum over the functions that scored the row, NaN for a row none scored."""
    if not rewards_per_func:
        raise ValueError("need at least one reward function")
    weights = [1.0] * len(rewards_per_func) if weights is None else list(weights)
    if len(weights) != len(rewards_per_func):
        raise ValueError(f"{len(weights)} weights for {len(rewards_per_func)} reward functions")
    rows = {len(column) for column in rewards_per_func}
    if len(rows) != 1:
        raise ValueError(f"reward functions returned different numbers of rows: {sorted(rows)}")
    out = []
    for b in range(rows.pop()):
        scored = [(w, column[b]) for w, column in zip(weights, rewards_per_func, strict=True) if column[b] is not None]
        out.append(sum(w * float(r) for w, r in scored) if scored else math.nan)
    return torch.tensor(out, dtype=torch.float64)  # (B,)


def rloo_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool = False) -> torch.Tensor:
    """(B,) rewards -> (B,) float64 RLOO advantages (see the module docstring)."""
    if not isinstance(num_generations, int) or num_generations < 1 or rewards.dim() != 1:
        raise ValueError(
            f"need (B,) rewards and num_generations >= 1, got {tuple(rewards.shape)}, {num_generations!r}"
        )
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"{rewards.numel()} rewards do not make groups of {num_generations}")
    values = [float(r) for r in rewards.to(torch.float64)]
    advantages: list[float] = []
    for start in range(0, len(values), num_generations):
        group = values[start : start + num_generations]
        for i, reward in enumerate(group):
            others = [v for j, v in enumerate(group) if j != i and not math.isnan(v)]
            baseline = sum(others) / len(others) if others else math.nan
            advantages.append(reward - baseline if num_generations > 1 else 0.0)
    if normalize:
        mean, std = nan_mean(advantages), nan_std(advantages)
        advantages = [(a - mean) / (std + EPS) for a in advantages]
    return torch.tensor([0.0 if math.isnan(a) else a for a in advantages], dtype=torch.float64)  # (B,)
