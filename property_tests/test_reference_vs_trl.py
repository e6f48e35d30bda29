"""The reference GRPO math equals what the installed TRL computes, by running TRL's own code on drawn inputs.

One minimal ``GRPOTrainer`` is built per module on a private copy of the bundled Llama (offline: local path,
``Dataset.from_list``, ``report_to="none"``, ``use_cpu=True``). For each drawn batch, TRL's
``_generate_and_score_completions`` runs with its generator, reward functions and log-prob forward replaced by
functions that return the drawn tensors, and TRL's ``_compute_loss`` runs with the forward replaced the same way.
Everything else (advantages, IS ratios, clipping, KL, normalisers, logged metrics) is TRL's code, untouched.

Expected version: TRL 1.16.0 (``loss_type="dapo"`` default, ``use_bias_correction_kl`` default True, NaN-aware
advantages, IS correction inside ``_generate_and_score_completions``); the test names it and fails loudly on
another version rather than silently comparing against different semantics.

Tolerance: ``MATH_RTOL``, plus ``MATH_ATOL`` for values that are exactly 0 on one side. Every tensor handed
to TRL is float64, so TRL computes in float64 too, except the sampling log-probs, which TRL turns into a float32
tensor; the strategy draws them float32-representable, so no rounding happens there either.
"""

from __future__ import annotations

import contextlib
import tempfile
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cbverify.tolerances import MATH_ATOL, MATH_RTOL
from property_tests.strategies import grpo_batches, loss_configs
from reference.advantages import compute_advantages
from reference.loss import grpo_loss, importance_weights

pytestmark = pytest.mark.upstream
EXPECTED_TRL = "1.16.0"
RTOL = MATH_RTOL


@pytest.fixture(scope="module")
def trainer():
    """A minimal GRPOTrainer. It owns a *private* model copy: TRL patches the model's forward (fused LM head)."""
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from reference.models import load

    if trl.__version__ != EXPECTED_TRL:
        pytest.fail(f"this cross-check encodes TRL {EXPECTED_TRL} semantics; installed TRL is {trl.__version__}")
    model, tokenizer = load("tiny-llama-arith")
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="cbverify-trl-"), report_to="none", use_cpu=True,
        per_device_train_batch_size=2, num_generations=2, max_completion_length=8, logging_strategy="no",
        save_strategy="no", gradient_accumulation_steps=1,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": "Q:1+2\n"}] * 4)
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, which we do not run
    trainer.model.train()
    return trainer


def _configure(trainer, batch: dict, config, scale_rewards: str) -> None:
    """Point the trainer's attributes at one drawn scenario (TRL reads them at call time)."""
    trainer.num_generations = batch["num_generations"]
    trainer.scale_rewards = scale_rewards
    trainer.use_vllm = config.is_correction is not None  # TRL applies the IS correction only on its vLLM path
    trainer.vllm_importance_sampling_correction = config.is_correction is not None
    trainer.vllm_importance_sampling_mode = config.is_correction
    trainer.vllm_importance_sampling_clip_min = config.is_clip_min
    trainer.vllm_importance_sampling_clip_max = config.is_clip_max
    trainer.beta = 0.0  # during scoring: the reference log-probs are handed to the loss directly
    trainer.loss_type = config.loss_type
    trainer.epsilon_low, trainer.epsilon_high = config.epsilon_low, config.epsilon_high
    trainer.importance_sampling_level = config.importance_sampling_level
    trainer.max_completion_length = config.max_completion_length or 8
    trainer.args.delta = config.delta
    trainer.args.use_bias_correction_kl = config.use_bias_correction_kl


@contextlib.contextmanager
def _drawn_generation(trainer, batch: dict):
    """Replace TRL's generator, reward functions and log-prob forward by the drawn batch."""
    mask = batch["completion_mask"]
    lengths = mask.sum(-1).tolist()
    completion_ids = [[5] * n for n in lengths]  # token values are irrelevant: every log-prob is drawn
    sampling = [row[:n].tolist() for row, n in zip(batch["sampling_per_token_logps"], lengths, strict=True)]
    generated = ([[1, 5]] * len(lengths), completion_ids, None, ["x"] * len(lengths), sampling, {}, None, None)
    rewards = batch["rewards"][:, None]  # (B, 1): one reward function
    old = batch["old_per_token_logps"]
    with (
        mock.patch.object(trainer, "_generate", lambda prompts: generated),
        mock.patch.object(trainer, "_calculate_rewards", lambda *args: rewards),
        mock.patch.object(trainer, "_get_per_token_logps_and_entropies", lambda *a, **k: (old, None, None)),
    ):
        yield


