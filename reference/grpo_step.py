"""One optimizer step of GRPO as TRL's ``GRPOConfig`` documents it: from the rows each micro-batch holds to the
objective whose gradient the optimizer applies, and the numbers logged next to it.

TRL generates a *generation batch* of ``per_device_train_batch_size * steps_per_generation`` rows at once, uses it
for ``num_iterations`` passes, and each pass splits it into ``steps_per_generation`` micro-batches. An optimizer step
accumulates ``gradient_accumulation_steps`` consecutive micro-batches (its *window*). For one window this module
computes, from the policy's parameters at the start of the step:

- per row: the trainer log-probs ``logp`` (``reference.logprobs.per_token_logps``, differentiable), the *old* log-probs
  of the policy that generated the row (the parameters at the step that generated its batch; equal to ``logp`` when
  no optimizer step happened since), the reference model's log-probs (``beta != 0``: the initial parameters);
- the completion mask: every completion token, except that ``mask_truncated_completions`` removes every token of a
  completion that did not end on an EOS id;
- the entropy mask (``top_entropy_quantile = rho < 1``): within a micro-batch, a token keeps its policy term iff its
  entropy is ``>=`` the ``1 - rho`` quantile of the micro-batch's unmasked entropies, the quantile interpolating
  linearly between order statistics (position ``q (n - 1)`` of the sorted values);
- the per-token loss of ``reference.loss.grpo_loss`` with that micro-batch's advantages, and the window objective:
  ``grpo``, ``bnpo``, ``dr_grpo``: each micro-batch normalised on its own ("the local batch"), averaged over the
  window's micro-batches; ``dapo``, ``cispo``: the sum over the window's tokens divided by "the number of active
  tokens in the global accumulated batch", i.e. the window's unmasked completion tokens.

The logged numbers (``entropy``, ``clip_ratio/*``, ``kl``) are each micro-batch's token-weighted mean, averaged over
the window's micro-batches (what TRL logs per optimizer step; its documentation defines no other weighting).

RLOO (:func:`rloo_window_objective`, TRL's ``RLOOTrainer``) has the same batching with its own objective: per
micro-batch ``reference.loss.rloo_loss`` on each row's summed masked log-probs (current and generating policy), the
window's objective the mean of its micro-batches' losses (the trainer divides each by the accumulation steps); the
KL penalty sits in the reward (``sequence_kl``), so the objective has no KL term.

Simplifications versus TRL: one process; no entropy bonus, off-policy mask or IS correction (the IS correction is
TRL's only with vLLM); rows are given already assigned to micro-batches (which rows go together is TRL's shuffle,
checked separately as a partition of the generation batch); float64 welcome.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reference.logprobs import per_token_entropies, per_token_logps
from reference.loss import LossConfig, grpo_loss, rloo_loss

LOCAL_NORMALISED = ("grpo", "bnpo", "dr_grpo")
WINDOW_NORMALISED = ("dapo", "cispo")


@dataclass(frozen=True, slots=True)
class Row:
    """One completion in a micro-batch: its tokens, its advantage, and the index of the generation batch it came from
    (whose generating parameters give its old log-probs)."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    advantage: float
    generation: int


@dataclass(frozen=True, slots=True)
class StepConfig:
    loss: LossConfig
    temperature: float
    eos_token_ids: tuple[int, ...]
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0


@dataclass(frozen=True, slots=True)
class StepOutput:
    objective: torch.Tensor  # () differentiable: the window's objective (its gradient is the optimizer's)
    micro_losses: tuple[float, ...]  # what TRL's loss call returns per micro-batch (GRPO: its share of the objective)
    metrics: dict[str, float]  # entropy, clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, kl


def completion_mask(rows: Sequence[Row], config: StepConfig) -> list[torch.Tensor]:
    """(L_i,) 0/1 float64 masks: all ones, or all zeros for a completion that did not end on EOS when masking."""
    out = []
    for row in rows:
        truncated = not row.completion_ids or row.completion_ids[-1] not in config.eos_token_ids
        keep = 0.0 if config.mask_truncated_completions and truncated else 1.0
        out.append(torch.full((len(row.completion_ids),), keep, dtype=torch.float64))
    return out


