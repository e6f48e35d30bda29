"""What the reference says a recorded trainer run (``cbverify.upstream.recording``) should have computed.

From the run's own rollouts and the config's documented semantics (``reference.advantages``,
``reference.grpo_step``): each generation batch's rewards and advantages, and per optimizer step the objective of its
window of loss calls, the gradient the optimizer should get (after the trainer's clipping) and the logged metrics.
The reference is fed TRL's advantages for the step math, so that the advantage checks judge those on their own.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import torch

from cbverify.upstream.recording import Generation, LossCall, Record, Step
from cbverify.upstream.scenario import REWARDS, TrainerScenario


def reference_rewards(scenario: TrainerScenario, generation: Generation) -> list[list[float | None]]:
    """Each reward function called by us on what TRL gave it: ``[f][b]``."""
    kwargs = generation.reward_inputs
    return [list(REWARDS[name](prompts=generation.prompts, **kwargs)) for name in scenario.reward_names]


def reference_rewards_total(scenario: TrainerScenario, generation: Generation, kl: torch.Tensor | None = None):
    """(B,) each row's reward as the trainer's advantage sees it: the weighted functions (NaN: none scored the row),
    clipped to ``reward_clip_range`` (RLOO), less ``beta * kl`` (RLOO's KL penalty, ``kl`` per row)."""
    from reference.advantages import combine_rewards

    weights = list(scenario.reward_weights) if scenario.reward_weights else None
    total = combine_rewards(reference_rewards(scenario, generation), weights)
    if scenario.reward_clip_range is not None:
        total = total.clamp(*scenario.reward_clip_range)  # NaN stays NaN
    return total if kl is None else total - scenario.beta * kl


def reference_advantages(scenario: TrainerScenario, generation: Generation, kl: torch.Tensor | None = None):
    """(B,) the reference's advantages: GRPO's group-relative ones, or RLOO's leave-one-out ones."""
    from reference.advantages import compute_advantages, rloo_advantages

    total = reference_rewards_total(scenario, generation, kl)
    if scenario.trainer == "rloo":
        return rloo_advantages(total, scenario.num_generations, scenario.normalize_advantages)
    return compute_advantages(total, scenario.num_generations, scenario.scale_rewards)


def rloo_kl(scenario: TrainerScenario, record: Record, model) -> list[torch.Tensor | None]:
    """Per generation batch, RLOO's per-row KL penalty input (``None`` where there is none: GRPO, or ``beta == 0``)."""
    if scenario.trainer != "rloo" or not scenario.beta:
        return [None] * len(record.generations)
    from reference.grpo_step import Row, sequence_kl

    config = step_config(scenario, record.eos_token_ids)
    ref_model = _model_at(model, record.steps[0].params)
    out = []
    for g, gen in enumerate(record.generations):
        rows = [Row(p, c, 0.0, g) for p, c in zip(gen.prompt_ids, gen.completion_ids, strict=True)]
        out.append(sequence_kl(_model_at(model, record.steps[gen.step].params), ref_model, rows, config))
    return out


def step_windows(scenario: TrainerScenario, record: Record) -> list[list[LossCall]]:
    by_step: dict[int, list[LossCall]] = {}
    for call in record.losses:
        by_step.setdefault(call.step, []).append(call)
    return [by_step.get(k, []) for k in range(len(record.steps))]


def _model_at(template, params: dict[str, torch.Tensor]):
    model = copy.deepcopy(template).double().eval()  # the oracle recomputes in float64
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def step_config(scenario: TrainerScenario, eos: tuple[int, ...], bias_correction_kl: bool = True):
    from reference.grpo_step import StepConfig
    from reference.loss import LossConfig

    loss = LossConfig(loss_type=scenario.loss_type, epsilon_low=scenario.epsilon, epsilon_high=scenario.epsilon_high,
                      delta=scenario.delta, beta=scenario.beta, use_bias_correction_kl=bias_correction_kl,
                      importance_sampling_level=scenario.importance_sampling_level,
                      max_completion_length=scenario.max_completion_length)  # fmt: skip
    return StepConfig(loss=loss, temperature=scenario.temperature, eos_token_ids=eos,
                      mask_truncated_completions=scenario.mask_truncated_completions,
                      top_entropy_quantile=scenario.top_entropy_quantile)  # fmt: skip


def _clip_factor(norm: float, max_norm: float) -> float:
    """The trainer's global-norm clipping (``torch.nn.utils.clip_grad_norm_``): the gradient is multiplied by
    ``max_norm / (norm + 1e-6)`` when that is below 1 (no clipping when ``max_norm`` is 0)."""
    return min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0


def window_rows(record: Record, window: list[LossCall], assigned: dict[int, list[int]]):
    from reference.grpo_step import Row

    index_of = {id(call): i for i, call in enumerate(record.losses)}
    micro = []
    for call in window:
        gen = record.generations[call.generation]
        rows = assigned[index_of[id(call)]]
        micro.append([Row(gen.prompt_ids[i], gen.completion_ids[i], float(a), call.generation)
                      for i, a in zip(rows, call.advantages.tolist(), strict=True)])  # fmt: skip
    return micro


def norm_of(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors.values()))


