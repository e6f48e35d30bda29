"""A trainer configuration checked optimizer step by optimizer step.

:func:`record_run` trains a copy of the model with TRL's real ``GRPOTrainer`` or ``RLOOTrainer`` for a
:class:`TrainerScenario`, rolling out with the oracle (deterministic: the same rows on every run; through
``rollout_func`` for GRPO, in place of ``_generate`` for RLOO, which takes no ``rollout_func``), and records, on the
trainer instance only (TRL is never edited):

- every generation batch as scored (rows, TRL's per-function rewards and advantages) and the reward functions'
  inputs, with the optimizer step it was generated at;
- every loss call (its micro-batch and the value returned), with its optimizer step and its generation batch;
- per optimizer step, through a ``TrainerCallback``: the parameters at the start of the step, the gradient handed to
  the optimizer (after TRL's accumulation and the trainer's gradient clipping) and the logged metrics.

:func:`check_steps` recomputes all of it with ``reference`` from the same rollouts and the config's documented
semantics (``reference.advantages``, ``reference.grpo_step``): each result names the quantity and the step.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from cbverify.tolerances import TRAINER_FP32, TRAINER_FP32_PARAM_GRAD, TRAINER_METRIC
from cbverify.upstream import trl_compat
from cbverify.upstream.findings import FAIL, NA, PASS, CheckResult
from cbverify.upstream.scenario import REWARDS, TrainerScenario, build_trainer

CHECKS = (
    "step_run_completes", "rewards_match_reference", "advantages_match_reference",
    "zero_variance_groups_get_zero_advantage", "micro_batches_partition_generation", "micro_losses_match_reference",
    "step_gradients_match_reference", "logged_metrics_match_reference",
)  # fmt: skip


@dataclass
class Generation:
    step: int  # optimizer steps completed when it was generated
    prompts: list[str]
    reward_inputs: dict  # the reward functions' keyword arguments, as TRL passed them
    prompt_ids: list[tuple[int, ...]]
    completion_ids: list[tuple[int, ...]]
    rewards_per_func: torch.Tensor  # (B, F) TRL's, NaN where a function returned None
    advantages: torch.Tensor  # (B,) TRL's


@dataclass
class LossCall:
    step: int
    generation: int  # index into Record.generations of the batch it came from
    rows: list[tuple[tuple[int, ...], tuple[int, ...]]]  # (prompt ids, completion ids right-padded to the batch's)
    advantages: torch.Tensor  # (B,) as TRL handed them to the loss
    loss: float


@dataclass
class Step:
    params: dict[str, torch.Tensor]  # at the start of the step
    grads: dict[str, torch.Tensor] | None = None  # handed to the optimizer
    logs: dict[str, float] = field(default_factory=dict)


@dataclass
class Record:
    generations: list[Generation] = field(default_factory=list)
    losses: list[LossCall] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    error: BaseException | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    use_bias_correction_kl: bool = True  # as the trainer ran (its default changed to True in trl 1.10)


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(row[m.bool()].tolist()) for row, m in zip(ids, mask, strict=True)]


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _install(trainer, record: Record) -> None:
    from transformers import TrainerCallback

    model = trainer.accelerator.unwrap_model(trainer.model)
    original_rewards = trainer._calculate_rewards
    original_score = trainer._generate_and_score_completions
    original_loss = trainer._compute_loss
    pending: dict = {}

    def rewards(inputs, prompts, completions, completion_ids_list):
        out = original_rewards(inputs, prompts, completions, completion_ids_list)
        columns = {k: [x[k] for x in inputs] for k in inputs[0] if k != "prompt"}
        pending.update(prompts=list(prompts), completion_ids=[tuple(c) for c in completion_ids_list],
                       reward_inputs=dict(columns, completions=list(completions),
                                          completion_ids=[list(c) for c in completion_ids_list]),
                       rewards=out.detach().clone())  # fmt: skip
        return out

    def score(*args, **kwargs):
        out = original_score(*args, **kwargs)
        record.generations.append(
            Generation(
                step=trainer.state.global_step,
                prompts=pending["prompts"],
                reward_inputs=pending["reward_inputs"],
                prompt_ids=_rows(out["prompt_ids"], out["prompt_mask"]),
                completion_ids=pending["completion_ids"],
                rewards_per_func=pending["rewards"],
                advantages=out["advantages"].detach().clone(),
            )  # fmt: skip
        )
        return out

    def loss(model_, inputs):
        value = original_loss(model_, inputs)
        if model_.training:
            rows = list(
                zip(
                    _rows(inputs["prompt_ids"], inputs["prompt_mask"]),
                    _rows(inputs["completion_ids"], torch.ones_like(inputs["completion_ids"])),
                    strict=True,
                )
            )
            record.losses.append(LossCall(step=trainer.state.global_step, generation=len(record.generations) - 1,
                                          rows=rows, advantages=inputs["advantages"].detach().clone(),
                                          loss=float(value.detach())))  # fmt: skip
        return value

    class Recorder(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            record.steps.append(Step(params=_params(model)))

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            record.steps[-1].grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                                      for n, p in model.named_parameters()}  # fmt: skip

        def on_log(self, args, state, control, logs=None, **kwargs):
            if record.steps and logs and "loss" in logs:
                record.steps[-1].logs = dict(logs)

    trainer._calculate_rewards, trainer._generate_and_score_completions = rewards, score
    trainer._compute_loss = loss
    trainer.add_callback(Recorder())
    record.eos_token_ids = trl_compat.eos_token_ids(trainer)
    record.use_bias_correction_kl = bool(getattr(trainer.args, "use_bias_correction_kl", False))
    record.pad_token_id = trainer.processing_class.pad_token_id


def record_run(scenario: TrainerScenario, model, tokenizer, prepare: Callable[[object], None] | None = None) -> Record:
    """Train a float32 copy of ``model`` for ``scenario.max_steps`` optimizer steps on the ``rollout_func`` path (the
    oracle rolls out) and record every step (see the module docstring). A trainer error is kept in ``Record.error``.
    ``prepare(trainer)`` runs before the recorder is installed (the power tests inject faults with it)."""
    from cbverify.upstream.rollout import make_rollout_func, replace_generate
    from cbverify.upstream.run import _quiet_loggers

    if scenario.path != "rollout_func" or scenario.rollout_backend != "reference":
        raise ValueError("step checks run on the rollout_func path with the reference backend")
    torch.manual_seed(scenario.seed)
    work = copy.deepcopy(model).float().train()
    record = Record()
    rollout_func = make_rollout_func("reference", work, tokenizer, base_seed=scenario.seed)
    with warnings.catch_warnings(), _quiet_loggers():
        warnings.simplefilter("ignore", FutureWarning)
        if scenario.trainer == "grpo":
            trainer = build_trainer(scenario, work, tokenizer, rollout_func=rollout_func)
        else:  # RLOOTrainer takes no rollout_func: the oracle replaces its _generate
            trainer = build_trainer(scenario, work, tokenizer)
            replace_generate(trainer, rollout_func)
        if prepare is not None:
            prepare(trainer)
        _install(trainer, record)
        try:
            trainer.train()
        except Exception as err:  # a crash is a result: step_run_completes reports it
            record.error = err
    return record


def _result(check: str, scenario: TrainerScenario, status: str, reason: str) -> CheckResult:
    return CheckResult(check, scenario.path, status, reason, scenario.describe())


def _close(got: float, want: float, tol=TRAINER_FP32) -> bool:
    return abs(got - want) <= tol.atol + tol.rtol * abs(want)


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


def _rloo_kl(scenario: TrainerScenario, record: Record, model) -> list[torch.Tensor | None]:
    """Per generation batch, RLOO's per-row KL penalty input (``None`` where there is none: GRPO, or ``beta == 0``)."""
    if scenario.trainer != "rloo" or not scenario.beta:
        return [None] * len(record.generations)
    from reference.grpo_step import Row, sequence_kl

    config = _step_config(scenario, record.eos_token_ids)
    ref_model = _model_at(model, record.steps[0].params)
    out = []
    for g, gen in enumerate(record.generations):
        rows = [Row(p, c, 0.0, g) for p, c in zip(gen.prompt_ids, gen.completion_ids, strict=True)]
        out.append(sequence_kl(_model_at(model, record.steps[gen.step].params), ref_model, rows, config))
    return out


