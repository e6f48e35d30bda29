"""The reference GRPO math equals what the installed TRL computes, by running TRL's own code on drawn inputs.

One minimal ``GRPOTrainer`` is built per module on a private copy of the bundled Llama (offline: local path,
``Dataset.from_list``, ``report_to="none"``, ``use_cpu=True``). For each drawn batch, TRL's
``_generate_and_score_completions`` runs with its generator, reward functions and log-prob forward replaced by
functions that return the drawn tensors, and TRL's ``_compute_loss`` runs with the forward replaced the same way.
Everything else (advantages, IS ratios, clipping, KL, normalisers, logged metrics) is TRL's code, untouched.

Versions: every TRL release :mod:`cbverify.upstream.trl_compat` knows (1.0 to 1.16; ``cbverify matrix`` runs this
file in each). What differs between releases (``_generate``'s return layout, the log-prob forward's arity, the
IS-bound attributes) is read through it, and every attribute the test sets must already exist on the trainer (a
renamed one would otherwise be set for nothing). Inputs a release cannot be asked about are not drawn, and pytest's
summary names them: a loss type ``_compute_loss`` lacks, inputs a registered finding says the release gets wrong
(luspo before 1.10, NaN rewards before 1.6), NaN sampler log-probs before 1.11 and empty completions before 1.15
(handled from then), a lower IS bound before 1.6. A release whose trainer the test cannot drive at all is a
skip naming what it lacks.

Tolerance: ``MATH_RTOL``, plus ``MATH_ATOL`` for values that are exactly 0 on one side. Every tensor handed
to TRL is float64, so TRL computes in float64 too, except the sampling log-probs, which TRL turns into a float32
tensor; the strategy draws them float32-representable, so no rounding happens there either.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cbverify.tolerances import MATH_ATOL, MATH_RTOL
from cbverify.upstream import trl_compat as compat
from cbverify.upstream.findings import by_id
from property_tests.helpers import SUMMARY
from property_tests.strategies import grpo_batches, loss_configs
from reference.advantages import compute_advantages
from reference.loss import LOSS_TYPES, grpo_loss, importance_weights

pytestmark = pytest.mark.upstream
RTOL = MATH_RTOL
# what the installed release can be asked (see the module docstring)
LUSPO_PADDING, UNSCORABLE = (
    by_id("luspo-token-level-loss-counts-padding"),
    by_id("unscorable-completion-scored-as-zero"),
)
KNOWN_WRONG = {"luspo": LUSPO_PADDING.id} if LUSPO_PADDING.on_installed_version() else {}
TRL_LOSS_TYPES = tuple(t for t in LOSS_TYPES if t in compat.loss_types() and t not in KNOWN_WRONG)
NAN_REWARDS = not UNSCORABLE.on_installed_version()
UNSCORED_TOKENS = compat.behaviour("nan_sampler_logprobs_weight_1")
EMPTY_ROWS = compat.behaviour("empty_completions_scored")
IS_CLIP_MIN = compat.has_is_clip_min()


def _not_drawn() -> list[str]:
    """The inputs this release is not asked about, in words."""
    missing = [f"loss_type {t!r} ({KNOWN_WRONG.get(t, 'not in _compute_loss')})" for t in LOSS_TYPES
               if t not in TRL_LOSS_TYPES]  # fmt: skip
    missing += [] if NAN_REWARDS else [f"NaN rewards ({UNSCORABLE.id})"]
    missing += [] if UNSCORED_TOKENS else ["NaN sampler log-probs (IS weight 1 from trl 1.11)"]
    missing += [] if EMPTY_ROWS else ["empty completions (scored from trl 1.15)"]
    missing += [] if IS_CLIP_MIN else ["a lower IS bound (vllm_importance_sampling_clip_min, trl 1.6)"]
    return missing


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A minimal GRPOTrainer. It owns a *private* model copy: TRL patches the model's forward (fused LM head)."""
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from reference.models import load

    try:
        compat.require_hooks("grpo")
        compat.generate_output(GRPOTrainer, **_generate_values([1], [[0.0]]))
    except compat.MissingFeature as missing:
        pytest.skip(str(missing))
    if not_drawn := _not_drawn():
        SUMMARY.append(f"reference vs trl {trl.__version__}: not drawn on this release: {'; '.join(not_drawn)}")
    model, tokenizer = load("tiny-llama-arith")
    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl-output")), report_to="none", use_cpu=True,
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