def _objective(scenario: TrainerScenario, rows, model, generating, config, ref_model):
    """The reference's objective of one window: ``reference.grpo_step``'s GRPO or RLOO one."""
    from reference.grpo_step import rloo_window_objective, window_objective

    if scenario.trainer == "rloo":
        return rloo_window_objective(rows, model, generating, config)
    return window_objective(rows, model, generating, config, ref_model)


def _noise_scale(scenario: TrainerScenario, model, step: Step, rows, generating, config, ref_model) -> float:
    """The norm of the step's gradient with every advantage made positive: the size of the row terms before they
    cancel. Rows with opposite advantages (e.g. equal completions scored differently) cancel in the gradient, but
    float32 rounding is relative to each term, so this, not the net gradient, sets the trainer's rounding noise."""
    shadow = _model_at(model, step.params)
    positive = [[replace(r, advantage=abs(r.advantage)) for r in micro] for micro in rows]
    _objective(scenario, positive, shadow, generating, config, ref_model).objective.backward()
    return max(norm_of({n: p.grad for n, p in shadow.named_parameters() if p.grad is not None}), 1e-30)


@dataclass(frozen=True)
class StepReference:
    """The reference's view of one optimizer step."""

    output: object  # reference.grpo_step.StepOutput: the objective, each loss call's share, the logged metrics
    grads: dict[str, torch.Tensor]  # the gradient the optimizer should get (after clipping)
    norm: float  # its norm before clipping (what the trainer logs as grad_norm)
    noise: float  # the cancellation-free size of its row terms, clipped like the gradient (float32 noise scale)
    noise_unclipped: float


def reference_steps(scenario: TrainerScenario, record: Record, model, assigned: dict[int, list[int]]):
    """One :class:`StepReference` per optimizer step (``None`` for a step with no micro-batch or no gradient), the
    reference fed TRL's advantages (judged on their own by the advantage checks) so that it judges the step's math."""
    config = step_config(scenario, record.eos_token_ids, record.use_bias_correction_kl)
    generating = {g: _model_at(model, record.steps[gen.step].params) for g, gen in enumerate(record.generations)}
    ref_model = _model_at(model, record.steps[0].params) if scenario.beta and scenario.trainer == "grpo" else None
    out = []
    for step, window in zip(record.steps, step_windows(scenario, record), strict=True):
        if not window or step.grads is None:
            out.append(None)
            continue
        current = _model_at(model, step.params)
        rows = window_rows(record, window, assigned)
        objective = _objective(scenario, rows, current, generating, config, ref_model)
        objective.objective.backward()
        grads = {n: p.grad for n, p in current.named_parameters()}
        norm = norm_of(grads)
        factor = _clip_factor(norm, scenario.max_grad_norm)
        noise = _noise_scale(scenario, model, step, rows, generating, config, ref_model)
        out.append(StepReference(objective, {n: g * factor for n, g in grads.items()}, norm, noise * factor, noise))
    return out