def _assign(call: LossCall, generation: Generation, pad: int, uses: Counter) -> list[int] | str:
    """The generation rows of a loss call's micro-batch, matched by tokens, or why they cannot be. Among rows with
    equal tokens: the one used least so far (``uses``, per generation batch, updated), then the one scored with the
    advantage the row carries."""
    width = len(call.rows[0][1])
    rows_of: dict[tuple, list[int]] = {}
    for i, (prompt, completion) in enumerate(zip(generation.prompt_ids, generation.completion_ids, strict=True)):
        rows_of.setdefault((prompt, completion + (pad,) * (width - len(completion))), []).append(i)
    out = []
    for key, got in zip(call.rows, call.advantages.tolist(), strict=True):
        candidates = rows_of.get(key)
        if not candidates:
            return f"micro-batch row {key} is not in its generation batch"
        best = min(candidates, key=lambda i: (uses[i], abs(float(generation.advantages[i]) - got)))
        uses[best] += 1
        out.append(best)
    return out


def _windows(scenario: TrainerScenario, record: Record) -> list[list[LossCall]]:
    by_step: dict[int, list[LossCall]] = {}
    for call in record.losses:
        by_step.setdefault(call.step, []).append(call)
    return [by_step.get(k, []) for k in range(len(record.steps))]