def quantile(values: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of a 1-D tensor, interpolating linearly between the sorted values at ``q (n - 1)``."""
    ordered = sorted(float(v) for v in values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def entropy_mask(entropies: list[torch.Tensor], masks: list[torch.Tensor], rho: float) -> list[torch.Tensor]:
    """Per row (L_i,) 0/1: unmasked tokens whose entropy is at least the ``1 - rho`` quantile of the unmasked
    entropies of all rows (all zeros when no token is unmasked)."""
    kept = torch.cat([e[m.bool()] for e, m in zip(entropies, masks, strict=True)])
    if kept.numel() == 0:
        return [torch.zeros_like(m) for m in masks]
    threshold = quantile(kept, 1.0 - rho)
    return [((e >= threshold) & m.bool()).to(torch.float64) for e, m in zip(entropies, masks, strict=True)]


def pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """(B, width) right-padded with zeros."""
    out = torch.zeros((len(rows), width), dtype=rows[0].dtype if rows else torch.float64)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def window_objective(
    micro_batches: Sequence[Sequence[Row]],
    model,
    generating_models: dict[int, object],
    config: StepConfig,
    ref_model=None,
) -> StepOutput:
    """The objective of one optimizer step whose window is ``micro_batches`` (see the module docstring).

    ``model`` holds the parameters at the start of the step (its gradient is the step's); ``generating_models[g]``
    those that generated generation batch ``g``; ``ref_model`` the reference policy (needed when ``beta != 0``).
    """
    loss_type = config.loss.loss_type
    if loss_type not in LOCAL_NORMALISED + WINDOW_NORMALISED:
        raise ValueError(f"loss_type {loss_type!r}: no window semantics here (known: "
                         f"{', '.join(LOCAL_NORMALISED + WINDOW_NORMALISED)})")  # fmt: skip
    masks = [completion_mask(rows, config) for rows in micro_batches]
    window_tokens = float(sum(float(m.sum()) for rows_masks in masks for m in rows_masks))
    objective = torch.zeros((), dtype=torch.float64)
    micro_losses, logged = [], {}
    for rows, row_masks in zip(micro_batches, masks, strict=True):
        prompts = [r.prompt_ids for r in rows]
        completions = [r.completion_ids for r in rows]
        width = max(len(c) for c in completions)
        logps = per_token_logps(model, prompts, completions, config.temperature, grad=True)
        old = [
            per_token_logps(generating_models[r.generation], [r.prompt_ids], [r.completion_ids], config.temperature)[0]
            for r in rows
        ]
        ref = None
        if config.loss.beta != 0.0:
            ref = pad(per_token_logps(ref_model, prompts, completions, config.temperature), width)
        with torch.no_grad():
            entropies = per_token_entropies(model, prompts, completions, config.temperature)
        policy_mask = None
        if config.top_entropy_quantile < 1.0:
            policy_mask = pad(entropy_mask(entropies, row_masks, config.top_entropy_quantile), width)
        mask = pad(row_masks, width)
        out = grpo_loss(
            pad(logps, width), pad(old, width), ref, None,
            torch.tensor([r.advantage for r in rows], dtype=torch.float64), mask, config.loss,
            num_items_in_batch=window_tokens, policy_mask=policy_mask,
        )  # fmt: skip
        share = out.loss / len(micro_batches) if loss_type in LOCAL_NORMALISED else out.loss
        objective = objective + share
        micro_losses.append(float(share.detach()))
        values = {
            "entropy": float((pad(entropies, width).double() * mask).sum() / mask.sum().clamp(min=1.0)),
            "clip_ratio/low_mean": out.clip_low_fraction,
            "clip_ratio/high_mean": out.clip_high_fraction,
            "clip_ratio/region_mean": out.clip_fraction,
        }
        if out.kl is not None:
            values["kl"] = out.kl
        for name, value in values.items():
            logged.setdefault(name, []).append(value)
    metrics = {name: sum(v) / len(v) for name, v in logged.items()}
    return StepOutput(objective=objective, micro_losses=tuple(micro_losses), metrics=metrics)


def _entropy_mean(model, rows: Sequence[Row], masks: list[torch.Tensor], config: StepConfig) -> float:
    with torch.no_grad():
        entropies = per_token_entropies(model, [r.prompt_ids for r in rows], [r.completion_ids for r in rows],
                                        config.temperature)  # fmt: skip
    total = sum(float((e.double() * m).sum()) for e, m in zip(entropies, masks, strict=True))
    return total / max(sum(float(m.sum()) for m in masks), 1.0)


def sequence_logps(model, rows: Sequence[Row], masks: list[torch.Tensor], config: StepConfig, grad: bool = False):
    """(B,) each row's completion log-prob under ``model``: the sum of its token log-probs where ``masks`` is 1."""
    logps = per_token_logps(model, [r.prompt_ids for r in rows], [r.completion_ids for r in rows], config.temperature,
                            grad=grad)  # fmt: skip
    return torch.stack([(lp.double() * m).sum() for lp, m in zip(logps, masks, strict=True)])


def sequence_kl(generating_model, ref_model, rows: Sequence[Row], config: StepConfig) -> torch.Tensor:
    """(B,) RLOO's KL estimate per row: the first-order ``sum_t (logp_generating - logp_ref)`` over its masked tokens,
    which ``RLOOTrainer`` subtracts (times ``beta``) from the reward."""
    masks = completion_mask(rows, config)
    with torch.no_grad():
        return sequence_logps(generating_model, rows, masks, config) - sequence_logps(ref_model, rows, masks, config)


def rloo_window_objective(
    micro_batches: Sequence[Sequence[Row]], model, generating_models: dict[int, object], config: StepConfig
) -> StepOutput:
    """RLOO's objective of one optimizer step whose window is ``micro_batches`` (see the module docstring)."""
    objective = torch.zeros((), dtype=torch.float64)
    micro_losses, logged = [], {}
    for rows in micro_batches:
        masks = completion_mask(rows, config)
        logps = sequence_logps(model, rows, masks, config, grad=True)
        with torch.no_grad():
            old = torch.stack([sequence_logps(generating_models[r.generation], [r], [m], config)[0]
                               for r, m in zip(rows, masks, strict=True)])  # fmt: skip
        advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float64)
        out = rloo_loss(logps, old, advantages, config.loss.epsilon_low, config.loss.epsilon_high)
        objective = objective + out.loss / len(micro_batches)
        micro_losses.append(float(out.loss.detach()))  # RLOO's loss call returns it whole; the Trainer divides
        values = {
            "entropy": _entropy_mean(model, rows, masks, config),
            "clip_ratio/low_mean": out.clip_low_fraction,
            "clip_ratio/high_mean": out.clip_high_fraction,
            "clip_ratio/region_mean": out.clip_fraction,
        }
        for name, value in values.items():
            logged.setdefault(name, []).append(value)
    metrics = {name: sum(v) / len(v) for name, v in logged.items()}
    return StepOutput(objective=objective, micro_losses=tuple(micro_losses), metrics=metrics)
