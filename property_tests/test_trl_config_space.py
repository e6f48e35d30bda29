"""TRL's ``GRPOTrainer`` over drawn configurations, every optimizer step recomputed by the oracle.

Each example trains the bundled arithmetic Llama for a few optimizer steps (past the first generation batch) with a
drawn ``GRPOConfig`` (``strategies.trainer_configs``), rolling out with the oracle through ``rollout_func`` so the
rollouts are exact, and checks what ``cbverify.upstream.steps`` recomputes: per-function rewards, advantages, the
partition of each generation batch into micro-batches, every loss call, every step's gradient and logged metrics.
A FAIL passes only when a registered finding covers it (``cbverify.upstream.findings``); Hypothesis shrinks any
other to the config fields that matter. The default budget is small and derandomised; ``make fuzz-trl`` runs a long
one with the example database (``CBVERIFY_TRL_EXAMPLES``).

The metamorphic properties need no reference: the same rollouts give the same update however they are split into
accumulation windows and generation batches; settings that only concern vLLM change nothing without it.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbverify.tolerances import TRAINER_FP32_PARAM_GRAD
from cbverify.upstream.scenario import TrainerScenario
from cbverify.upstream.steps import CHECKS, assignments, check_steps, record_run, reference_steps
from cbverify.upstream.suite import judge
from property_tests.strategies import trainer_configs

pytestmark = pytest.mark.upstream

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
EXAMPLES = int(os.environ.get("CBVERIFY_TRL_EXAMPLES", "2"))  # `make fuzz-trl` raises it (with the example database)
BUDGET = settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@BUDGET
@given(scenario=trainer_configs(loss_types=LOSS_TYPES))
def test_every_optimizer_step_matches_the_reference(llama, scenario):
    model, tokenizer = llama
    results = check_steps(scenario, record_run(scenario, model, tokenizer), model)
    assert [r.check for r in results] == list(CHECKS), "every check reports, in order"
    judged = [(r, *judge(r, scenario, model.config.model_type)) for r in results]
    bad = [(r, label) for r, ok, label in judged if not ok]
    assert not bad, "\n".join([f"{label}: {r.check}: {r.reason}" for r, label in bad] + [repr(scenario)])


def _run(scenario, llama):
    record = record_run(scenario, *llama)
    assert record.error is None, f"{type(record.error).__name__}: {record.error}\n{scenario!r}"
    return record


@settings(BUDGET, max_examples=max(1, EXAMPLES // 4))
@given(scenario=trainer_configs(loss_types=LOSS_TYPES, max_steps=2))
def test_settings_that_only_concern_vllm_change_nothing_without_it(llama, scenario):
    """TRL applies its importance-sampling correction only with vLLM: on the ``rollout_func`` path, switching it on
    with another mode and other bounds leaves every gradient and every logged number bit-identical."""
    other = replace(scenario, is_correction=not scenario.is_correction, is_clip_max=2.0, is_clip_min=0.5,
                    is_mode="token_truncate" if scenario.is_mode == "sequence_mask" else "sequence_mask")  # fmt: skip
    first, second = _run(scenario, llama), _run(other, llama)
    for k, (a, b) in enumerate(zip(first.steps, second.steps, strict=True)):
        assert all(torch.equal(a.grads[n], b.grads[n]) for n in a.grads), f"step {k} gradient differs\n{scenario!r}"
        varying = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
        assert {k_: v for k_, v in a.logs.items() if k_ not in varying} == {
            k_: v for k_, v in b.logs.items() if k_ not in varying
        }, f"step {k} logs differ\n{scenario!r}"


@settings(BUDGET, max_examples=max(1, EXAMPLES // 4))
@given(
    loss_type=st.sampled_from(["grpo", "dr_grpo", "dapo", "cispo"]),
    seed=st.integers(0, 2**16),
    temperature=st.sampled_from([1.0, 1.5]),
)
def test_the_same_rollouts_give_the_same_update_however_they_are_split(llama, loss_type, seed, temperature):
    """One generation batch of 4 rows trained as one micro-batch, or as two accumulated micro-batches of 2: the
    optimizer step's gradient is the same (``bnpo`` is excluded: its documentation normalises per local batch).
    Tolerance: float32 rounding, sized by the reference's cancellation-free scale of the step's row terms."""
    base = TrainerScenario(path="rollout_func", rollout_backend="reference", num_generations=2, max_steps=1,
                           per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=1,
                           loss_type=loss_type, reward="length", more_rewards=("digits",), max_terms=2,
                           max_completion_length=14, temperature=temperature, seed=seed,
                           max_grad_norm=0.0)  # fmt: skip
    split = replace(base, per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=2)
    whole_run, split_run = _run(base, llama), _run(split, llama)
    assert whole_run.generations[0].completion_ids == split_run.generations[0].completion_ids, "same rollouts"
    ref = reference_steps(base, whole_run, llama.model, assignments(whole_run))[0]
    whole, parts = whole_run.steps[0].grads, split_run.steps[0].grads
    diff = math.sqrt(sum(float(((whole[n].double() - parts[n].double()) ** 2).sum()) for n in whole))
    assert diff <= 2 * TRAINER_FP32_PARAM_GRAD * ref.noise, (
        f"|whole - split| = {diff:.3g}, noise scale {ref.noise:.3g}"
    )


_CLEAN: dict[str, str] = {}  # the clean run's verdict, shared by the power tests


def _scaled_loss(factor):
    def prepare(trainer):  # a wrong number inside the loss: the loss call returns it and its gradient follows
        inner = trainer._compute_loss
        trainer._compute_loss = lambda model, inputs: inner(model, inputs) * factor

    return prepare


def _scaled_backward(factor):
    def prepare(trainer):  # a wrong scale after the loss (e.g. accumulation): only the applied gradient shows it
        inner = trainer.accelerator.backward
        trainer.accelerator.backward = lambda loss, **kwargs: inner(loss * factor, **kwargs)

    return prepare


@pytest.mark.parametrize(
    "fault", [_scaled_loss(0.98), _scaled_backward(1.02)], ids=["loss x0.98", "backward x1.02"],
)  # fmt: skip
def test_the_gradient_check_catches_a_trainer_off_by_two_percent(llama, fault):
    """The gradient tier's power in absolute terms, on a clean run that passes: a gradient 2% off, from inside the
    loss (a wrong normaliser; one token of a 50-token window dropped) or after it (a wrong accumulation scale), fails
    ``step_gradients_match_reference``. (On-policy loss *values* are ~0, GRPO advantages being centred: the gradient,
    not the value, is what carries such a fault.) Measured here: clean |diff| / noise scale 1.7e-5, the net gradient
    5.7x the scale, so 2% is ~110x the allowance of 1e-3."""
    scenario = TrainerScenario(path="rollout_func", rollout_backend="reference", num_generations=2, max_steps=1,
                               per_device_train_batch_size=4, loss_type="dapo", reward="arithmetic", max_terms=2,
                               max_completion_length=16, temperature=1.5, max_grad_norm=0.0)  # fmt: skip

    def verdict(prepare=None) -> str:
        results = check_steps(scenario, record_run(scenario, *llama, prepare=prepare), llama.model)
        return next(r.status for r in results if r.check == "step_gradients_match_reference")

    if "clean" not in _CLEAN:
        _CLEAN["clean"] = verdict()
    assert _CLEAN["clean"] == "PASS"
    assert verdict(fault) == "FAIL"