def check_partition(scenario: TrainerScenario, record: Record, assigned: dict[int, list[int]]) -> CheckResult:
    """Each of the ``num_iterations`` passes over a generation batch uses each of its rows exactly once, in
    ``steps_per_generation`` micro-batches of ``per_device_train_batch_size`` rows, each row carrying its own
    advantage; only the last generation batch may be cut short (``max_steps`` reached), its rows used evenly so far."""
    check = "micro_batches_partition_generation"
    passes: dict[int, list[int]] = {}
    for index, call in enumerate(record.losses):
        if len(call.rows) != scenario.batch_size:
            return _result(check, scenario, FAIL, f"loss call {index}: {len(call.rows)} rows, "
                           f"per_device_train_batch_size={scenario.batch_size}")  # fmt: skip
        want = record.generations[call.generation].advantages[assigned[index]]
        if not torch.equal(call.advantages, want):
            return _result(check, scenario, FAIL, f"loss call {index}: its rows carry advantages "
                           f"{call.advantages.tolist()}, scored as {want.tolist()}")  # fmt: skip
        passes.setdefault(call.generation, []).extend(assigned[index])
    last = len(record.generations) - 1
    for g in range(len(record.generations)):
        rows = passes.get(g, [])
        size = len(record.generations[g].completion_ids)
        full, extra = divmod(len(rows), size)  # whole passes, and rows of the pass training stopped in (last only)
        counts = Counter({i: 0 for i in range(size)} | Counter(rows))
        complete = full == scenario.num_iterations and extra == 0
        if (set(counts) != set(range(size)) or sorted(counts.values()) != [full] * (size - extra) + [full + 1] * extra
                or not (complete or (g == last and full + (extra > 0) <= scenario.num_iterations))):  # fmt: skip
            return _result(check, scenario, FAIL, f"generation batch {g}: rows used {dict(sorted(counts.items()))} "
                           f"({scenario.num_iterations} passes expected)")  # fmt: skip
    return _result(check, scenario, PASS, f"{len(record.losses)} micro-batches over {len(passes)} generation batches")


