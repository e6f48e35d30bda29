"""A trainer run recorded optimizer step by optimizer step, for the step checks (``cbverify.upstream.steps``).

:func:`record_run` trains a copy of the model with TRL's real ``GRPOTrainer`` or ``RLOOTrainer`` for a
:class:`TrainerScenario`, rolling out with the oracle (deterministic: the same rows on every run; through
``rollout_func`` for GRPO, in place of ``_generate_single_turn`` for a GRPO that calls its ``rollout_func`` only with
vLLM (trl 0.24 to 0.28: :func:`replace_single_turn`), in place of ``_generate`` for RLOO, which takes no
``rollout_func``), and records, on the
trainer instance only (TRL is never edited):

- every generation batch as scored (rows, TRL's per-function rewards and advantages) and the reward functions'
  inputs, with the optimizer step it was generated at;
- every loss call (its micro-batch and the value returned), with its optimizer step and its generation batch;
- per optimizer step, through a ``TrainerCallback``: the parameters at the start of the step, the gradient handed to
  the optimizer (after TRL's accumulation and the trainer's gradient clipping) and the logged metrics.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cbverify.upstream import trl_compat
from cbverify.upstream.scenario import TrainerScenario, build_trainer, own_precision_environment, release_trainer


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


def replace_single_turn(trainer, rollout: Callable) -> None:
    """Make a ``GRPOTrainer`` that calls its ``rollout_func`` only with vLLM (trl 0.24 to 0.28) generate with
    ``rollout``: its ``_generate_single_turn`` returns what ``rollout(prompts, trainer)`` completes, in the layout the
    installed ``_generate`` unpacks (:func:`cbverify.upstream.trl_compat.single_turn_layout`); TRL's own ``_generate``
    does the rest (its completion masks, token counts and metrics), as it does for a rollout_func from 0.29 on."""
    layout = trl_compat.single_turn_output(type(trainer), prompt_ids=0, completion_ids=0, logprobs=0)  # refuses early
    del layout

    def single_turn(prompts, *_, **__):
        out = rollout(prompts, trainer)
        return trl_compat.single_turn_output(
            type(trainer), prompt_ids=out["prompt_ids"], completion_ids=out["completion_ids"], logprobs=out["logprobs"]
        )

    trainer._generate_single_turn = single_turn


def oracle_trainer(scenario: TrainerScenario, model, tokenizer, rollout_func: Callable):
    """``scenario``'s trainer on ``model`` generating with ``rollout_func`` on every release that can: through its
    ``rollout_func`` argument where the release calls it without vLLM (GRPO from trl 0.29), in place of
    ``_generate_single_turn`` where it does not (GRPO on trl 0.24 to 0.28: none, or only on the vLLM path), in place of
    ``_generate`` for RLOO (which takes no ``rollout_func``)."""
    from cbverify.upstream.rollout import replace_generate

    if scenario.trainer == "grpo" and trl_compat.rollout_func_off_vllm():
        return build_trainer(scenario, model, tokenizer, rollout_func=rollout_func)
    trainer = build_trainer(scenario, model, tokenizer)
    if scenario.trainer == "grpo":
        replace_single_turn(trainer, rollout_func)
    else:
        replace_generate(trainer, rollout_func)
    return trainer


def record_run(scenario: TrainerScenario, model, tokenizer, prepare: Callable[[object], None] | None = None) -> Record:
    """Train a float32 copy of ``model`` for ``scenario.max_steps`` optimizer steps on the ``rollout_func`` path (the
    oracle rolls out) and record every step (see the module docstring), from the caller's precision environment
    (an earlier bf16 trainer's leak on transformers 4.x does not make this run autocast: the leak is judged where a
    scenario asks for it). A trainer error is kept in ``Record.error``.
    ``prepare(trainer)`` runs before the recorder is installed (the power tests inject faults with it)."""
    from cbverify.upstream.rollout import make_rollout_func
    from cbverify.upstream.run import _quiet_loggers

    if scenario.path != "rollout_func" or scenario.rollout_backend != "reference":
        raise ValueError("step checks run on the rollout_func path with the reference backend")
    torch.manual_seed(scenario.seed)
    work = copy.deepcopy(model).float().train()
    record = Record()
    rollout_func = make_rollout_func("reference", work, tokenizer, base_seed=scenario.seed)
    with warnings.catch_warnings(), _quiet_loggers(), own_precision_environment():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = oracle_trainer(scenario, work, tokenizer, rollout_func)
        if prepare is not None:
            prepare(trainer)
        _install(trainer, record)
        try:
            trainer.train()
        except Exception as err:  # a crash is a result: step_run_completes reports it
            record.error = err
        finally:
            release_trainer(trainer)
    return record