def _trl_loss(trainer, scored: dict, batch: dict, config) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``_compute_loss`` on its own scored batch, with the current policy's log-probs drawn."""
    per = batch["per_token_logps"].clone().requires_grad_(True)
    inputs = dict(scored, old_per_token_logps=batch["old_per_token_logps"])
    if config.beta != 0.0:
        inputs["ref_per_token_logps"] = batch["ref_per_token_logps"]
    trainer.beta = config.beta
    forward = lambda *a, **k: (per, torch.zeros_like(per), None)  # noqa: E731
    with mock.patch.object(trainer, "_get_per_token_logps_and_entropies", forward):
        loss = trainer._compute_loss(trainer.model, inputs)
    (grad,) = torch.autograd.grad(loss, per)
    return loss.detach(), grad


def _reference_loss(batch: dict, advantages: torch.Tensor, config):
    per = batch["per_token_logps"].clone().requires_grad_(True)
    out = grpo_loss(
        per, batch["old_per_token_logps"], batch["ref_per_token_logps"], batch["sampling_per_token_logps"],
        advantages, batch["completion_mask"], config,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, per)
    return out, grad


@given(batch=grpo_batches(), config=loss_configs(), scale_rewards=st.sampled_from(["group", "batch", "none"]))
def test_reference_advantages_is_weights_and_loss_equal_trl_on_drawn_batches(trainer, batch, config, scale_rewards):
    _configure(trainer, batch, config, scale_rewards)
    with _drawn_generation(trainer, batch):
        scored = trainer._generate_and_score_completions([{"prompt": "x"}] * len(batch["rewards"]))

    advantages = compute_advantages(batch["rewards"], batch["num_generations"], scale_rewards)
    # TRL 1.16's nanstd computes the Bessel factor n / (n - 1) in float32 even for float64 rewards, so its advantages
    # carry a relative error up to ~6e-8: well inside rtol 1e-6, but enough to be amplified where a loss gradient
    # cancels. So the loss below is fed TRL's own advantages, isolating the loss code from the advantage code.
    # atol: for a constant group TRL's plain mean can be one ulp (~4e-16) off, which eps = 1e-4 turns into ~4e-12.
    torch.testing.assert_close(advantages, scored["advantages"], rtol=RTOL, atol=MATH_ATOL)

    mask = batch["completion_mask"]
    if config.is_correction is not None:
        weights = importance_weights(batch["old_per_token_logps"], batch["sampling_per_token_logps"], mask, config)
        torch.testing.assert_close(weights, scored["importance_sampling_ratio"], rtol=RTOL, atol=0.0)

    trl_loss, trl_grad = _trl_loss(trainer, scored, batch, config)
    ours, our_grad = _reference_loss(batch, scored["advantages"], config)
    torch.testing.assert_close(ours.loss.detach(), trl_loss, rtol=RTOL, atol=MATH_ATOL)
    torch.testing.assert_close(our_grad, trl_grad, rtol=RTOL, atol=MATH_ATOL)

    logged = trainer._metrics["train"]
    if mask.shape[1] == 1 and not mask.all():
        # TRL 1.16 quirk: with a batch whose longest completion is 1 token, its logging helpers take the (B, 1)
        # per-token metrics for per-sequence ones and average them over *all* rows, padding included. The reference
        # averages over real tokens, so the logged metrics are compared only where the two conventions coincide.
        return
    if config.loss_type == "cispo":
        assert ours.clip_fraction == pytest.approx(logged["cispo_clip_ratio"][-1], rel=RTOL)
    else:
        assert ours.clip_fraction == pytest.approx(logged["clip_ratio/region_mean"][-1], rel=RTOL)
        assert ours.clip_low_fraction == pytest.approx(logged["clip_ratio/low_mean"][-1], rel=RTOL)
        assert ours.clip_high_fraction == pytest.approx(logged["clip_ratio/high_mean"][-1], rel=RTOL)
    if config.beta != 0.0:
        assert ours.kl == pytest.approx(logged["kl"][-1], rel=RTOL, abs=MATH_ATOL)
