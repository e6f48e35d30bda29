"""A trainer configuration checked optimizer step by optimizer step.

:func:`cbverify.upstream.recording.record_run` trains with TRL's real trainer and records every generation batch,
loss call and optimizer step; :func:`check_steps` judges the record against the reference's recomputation
(``cbverify.upstream.step_reference``): each result names the quantity and the step.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from cbverify.tolerances import TRAINER_FP32, TRAINER_FP32_PARAM_GRAD, TRAINER_METRIC
from cbverify.upstream import trl_compat
from cbverify.upstream.findings import FAIL, NA, PASS, CheckResult, flat_groups_seen
from cbverify.upstream.findings import scenario_result as _result
from cbverify.upstream.recording import Generation, LossCall, Record
from cbverify.upstream.scenario import TrainerScenario
from cbverify.upstream.step_reference import (
    norm_of,
    reference_advantages,
    reference_rewards,
    reference_rewards_total,
    reference_steps,
    rloo_kl,
    step_config,
    step_windows,
    window_rows,
)
from reference.advantages import combine_rewards

CHECKS = (
    "step_run_completes", "rewards_match_reference", "advantages_match_reference",
    "zero_variance_groups_get_zero_advantage", "micro_batches_partition_generation", "micro_losses_match_reference",
    "step_gradients_match_reference", "logged_metrics_match_reference", "logged_rewards_match_reference",
)  # fmt: skip


def _close(got: float, want: float, tol=TRAINER_FP32) -> bool:
    return abs(got - want) <= tol.atol + tol.rtol * abs(want)


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
        results += [_result(c, scenario, FAIL, assigned) for c in CHECKS[len(results) : -1]]
        return [*results, _check_logged_rewards(scenario, record)]
    results.append(check_partition(scenario, record, assigned))
    results.extend(_check_windows(scenario, record, model, assigned))
    results.append(_check_logged_rewards(scenario, record))
    return results


def _check_logged_rewards(scenario: TrainerScenario, record: Record) -> CheckResult:
    """GRPO logs, at the optimizer step that generated a batch, ``reward``: the mean over the batch of each row's
    weighted reward, and ``reward_std``: their (Bessel) standard deviation (up to trl 0.26: the mean of the group
    standard deviations that scale the advantages, :func:`_batch_stats`), averaged over the batches generated within
    the step. Judged where every row was scored by some function (how an unscored row counts is another question)."""
    check = "logged_rewards_match_reference"
    if scenario.trainer != "grpo":
        return _result(check, scenario, NA, f"{scenario.trainer} logs its own reward statistics")
    windows, logged, judged, unscored = step_windows(scenario, record), set(), 0, 0
    for k, (step, window) in enumerate(zip(record.steps, windows, strict=True)):
        new = sorted({call.generation for call in window} - logged)
        logged.update(new)
        if not new or "reward" not in step.logs:
            continue
        rewards = [reference_rewards(scenario, record.generations[g]) for g in new]
        weights = list(scenario.reward_weights) if scenario.reward_weights else None
        totals = [combine_rewards(r, weights) for r in rewards]
        if any(bool(t.isnan().any()) for t in totals):
            unscored += 1
            continue
        judged += 1
        weighted, plain = _batch_stats(scenario, totals), _batch_stats(scenario, [combine_rewards(r) for r in rewards])
        for name, value in zip(("reward", "reward_std"), weighted, strict=True):
            got = step.logs.get(name)
            if got is None or not _close(got, value, TRAINER_METRIC):
                logs = (step.logs.get("reward", math.nan), step.logs.get("reward_std", math.nan))
                # every weight 1: what a release that ignores the weights logs
                observed = (("logged", logs), ("unweighted", plain), ("weighted", weighted))
                return _result(check, scenario, FAIL, f"step {k}: logged {name} = {got}, reference {value:.8g} "
                               f"(weights {scenario.reward_weights})", observed)  # fmt: skip
    if not judged:
        why = f"{unscored} logged batches held a row no reward function scored" if unscored else "no reward logged"
        return _result(check, scenario, NA, why)
    return _result(check, scenario, PASS, f"{judged} logged reward means and stds")


def _batch_stats(scenario: TrainerScenario, totals: list[torch.Tensor]) -> tuple[float, float]:
    """The mean over generation batches of each batch's mean and (Bessel) standard deviation of its rows' rewards:
    the batch's, or where the release logs the standard deviation that scales the advantages
    (:func:`cbverify.upstream.trl_compat.reward_std_logged`), each group's, averaged over the rows."""

    def std(t: torch.Tensor) -> float:
        if trl_compat.reward_std_logged() == "batch" or scenario.scale_rewards == "batch":
            return float(t.std())
        return float(t.view(-1, scenario.num_generations).std(dim=1).mean())

    return (sum(float(t.mean()) for t in totals) / len(totals), sum(std(t) for t in totals) / len(totals))


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
    n, worst, varied, flat, bad, seen = scenario.num_generations, 0.0, 0, 0, [], []
    for g, (generation, kl) in enumerate(zip(record.generations, rloo_kl(scenario, record, model), strict=True)):
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
                    seen.append((group.tolist(), got[rows].tolist()))
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
        return [
            first,
            _result(names[1], scenario, FAIL, f"{len(bad)} zero-variance group(s): {bad[0]}", flat_groups_seen(seen)),
        ]
    return [first, _result(names[1], scenario, PASS, f"{flat} rows in zero-variance groups, all exactly 0")]