def assignments(record: Record) -> dict[int, list[int]] | str:
    """For each loss call (by index), the generation rows its micro-batch holds; or why a row has none."""
    assigned: dict[int, list[int]] = {}
    uses: dict[int, Counter] = {}
    for index, call in enumerate(record.losses):
        counter = uses.setdefault(call.generation, Counter())
        rows = _assign(call, record.generations[call.generation], record.pad_token_id, counter)
        if isinstance(rows, str):
            return f"loss call {index}: {rows}"
        assigned[index] = rows
    return assigned


def check_steps(scenario: TrainerScenario, record: Record, model) -> list[CheckResult]:
    """Every check of :data:`CHECKS` on a recorded run (``model``: the caller's untouched model, for its shapes)."""
    if record.error is not None:
        reason = f"trainer raised {type(record.error).__name__}: {record.error}"
        return [_result(CHECKS[0], scenario, FAIL, reason)] + [_result(c, scenario, NA, "no run") for c in CHECKS[1:]]
    results = [_result(CHECKS[0], scenario, PASS, f"{len(record.steps)} optimizer steps")]
    results.append(_check_rewards(scenario, record))
    results.extend(_check_advantages(scenario, record, model))
    assigned = assignments(record)
    if isinstance(assigned, str):
        return results + [_result(c, scenario, FAIL, assigned) for c in CHECKS[len(results) :]]
    results.append(check_partition(scenario, record, assigned))
    results.extend(_check_windows(scenario, record, model, assigned))
    return results


def _check_rewards(scenario: TrainerScenario, record: Record) -> CheckResult:
    check = "rewards_match_reference"
    for g, generation in enumerate(record.generations):
        ours = reference_rewards(scenario, generation)
        want = torch.tensor([[math.nan if r is None else r for r in column] for column in ours], dtype=torch.float64)
        got = generation.rewards_per_func.double().T  # (F, B)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=TRAINER_FP32.rtol, equal_nan=True):
            return _result(check, scenario, FAIL, f"generation {g}: TRL's rewards per function {got.tolist()} != "
                           f"the functions' own {want.tolist()} (None -> NaN)")  # fmt: skip
    return _result(check, scenario, PASS, f"{len(record.generations)} generation batches")


def _advantage_scale(scenario: TrainerScenario, total: torch.Tensor, rows: slice) -> float:
    """The size of an advantage's float32 rounding before cancellation: the group's largest reward over the
    denominator that scales it (a reward near its group mean gets an advantage near 0, but float32 rounds the mean
    relative to the rewards, so ``rtol`` applies to this, not to the advantage)."""
    from reference.advantages import EPS, nan_std, rloo_advantages

    group = total[rows]
    finite = group[~group.isnan()]
    if finite.numel() == 0:
        return 0.0
    if scenario.trainer == "rloo":
        spread = nan_std(rloo_advantages(total, scenario.num_generations).tolist())
        denominator = (spread + EPS) if scenario.normalize_advantages and not math.isnan(spread) else 1.0
    elif scenario.scale_rewards == "none":
        denominator = 1.0
    else:
        std = nan_std((group if scenario.scale_rewards == "group" else total).tolist())
        denominator = std + EPS if not math.isnan(std) else 1.0
    return float(finite.abs().max()) / denominator


