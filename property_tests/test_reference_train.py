"""The readable GRPO loop: deterministic given its seeds, engine-independent, and a documented command line."""

from __future__ import annotations

import copy
import math

import pytest

from cbverify.cli.train import make_generate
from cbverify.tolerances import FP32, TRAINER_FP32
from reference.train import TrainConfig, build_parser, train

TINY = {"steps": 2, "num_prompts": 1, "num_generations": 2, "max_new_tokens": 8, "min_terms": 2, "max_terms": 2}
TIMING_KEYS = ("step_time_s",)


def _strip_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in record.items() if k not in TIMING_KEYS} for record in history]


def test_train_gives_the_same_per_step_numbers_twice_from_the_same_seeds(llama):
    model, _ = llama
    config = TrainConfig(**TINY, num_iterations=2)  # two updates per batch: the second one is off-policy
    first = train(config, model=copy.deepcopy(model))
    second = train(config, model=copy.deepcopy(model))
    assert _strip_timing(first) == _strip_timing(second)
    assert len(first) == config.steps
    for record in first:
        assert all(math.isfinite(record[k]) for k in ("loss", "grad_norm", "mean_reward", "kl", "mismatch_kl"))
        assert 0.0 <= record["mean_reward"] <= 1.0 and 0.0 <= record["clip_fraction"] <= 1.0
        # the reference engine samples from the trainer's own distribution: no mismatch beyond float32 shape effects
        # (the fp32 tier's max: the reference against its own teacher forcing reaches 1.2e-5)
        assert record["logprob_abs_diff_max"] <= FP32.logprob_max_abs


def test_training_with_the_cb_impl_engine_reproduces_the_reference_engine_run(llama):
    """Same seeds, same counter-based noise: the rollouts, hence every logged number, must agree."""
    model, _ = llama
    reference = train(TrainConfig(**TINY), model=copy.deepcopy(model))
    cb_model = copy.deepcopy(model)
    cb_impl = train(TrainConfig(**TINY), model=cb_model, generate=make_generate("cb_impl")(cb_model))
    for ours, theirs in zip(reference, cb_impl, strict=True):
        assert ours["mean_reward"] == theirs["mean_reward"]
        assert ours["mean_completion_length"] == theirs["mean_completion_length"]
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=TRAINER_FP32.rtol, abs=TRAINER_FP32.atol)


def test_every_train_config_field_is_a_documented_flag():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for name in TrainConfig.__slots__:
        assert name in actions, f"TrainConfig.{name} has no --{name.replace('_', '-')} flag"
        assert actions[name].help and "default" in actions[name].help
    assert all(a.help for a in parser._actions)


def test_cbverify_train_offers_the_oracle_and_cb_impl_and_nothing_else():
    from cbverify.cli import build_parser as cli_parser

    args = cli_parser().parse_args(["train", "--engine", "cb_impl", "--steps", "1"])
    assert args.engine == "cb_impl" and args.steps == 1
    with pytest.raises(SystemExit):
        cli_parser().parse_args(["train", "--engine", "vllm"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"steps": 0}, "steps"), ({"loss_type": "ppo"}, "loss_type"),
     ({"scale_rewards": "rank"}, "scale_rewards"), ({"min_terms": 5, "max_terms": 3}, "min_terms")],
)  # fmt: skip
def test_invalid_train_configs_are_rejected_with_a_message_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**overrides)