def _logged_name(scenario: TrainerScenario, name: str) -> str | None:
    """The key TRL logs a reference metric under (cispo logs one clip ratio, ``cispo_clip_ratio``)."""
    if scenario.loss_type != "cispo" or not name.startswith("clip_ratio"):
        return name
    return "cispo_clip_ratio" if name == "clip_ratio/region_mean" else None


def _check_windows(scenario, record, model, assigned) -> list[CheckResult]:
    """Loss calls, gradients and logged metrics per optimizer step against :func:`reference_steps`."""
    names = ("micro_losses_match_reference", "step_gradients_match_reference", "logged_metrics_match_reference")
    failures: dict[str, str] = {}
    seen: dict[str, tuple] = {}  # what a finding's model reads (``active_tokens``: the normalisers involved)
    worst = dict.fromkeys(names, 0.0)
    logged_values = 0
    windows = step_windows(scenario, record)
    for k, (step, ref) in enumerate(
        zip(record.steps, reference_steps(scenario, record, model, assigned), strict=True)
    ):
        if ref is None:
            return [_result(n, scenario, FAIL, f"step {k}: no micro-batch or no gradient recorded") for n in names]
        tokens = active_tokens(scenario, record, windows[k], assigned)
        for call, want in zip(windows[k], ref.output.micro_losses, strict=True):
            worst[names[0]] = max(worst[names[0]], abs(call.loss - want))
            if not _close(call.loss, want):
                failures.setdefault(names[0], f"step {k}: a loss call returned {call.loss:.8g}, reference {want:.8g}")
                seen.setdefault(names[0], (("ratio", tuple(c.loss / w if w else math.nan for c, w in
                                                          zip(windows[k], ref.output.micro_losses, strict=True))),
                                           *tokens))  # fmt: skip
        diff = norm_of({n: step.grads[n].double() - g for n, g in ref.grads.items()})
        worst[names[1]] = max(worst[names[1]], diff / max(ref.noise, 1e-30))
        if diff > TRAINER_FP32_PARAM_GRAD * ref.noise:
            failures.setdefault(names[1], f"step {k}: |grad - reference| = {diff:.3g}, |reference| = "
                                f"{norm_of(ref.grads):.3g} (cancellation-free scale {ref.noise:.3g}; norm before "
                                f"clipping {ref.norm:.4g}, max_grad_norm {scenario.max_grad_norm})")  # fmt: skip
            size2 = sum(float((g * g).sum()) for g in ref.grads.values())
            scale = sum(float((step.grads[n].double() * g).sum()) for n, g in ref.grads.items()) / max(size2, 1e-300)
            residual = norm_of({n: step.grads[n].double() - scale * g for n, g in ref.grads.items()})
            seen.setdefault(names[1], (("grad_scale", (scale,)), ("grad_residual", (residual,)),
                                       ("grad_noise", (TRAINER_FP32_PARAM_GRAD * ref.noise,)),
                                       ("grad_norm", (math.sqrt(size2),)), *tokens))  # fmt: skip
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
    return [_result(n, scenario, FAIL, failures[n], seen.get(n, ())) if n in failures
            else _result(n, scenario, PASS, summary[n]) for n in names]  # fmt: skip


def active_tokens(scenario: TrainerScenario, record: Record, window: list[LossCall], assigned) -> tuple:
    """The token counts a loss normaliser can be made of, for a finding's model: per loss call of the window, the
    window's active tokens (the reference's dapo / cispo normaliser), its generation batch's (TRL's
    ``num_items_in_batch`` from 1.9) and every completion token of that batch, truncated rows that
    ``mask_truncated_completions`` removes included (``num_items_in_batch`` up to 1.8: the completion lengths), and
    the accumulation and generation steps."""
    from dataclasses import replace

    from reference.grpo_step import Row, completion_mask

    config = step_config(scenario, record.eos_token_ids, record.use_bias_correction_kl)
    unmasked = replace(config, mask_truncated_completions=False)
    rows = window_rows(record, window, assigned)
    in_window = sum(float(m.sum()) for micro in rows for m in completion_mask(micro, config))

    def in_generation(g: int, config) -> float:
        gen = record.generations[g]
        batch = [Row(p, c, 0.0, g) for p, c in zip(gen.prompt_ids, gen.completion_ids, strict=True)]
        return sum(float(m.sum()) for m in completion_mask(batch, config))

    return (("window_tokens", (in_window,) * len(window)),
            ("generation_tokens", tuple(in_generation(call.generation, config) for call in window)),
            ("generation_completion_tokens", tuple(in_generation(call.generation, unmasked) for call in window)),
            ("steps", (float(scenario.gradient_accumulation_steps), float(scenario.spg))))  # fmt: skip