def _check_advantages(scenario: TrainerScenario, record: Record, model) -> list[CheckResult]:
    """Two checks, as for the scenario suite: rows of groups with reward variance match the reference's advantages;
    rows of groups whose rewards are all equal (or all unscored) get exactly 0 (not checked where RLOO normalises
    advantages over the batch, which moves every advantage by the batch mean)."""
    names = ("advantages_match_reference", "zero_variance_groups_get_zero_advantage")
    n, worst, varied, flat, bad = scenario.num_generations, 0.0, 0, 0, []
    for g, (generation, kl) in enumerate(zip(record.generations, _rloo_kl(scenario, record, model), strict=True)):
        want, got = reference_advantages(scenario, generation, kl), generation.advantages.double()
        if got.shape != want.shape:
            return [_result(c, scenario, FAIL, f"generation {g}: shape {tuple(got.shape)}") for c in names]
        total = reference_rewards_total(scenario, generation, kl)
        for start in range(0, len(total), n):
            rows, group = slice(start, start + n), total[start : start + n]
            kept = group[~group.isnan()]
            if kept.numel() == 0 or bool((kept == kept[0]).all()):
                flat += n
                if (got[rows] != 0).any():
                    bad.append(f"generation {g} rewards {group.tolist()} -> advantages {got[rows].tolist()}")
                if not scenario.normalize_advantages:
                    continue
            varied += n
            allowed = TRAINER_FP32.atol + TRAINER_FP32.rtol * want[rows].abs().clamp(min=_advantage_scale(
                scenario, total, rows))  # fmt: skip
            if not bool(((got[rows] - want[rows]).abs() <= allowed).all()):
                reason = (f"generation {g}: advantages {got[rows].tolist()} != reference {want[rows].tolist()} "
                          f"({scenario.trainer}, rewards {list(scenario.reward_names)}, weights "
                          f"{scenario.reward_weights}, scale_rewards={scenario.scale_rewards}, normalize_advantages="
                          f"{scenario.normalize_advantages}, beta={scenario.beta})")  # fmt: skip
                return [_result(names[0], scenario, FAIL, reason), _result(names[1], scenario, NA, "not reached")]
            worst = max(worst, float((got[rows] - want[rows]).abs().max()))
    first = (_result(names[0], scenario, PASS, f"{varied} rows in varied groups, max |diff| {worst:.1e}") if varied
             else _result(names[0], scenario, NA, "every group had equal rewards"))  # fmt: skip
    if scenario.normalize_advantages:
        return [first, _result(names[1], scenario, NA, "normalize_advantages moves every advantage by the batch mean")]
    if not flat:
        return [first, _result(names[1], scenario, NA, "no group with equal rewards")]
    if bad:
        return [first, _result(names[1], scenario, FAIL, f"{len(bad)} zero-variance group(s): {bad[0]}")]
    return [first, _result(names[1], scenario, PASS, f"{flat} rows in zero-variance groups, all exactly 0")]


def _model_at(template, params: dict[str, torch.Tensor]):
    model = copy.deepcopy(template).double().eval()  # the oracle recomputes in float64
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def _step_config(scenario: TrainerScenario, eos: tuple[int, ...], bias_correction_kl: bool = True):
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


def _window_rows(record: Record, window: list[LossCall], assigned: dict[int, list[int]]):
    from reference.grpo_step import Row

    index_of = {id(call): i for i, call in enumerate(record.losses)}
    micro = []
    for call in window:
        gen = record.generations[call.generation]
        rows = assigned[index_of[id(call)]]
        micro.append([Row(gen.prompt_ids[i], gen.completion_ids[i], float(a), call.generation)
                      for i, a in zip(rows, call.advantages.tolist(), strict=True)])  # fmt: skip
    return micro


def _logged_name(scenario: TrainerScenario, name: str) -> str | None:
    """The key TRL logs a reference metric under (cispo logs one clip ratio, ``cispo_clip_ratio``)."""
    if scenario.loss_type != "cispo" or not name.startswith("clip_ratio"):
        return name
    return "cispo_clip_ratio" if name == "clip_ratio/region_mean" else None


