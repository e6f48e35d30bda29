"""The readable GRPO loop: deterministic given its seeds, engine-independent, and a documented command line."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import statistics
import time
from dataclasses import asdict

import pytest
import torch

from cbverify.cli.train import make_generate
from cbverify.tolerances import FP32, TRAINER_FP32
from reference import tasks
from reference.advantages import compute_advantages
from reference.generate import generate
from reference.logprobs import per_token_logps
from reference.loss import LossConfig, grpo_loss
from reference.metrics import pad_rows
from reference.spec import SamplingParams
from reference.train import TrainConfig, build_parser, main, run, step_requests, train

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


TINY_ARGV = ["--steps", "2", "--num-prompts", "1", "--num-generations", "2", "--max-new-tokens", "8",
             "--min-terms", "2", "--max-terms", "2", "--threads", "1"]  # fmt: skip


def test_the_flags_parse_to_the_config_defaults_and_to_each_fields_type():
    args = build_parser().parse_args([])
    for name in TrainConfig.__slots__:
        assert getattr(args, name) == getattr(TrainConfig(), name), name
    argv = ["--steps", "3", "--temperature", "0.5", "--epsilon-high", "0.3", "--is-correction", "token_truncate",
            "--model", "m", "--is-clip-max", "2"]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert (args.steps, args.temperature, args.epsilon_high, args.is_correction) == (3, 0.5, 0.3, "token_truncate")
    assert type(args.steps) is int and type(args.is_clip_max) is float and args.model == "m"
    assert args.json is False and args.threads == 2
    for flag, value in (("--loss-type", "ppo"), ("--scale-rewards", "rank"), ("--is-correction", "tis")):
        with pytest.raises(SystemExit):  # refused by the parser, before any config is built
            build_parser().parse_args([flag, value])


def test_the_command_line_prints_each_step_train_computes_and_the_reward_summary(capsys, monkeypatch):
    """``main`` (``python -m reference.train``) against ``train`` called directly with the same config: 10 steps
    (the summary's window is 10 // 5 = 2 steps), 16 new tokens and a learning rate of 1e-3 (rewards that change, a
    KL that shows in the table's four decimals)."""
    argv = [*TINY_ARGV, "--steps", "10", "--max-new-tokens", "16", "--learning-rate", "0.001"]
    config = TrainConfig(**{**TINY, "steps": 10, "max_new_tokens": 16, "learning_rate": 0.001})
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # main sets it: the command never reaches the network
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main([*argv, "--json"]) == 0
        assert torch.get_num_threads() == 1 and os.environ["HF_HUB_OFFLINE"] == "1"
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    expected = train(config)
    assert len(lines) == len(expected) + 1
    printed = [json.loads(line) for line in lines[:-1]]
    assert _strip_timing(printed) == _strip_timing(expected)
    config_line = json.loads(err.lstrip().splitlines()[0])  # the run's whole config, first on stderr
    assert config_line == {name: getattr(config, name) for name in TrainConfig.__slots__}
    rewards = [r["mean_reward"] for r in expected]
    first, last = statistics.mean(rewards[:2]), statistics.mean(rewards[-2:])
    assert lines[-1].startswith(f"mean reward: first 2 steps {first:.3f}, last 2 steps {last:.3f}; ")

    assert main([*argv, "--steps", "3"]) == 0  # the table: one row per step with the step's numbers
    rows = capsys.readouterr().out.strip().splitlines()[:-1]
    assert any(f"{r['kl']:.4f}" != "0.0000" for r in expected[:3])  # the KL column can tell
    for record, row in zip(expected[:3], rows, strict=True):  # a run's first steps do not depend on its length
        assert row.startswith(
            f"step {record['step']:3d}  reward {record['mean_reward']:.3f}  loss {record['loss']:+.4f}  "
            f"kl {record['kl']:.4f}  clip {record['clip_fraction']:.3f}  grad {record['grad_norm']:.3f}  "
            f"len {record['mean_completion_length']:.1f}  |dlogp| {record['logprob_abs_diff_max']:.1e}  "
        )


def test_the_command_line_generates_with_the_engine_it_is_given_on_the_model_it_trains(capsys):
    seen = []

    def make_generate(model):
        def engine(requests):
            seen.append((model, len(requests), model.training, next(model.parameters()).detach().clone()))
            return generate(model, requests)

        return engine

    argv = [*TINY_ARGV, "--max-new-tokens", "16", "--json"]  # 16 tokens: mixed rewards, so step 0 moves the weights
    assert run(build_parser().parse_args(argv), make_generate=make_generate) == 0
    (model, n0, training0, before), (same, n1, training1, after) = seen
    assert isinstance(model, torch.nn.Module) and same is model and (n0, n1) == (2, 2)
    assert not (training0 or training1)  # the loop hands the engine its model in eval mode
    assert not torch.equal(before, after)  # ... the model it trains: step 1 generates with step 0's update


def test_the_config_builds_its_loss_config_field_for_field_and_refuses_non_positive_rates():
    fields = {"epsilon_high": 0.3, "beta": 0.05, "is_correction": "token_mask", "is_clip_max": 1.5}
    config = TrainConfig(loss_type="dr_grpo", epsilon=0.1, max_new_tokens=12, **fields)
    assert config.loss_config() == LossConfig(loss_type="dr_grpo", epsilon_low=0.1, max_completion_length=12, **fields)
    bads = ({"temperature": 0.0}, {"learning_rate": 0.0}, {"max_grad_norm": 0.0}, {"max_grad_norm": -1.0})
    for bad in bads:
        with pytest.raises(ValueError, match="must be > 0"):
            TrainConfig(**bad)


def test_step_requests_hold_the_configs_sampling_and_problems_and_distinct_seeds():
    config = TrainConfig(num_prompts=3, num_generations=2, min_terms=3, max_terms=4, temperature=0.8,
                         max_new_tokens=20)  # fmt: skip
    seeds = []
    for step in range(3):
        problems, requests = step_requests(config, step)
        assert len(problems) == 3 and len(requests) == 6
        for i, request in enumerate(requests):
            assert request.prompt_ids == tuple(tasks.prompt_ids(problems[i // 2]))
            assert request.sampling == SamplingParams(temperature=0.8, max_new_tokens=20)
            assert request.eos_token_ids == (tasks.EOS_ID,)
        assert all(3 <= len(p.terms) <= 4 for p in problems)
        seeds += [r.seed for r in requests]
    other = [r.seed for step in range(3) for r in step_requests(TrainConfig(**{**asdict(config), "seed": 1}), step)[1]]
    assert len(set(seeds)) == len(seeds) and not set(seeds) & set(other)  # per step, completion and run seed


def _shifted(model, shift: float = -0.2):
    """The oracle engine with every sampler log-prob moved by ``shift``: a sampler that disagrees with the trainer by
    a known amount, so the importance correction and the mismatch metrics have something to see."""

    def engine(requests):
        rollouts = generate(model, requests)
        engine.rollouts = rollouts
        return [dataclasses.replace(r, logprobs=tuple(x + shift for x in r.logprobs)) for r in rollouts]

    return engine


def test_one_step_logs_what_its_rollouts_give_and_moves_each_weight_by_one_adam_step(llama):
    """One step, against the definitions: the reward, length and stop metrics of the engine's rollouts, the sampler
    mismatch (exactly the shift, at the sampling temperature), the GRPO loss of the step's batch (first iteration:
    the current log-probs are the old ones), and the update: a first AdamW step without weight decay moves each
    weight by ``-lr * g / (|g| + eps)``, ``g`` its gradient after clipping."""
    config = TrainConfig(steps=1, num_prompts=2, num_generations=2, max_new_tokens=16, min_terms=2, max_terms=2,
                         temperature=0.9, learning_rate=2e-4, scale_rewards="batch", loss_type="dr_grpo", epsilon=0.1,
                         epsilon_high=0.3, beta=0.05, is_correction="token_truncate", is_clip_max=1.1)  # fmt: skip
    model = copy.deepcopy(llama.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = _shifted(model)
    start = time.perf_counter()
    (record,) = train(config, model=model, generate=engine)
    wall = time.perf_counter() - start
    problems, _ = step_requests(config, 0)
    rollouts = engine.rollouts
    rewards = torch.tensor([tasks.reward(problems[i // 2], r.completion_ids) for i, r in enumerate(rollouts)])
    assert 0.0 < float(rewards.mean()) < 1.0  # mixed rewards: the step has a gradient
    assert record["mean_reward"] == float(rewards.mean())
    assert record["mean_completion_length"] == statistics.mean(len(r.completion_ids) for r in rollouts)
    assert record["stop_fraction"] == statistics.mean(r.finish_reason == "stop" for r in rollouts)
    assert 0.0 < record["step_time_s"] <= wall
    assert record["logprob_abs_diff_max"] == pytest.approx(0.2, abs=1e-4)
    assert record["logprob_abs_diff_mean"] == pytest.approx(0.2, abs=1e-4)

    prompts, completions = [list(r.prompt_ids) for r in rollouts], [list(r.completion_ids) for r in rollouts]
    old, mask = pad_rows(per_token_logps(llama.model, prompts, completions, 0.9))  # the initial model is the ref
    sampling = pad_rows([torch.tensor([x - 0.2 for x in r.logprobs]) for r in rollouts])[0]
    advantages = compute_advantages(rewards, 2, "batch")
    want = grpo_loss(old, old, old, sampling, advantages, mask, config.loss_config())
    assert record["loss"] == pytest.approx(float(want.loss), rel=1e-6, abs=1e-9)
    assert record["kl"] == pytest.approx(0.0, abs=1e-9)  # the first step's policy is the reference

    # the update by hand: the loss's gradient on a fresh copy, clipped to max_grad_norm, then a first AdamW step
    hand = copy.deepcopy(llama.model).train()
    current = per_token_logps(hand, prompts, completions, 0.9, grad=True)
    logps = torch.stack([torch.nn.functional.pad(c.double(), (0, mask.shape[1] - len(c))) for c in current])
    grpo_loss(logps, old, old, sampling, advantages, mask, config.loss_config()).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(hand.parameters(), config.max_grad_norm))
    assert record["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for (name, p), h in zip(model.named_parameters(), hand.parameters(), strict=True):
        g = torch.zeros_like(h) if h.grad is None else h.grad
        want = before[name] - config.learning_rate * g / (g.abs() + 1e-8)  # bias-corrected: m = g, v = g^2
        torch.testing.assert_close(p.detach(), want, rtol=4e-7, atol=1e-9)  # float32: a few ulps


def test_the_kl_reference_is_a_frozen_copy_and_without_beta_there_is_none(llama):
    config = TrainConfig(**{**TINY, "max_new_tokens": 16, "learning_rate": 1e-3, "beta": 0.05})
    history = train(config, model=copy.deepcopy(llama.model))
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-9) and history[1]["kl"] > 1e-6  # step 0 moved the policy
    assert all(r["kl"] is None for r in train(TrainConfig(**{**TINY, "beta": 0.0}), model=copy.deepcopy(llama.model)))
    one = train(TrainConfig(**{**TINY, "steps": 1, "beta": 1.0}), model=copy.deepcopy(llama.model))  # any beta > 0
    assert one[0]["kl"] == pytest.approx(0.0, abs=1e-9)


def test_each_iteration_on_a_batch_keeps_its_old_log_probs_and_the_record_is_the_first_ones(llama):
    """``num_iterations = 2`` by hand with torch's AdamW: the second update's ratios are against the batch's old
    log-probs (not the updated policy's), with a learning rate large enough that the second iteration clips."""
    config = TrainConfig(steps=1, num_prompts=2, num_generations=2, max_new_tokens=16, min_terms=2, max_terms=2,
                         learning_rate=1e-2, num_iterations=2, beta=0.0)  # fmt: skip
    model = copy.deepcopy(llama.model)
    engine = _shifted(model, 0.0)
    (record,) = train(config, model=model, generate=engine)
    problems, _ = step_requests(config, 0)
    rollouts = engine.rollouts
    rewards = torch.tensor([tasks.reward(problems[i // 2], r.completion_ids) for i, r in enumerate(rollouts)])
    prompts, completions = [list(r.prompt_ids) for r in rollouts], [list(r.completion_ids) for r in rollouts]
    old, mask = pad_rows(per_token_logps(llama.model, prompts, completions, config.temperature))
    sampling = pad_rows([torch.tensor(r.logprobs) for r in rollouts])[0]
    advantages = compute_advantages(rewards, 2, config.scale_rewards)
    hand = copy.deepcopy(llama.model).train()
    optimizer = torch.optim.AdamW(hand.parameters(), lr=config.learning_rate, weight_decay=0.0)
    outs = []
    for _ in range(2):
        current = per_token_logps(hand, prompts, completions, config.temperature, grad=True)
        logps = torch.stack([torch.nn.functional.pad(c.double(), (0, mask.shape[1] - len(c))) for c in current])
        outs.append(grpo_loss(logps, old, None, sampling, advantages, mask, config.loss_config()))
        optimizer.zero_grad()
        outs[-1].loss.backward()
        torch.nn.utils.clip_grad_norm_(hand.parameters(), config.max_grad_norm)
        optimizer.step()
    assert outs[0].clip_fraction == 0.0 < outs[1].clip_fraction  # the second iteration is off-policy and clips
    assert (record["loss"], record["clip_fraction"]) == (pytest.approx(float(outs[0].loss.detach()), rel=1e-6), 0.0)
    for p, h in zip(model.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p, h, rtol=1e-5, atol=1e-7)
