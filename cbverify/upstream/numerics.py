"""Numerical invariants of a captured trainer run, each against ``reference`` (the oracle), never against TRL.

- trainer per-token log-probs on the rolled-out tokens vs ``reference.logprobs.per_token_logps``
  (``cbverify.tolerances`` tiers);
- advantages vs ``reference.advantages.compute_advantages`` on the rewards the trainer computed;
- the loss vs ``reference.loss.grpo_loss`` fed the trainer's own per-token log-probs (so only the loss math is judged).

The sampler's side (sampled tokens' support, log-prob semantics, importance-sampling weights) is in
``cbverify.upstream.sampler_checks``. Checks that need the generation-time model use the caller's untouched model and
the *first* generation only (it ran before any optimizer step, so its weights are the caller's).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cbverify.tolerances import (
    FP32,
    LOW_PRECISION,
    TRAINER_FP32,
    TRAINER_FP32_GRAD_ATOL,
)
from cbverify.upstream.capture import Capture
from cbverify.upstream.findings import FAIL, NA, PASS, CheckResult, flat_groups_seen
from cbverify.upstream.findings import scenario_result as _result
from cbverify.upstream.scenario import TrainerScenario

FP32_MAX, BF16_MAX, BF16_MEAN = FP32.logprob_max_abs, LOW_PRECISION.logprob_max_abs, LOW_PRECISION.logprob_mean_abs
LOSS_RTOL, LOSS_ATOL = TRAINER_FP32.rtol, TRAINER_FP32.atol


def trainer_logprobs_match_reference(scenario: TrainerScenario, capture: Capture) -> list[CheckResult]:
    check = "trainer_logprobs_match_reference"
    if not capture.losses:
        return [_result(check, scenario, FAIL, "no loss call was observed")]
    diffs = []
    for record in capture.losses:
        mask = record.inputs["completion_mask"].bool()
        for i, ref in enumerate(record.reference_logps):
            got = record.per_token_logps[i][mask[i]].float().cpu()
            if got.numel() != ref.numel():
                return [_result(check, scenario, FAIL, f"row {i}: {got.numel()} trainer log-probs, {ref.numel()} ref")]
            diffs.append((got - ref).abs())
    flat = torch.cat(diffs) if diffs else torch.zeros(0)
    worst, mean = (float(flat.max()), float(flat.mean())) if flat.numel() else (0.0, 0.0)
    # the tier of the precision the trainer really ran in (trainer_precision_follows_its_config judges the choice)
    bf16 = scenario.bf16 or capture.trainer_info.get("mixed_precision") == "bf16"
    ok = worst <= BF16_MAX and mean <= BF16_MEAN if bf16 else worst <= FP32_MAX
    tier = f"bf16 tier max {BF16_MAX}/mean {BF16_MEAN}" if bf16 else f"fp32 tier max {FP32_MAX}"
    return [_result(check, scenario, PASS if ok else FAIL, f"{flat.numel()} tokens: max |diff| {worst:.2e}, mean "
                    f"{mean:.2e} ({tier})", (("max_diff", (worst,)), ("mean_diff", (mean,))))]  # fmt: skip


def _groups(rewards: torch.Tensor, num_generations: int) -> list[tuple[int, bool]]:
    """``(start row, all rewards equal)`` for each group of the flat (B,) reward vector."""
    return [(g, bool((rewards[g : g + num_generations] == rewards[g]).all()))
            for g in range(0, rewards.numel(), num_generations)]  # fmt: skip


def advantages_match_reference(scenario: TrainerScenario, capture: Capture, scale_rewards: str) -> list[CheckResult]:
    """Two checks: groups with reward variance match the float64 reference (``TRAINER_FP32``: TRL computes in float32);
    groups whose rewards are all equal get advantage exactly 0 (what the reference gives: nothing to learn)."""
    from reference.advantages import compute_advantages

    names = ("advantages_match_reference", "zero_variance_groups_get_zero_advantage")
    if scenario.trainer != "grpo":
        return [
            _result(n, scenario, NA, "RLOO's leave-one-out baseline has no reference implementation") for n in names
        ]
    if not capture.scored or len(capture.scored) != len(capture.rewards):
        reason = f"{len(capture.scored)} scored batches, {len(capture.rewards)} reward sets"
        return [_result(n, scenario, FAIL, reason) for n in names]
    worst, zero_rows, varied_rows, zero_bad, zero_seen = 0.0, 0, 0, [], []
    n = scenario.num_generations
    # rewards are gathered over every process, advantages are this process's slice of them (one process: all)
    rank, world = capture.trainer_info.get("process_index", 0), capture.trainer_info.get("num_processes", 1)
    for scored, rewards in zip(capture.scored, capture.rewards, strict=True):
        got = scored["advantages"].double()
        if rewards.shape[0] != got.shape[0] * world:
            why = f"{rewards.shape[0]} gathered rewards for {got.shape[0]} advantages on each of {world} process(es)"
            return [_result(n_, scenario, FAIL, why) for n_ in names]
        mine = slice(rank * got.shape[0], (rank + 1) * got.shape[0])
        expected = compute_advantages(rewards[:, 0].double(), n, scale_rewards)[mine]
        flat_row = torch.tensor([flat for _, flat in _groups(rewards[:, 0], n) for _ in range(n)])[mine]
        values = rewards[mine, 0]
        if flat_row.any():
            zero_rows += int(flat_row.sum())
            if (got[flat_row] != 0).any():
                zero_bad.append(f"rewards {values[flat_row].tolist()} -> advantages {got[flat_row].tolist()}")
                zero_seen += [(values[flat_row].tolist(), got[flat_row].tolist())]
        varied = ~flat_row
        varied_rows += int(varied.sum())
        if not torch.allclose(got[varied], expected[varied], rtol=LOSS_RTOL, atol=LOSS_ATOL):
            msg = f"advantages {got[varied].tolist()} != reference {expected[varied].tolist()}"
            seen = (("rewards", tuple(values.tolist())), ("advantages", tuple(got.tolist())))
            return [_result(names[0], scenario, FAIL, msg, seen), _result(names[1], scenario, NA, "not reached")]
        if varied.any():
            worst = max(worst, float((got[varied] - expected[varied]).abs().max()))
    first = (_result(names[0], scenario, PASS, f"{varied_rows} rows in varied groups, max |diff| {worst:.1e}")
             if varied_rows else _result(names[0], scenario, NA, "every group had equal rewards"))  # fmt: skip
    if not zero_rows:
        return [first, _result(names[1], scenario, NA, "no group with equal rewards")]
    if zero_bad:
        return [
            first,
            _result(
                names[1],
                scenario,
                FAIL,
                f"{len(zero_bad)} zero-variance group(s): {zero_bad[0]}",
                flat_groups_seen(zero_seen),
            ),
        ]
    return [first, _result(names[1], scenario, PASS, f"{zero_rows} rows in zero-variance groups, all exactly 0")]


def loss_matches_reference(scenario: TrainerScenario, capture: Capture, trainer_args: dict) -> list[CheckResult]:
    """``trainer_args``: epsilon_low, epsilon_high, delta, steps_per_generation, max_completion_length."""
    from reference.loss import LossConfig, grpo_loss

    check = "loss_matches_reference"
    if scenario.trainer != "grpo":
        return [_result(check, scenario, NA, "RLOO's loss has no reference implementation")]
    if scenario.top_entropy_quantile < 1.0:  # the mask comes from the trainer's entropies of the whole batch
        return [_result(check, scenario, NA, "entropy masking is judged by the optimizer-step checks "
                        "(cbverify.upstream.steps: make fuzz-trl)")]  # fmt: skip
    if not capture.losses:
        return [_result(check, scenario, FAIL, "no loss call was observed")]
    config = LossConfig(loss_type=scenario.loss_type, epsilon_low=trainer_args["epsilon_low"],
                        epsilon_high=trainer_args["epsilon_high"], delta=trainer_args["delta"],
                        importance_sampling_level=scenario.importance_sampling_level,
                        max_completion_length=scenario.max_completion_length)  # fmt: skip
    corrected = replace(
        config,
        is_correction=scenario.is_mode,
        is_clip_min=trainer_args["is_clip_min"],
        is_clip_max=trainer_args["is_clip_max"],
    )  # the same with TRL's IS correction applied
    worst, worst_grad = 0.0, 0.0
    for record in capture.losses:
        x = record.inputs
        old = x.get("old_per_token_logps")
        items = None
        if "num_items_in_batch" in x:  # TRL rescales the generation batch's count to one accumulation window
            items = float(x["num_items_in_batch"]) * record.accumulation_steps / trainer_args["steps_per_generation"]
            # and each of N processes to 1/N of it: gradients are averaged over processes, so their mean is the global
            # objective (the count is gathered over every process)
            items /= trainer_args.get("num_processes", 1)
        per = record.per_token_logps.double().requires_grad_(True)
        sampling = x.get("sampling_per_token_logps") if "importance_sampling_ratio" in x else None  # IS applied
        ref = grpo_loss(per, None if old is None else old.double(), None,
                        None if sampling is None else sampling.double(), x["advantages"].double(),
                        x["completion_mask"].double(), config if sampling is None else corrected,
                        num_items_in_batch=items)  # fmt: skip
        scale = record.accumulation_steps if scenario.loss_type in ("grpo", "bnpo", "dr_grpo", "luspo") else 1
        expected = float(ref.loss) / scale  # TRL divides these loss types by the accumulation steps itself
        if abs(record.loss - expected) > LOSS_ATOL + LOSS_RTOL * abs(expected):
            return [_result(check, scenario, FAIL, f"trainer loss {record.loss:.8g} != reference {expected:.8g}")]
        worst = max(worst, abs(record.loss - expected))
        if record.logps_grad:  # the loss value is ~0 on-policy; its gradient is not, and is what trains the model
            (ref.loss / scale).backward()
            got, want = record.logps_grad[0].double(), per.grad * x["completion_mask"].double()
            got = got * x["completion_mask"].double()
            if not torch.allclose(got, want, rtol=LOSS_RTOL, atol=TRAINER_FP32_GRAD_ATOL):
                diff = float((got - want).abs().max())
                return [_result(check, scenario, FAIL, f"dloss/dlogps differs from the reference (max {diff:.2e})")]
            worst_grad = max(worst_grad, float((got - want).abs().max()))
    return [_result(check, scenario, PASS, f"{len(capture.losses)} loss call(s), max |diff| {worst:.1e}, "
                    f"gradient max |diff| {worst_grad:.1e}")]  # fmt: skip