def _norm(tensors: dict[str, torch.Tensor]) -> float:
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
    return max(_norm({n: p.grad for n, p in shadow.named_parameters() if p.grad is not None}), 1e-30)


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
    config = _step_config(scenario, record.eos_token_ids, record.use_bias_correction_kl)
    generating = {g: _model_at(model, record.steps[gen.step].params) for g, gen in enumerate(record.generations)}
    ref_model = _model_at(model, record.steps[0].params) if scenario.beta and scenario.trainer == "grpo" else None
    out = []
    for step, window in zip(record.steps, _windows(scenario, record), strict=True):
        if not window or step.grads is None:
            out.append(None)
            continue
        current = _model_at(model, step.params)
        rows = _window_rows(record, window, assigned)
        objective = _objective(scenario, rows, current, generating, config, ref_model)
        objective.objective.backward()
        grads = {n: p.grad for n, p in current.named_parameters()}
        norm = _norm(grads)
        factor = _clip_factor(norm, scenario.max_grad_norm)
        noise = _noise_scale(scenario, model, step, rows, generating, config, ref_model)
        out.append(StepReference(objective, {n: g * factor for n, g in grads.items()}, norm, noise * factor, noise))
    return out


def _check_windows(scenario, record, model, assigned) -> list[CheckResult]:
    """Loss calls, gradients and logged metrics per optimizer step against :func:`reference_steps`."""
    names = ("micro_losses_match_reference", "step_gradients_match_reference", "logged_metrics_match_reference")
    failures: dict[str, str] = {}
    worst = dict.fromkeys(names, 0.0)
    logged_values = 0
    windows = _windows(scenario, record)
    for k, (step, ref) in enumerate(
        zip(record.steps, reference_steps(scenario, record, model, assigned), strict=True)
    ):
        if ref is None:
            return [_result(n, scenario, FAIL, f"step {k}: no micro-batch or no gradient recorded") for n in names]
        for call, want in zip(windows[k], ref.output.micro_losses, strict=True):
            worst[names[0]] = max(worst[names[0]], abs(call.loss - want))
            if not _close(call.loss, want):
                failures.setdefault(names[0], f"step {k}: a loss call returned {call.loss:.8g}, reference {want:.8g}")
        diff = _norm({n: step.grads[n].double() - g for n, g in ref.grads.items()})
        worst[names[1]] = max(worst[names[1]], diff / max(ref.noise, 1e-30))
        if diff > TRAINER_FP32_PARAM_GRAD * ref.noise:
            failures.setdefault(names[1], f"step {k}: |grad - reference| = {diff:.3g}, |reference| = "
                                f"{_norm(ref.grads):.3g} (cancellation-free scale {ref.noise:.3g}; norm before "
                                f"clipping {ref.norm:.4g}, max_grad_norm {scenario.max_grad_norm})")  # fmt: skip
        logged_norm = step.logs.get("grad_norm")
        if logged_norm is not None and abs(logged_norm - ref.norm) > TRAINER_FP32_PARAM_GRAD * ref.noise_unclipped:
            failures.setdefault(names[1], f"step {k}: logged grad_norm {logged_norm:.8g}, reference {ref.norm:.8g}")
        for name, want in ref.output.metrics.items():
            logged = _logged_name(scenario, name)
            if logged is None or logged not in step.logs:
                continue
            logged_values += 1
            worst[names[2]] = max(worst[names[2]], abs(step.logs[logged] - want))
            if not _close(step.logs[logged], want, TRAINER_METRIC):
                failures.setdefault(names[2], f"step {k}: logged {logged} = {step.logs[logged]:.8g}, "
                                    f"reference {want:.8g}")  # fmt: skip
    summary = {names[0]: f"{len(record.losses)} loss calls, max |diff| {worst[names[0]]:.1e}",
               names[1]: f"{len(record.steps)} steps, max |diff| / noise scale {worst[names[1]]:.1e}",
               names[2]: f"{logged_values} logged values, max |diff| {worst[names[2]]:.1e}"}  # fmt: skip
    return [_result(n, scenario, FAIL, failures[n]) if n in failures else _result(n, scenario, PASS, summary[n])
            for n in names]  # fmt: skip