def _set(obj, **values) -> None:
    """Set attributes that exist already: one a release renamed would be set for nothing."""
    for name, value in values.items():
        assert hasattr(obj, name), f"trl {compat.VERSION}: {type(obj).__name__} has no {name}"
        setattr(obj, name, value)


def _configure(trainer, batch: dict, config, scale_rewards: str) -> None:
    """Point the trainer's attributes at one drawn scenario (TRL reads them at call time)."""
    _set(
        trainer, num_generations=batch["num_generations"], scale_rewards=scale_rewards,
        use_vllm=config.is_correction is not None,  # TRL applies the IS correction only on its vLLM path
        vllm_importance_sampling_correction=config.is_correction is not None,
        vllm_importance_sampling_mode=config.is_correction,
        **compat.is_bound_attributes(config.is_clip_min, config.is_clip_max),
        beta=0.0,  # during scoring: the reference log-probs are handed to the loss directly
        loss_type=config.loss_type, epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high,
        importance_sampling_level=config.importance_sampling_level,
        max_completion_length=config.max_completion_length or 8,
    )  # fmt: skip
    _set(trainer.args, delta=config.delta, use_bias_correction_kl=config.use_bias_correction_kl)


def _generate_values(lengths: list[int], sampling: list[list[float]]) -> dict:
    """Every field any release's ``_generate`` returns, by TRL's name (token values are irrelevant: every
    log-prob is drawn); ``num_items_in_batch`` is the completion-token count (returned by ``_generate`` up to 1.8)."""
    return dict(
        prompt_ids_list=[[1, 5]] * len(lengths), completion_ids_list=[[5] * n for n in lengths],
        tool_mask_list=None, completions=["x"] * len(lengths), num_items_in_batch=torch.tensor(float(sum(lengths))),
        sampling_per_token_logps_list=sampling, extra_fields={}, images=None, tool_images=None,
    )  # fmt: skip


@contextlib.contextmanager
def _drawn_generation(trainer, batch: dict):
    """Replace TRL's generator, reward functions and log-prob forward by the drawn batch."""
    lengths = batch["completion_mask"].sum(-1).tolist()
    sampling = [row[:n].tolist() for row, n in zip(batch["sampling_per_token_logps"], lengths, strict=True)]
    generated = compat.generate_output(type(trainer), **_generate_values(lengths, sampling))
    rewards = batch["rewards"][:, None]  # (B, 1): one reward function
    old = batch["old_per_token_logps"]
    with (
        mock.patch.object(trainer, "_generate", lambda prompts: generated),
        mock.patch.object(trainer, "_calculate_rewards", lambda *args: rewards),
        mock.patch.object(
            trainer, "_get_per_token_logps_and_entropies", lambda *a, **k: compat.logps_output(old, None)
        ),
    ):
        yield


def _trl_loss(trainer, scored: dict, batch: dict, config) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``_compute_loss`` on its own scored batch, with the current policy's log-probs drawn."""
    per = batch["per_token_logps"].clone().requires_grad_(True)
    inputs = dict(scored, old_per_token_logps=batch["old_per_token_logps"])
    if config.beta != 0.0:
        inputs["ref_per_token_logps"] = batch["ref_per_token_logps"]
    trainer.beta = config.beta
    forward = lambda *a, **k: compat.logps_output(per, torch.zeros_like(per))  # noqa: E731
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


@given(
    batch=grpo_batches(nan_rewards=NAN_REWARDS, unscored_tokens=UNSCORED_TOKENS, empty_rows=EMPTY_ROWS),
    config=loss_configs(loss_types=TRL_LOSS_TYPES, is_clip_min=IS_CLIP_MIN),
    scale_rewards=st.sampled_from(["group", "batch", "none"]),
)
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
