"""Structural invariants of one captured trainer run: alignment, failures, "generation leaves no trace", IS plumbing.

Each function takes ``(scenario, capture)`` and returns :class:`~cbverify.upstream.findings.CheckResult` objects, one
per check, PASS / FAIL / NOT-APPLICABLE with a one-line reason. Expected prompt ids are rebuilt independently of TRL
(BOS + the task's character encoding), never read back from the trainer.
"""

from __future__ import annotations

import json

import torch

from cbverify.tolerances import PASS_THROUGH_ATOL
from cbverify.upstream.capture import Capture, GenerationRecord
from cbverify.upstream.findings import FAIL, NA, PASS, CheckResult
from cbverify.upstream.findings import scenario_result as _result
from cbverify.upstream.scenario import TrainerScenario
from reference import tasks


def _err(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


def run_completes(scenario: TrainerScenario, capture: Capture) -> list[CheckResult]:
    if capture.run_error is not None:
        return [_result("run_completes", scenario, FAIL, f"trainer raised {_err(capture.run_error)}")]
    what = "evaluate()" if scenario.evaluate else f"{scenario.max_steps} training step(s)"
    return [_result("run_completes", scenario, PASS, f"{what} completed, {len(capture.losses)} loss call(s)")]


def _raw_failures(record: GenerationRecord) -> list[str]:
    failed = []
    for out in record.raw_outputs or []:
        status = str(getattr(out, "status", ""))
        if getattr(out, "error", None) is not None or "FAILED" in status:
            failed.append(f"{out.request_id}: {out.error}")
    return failed


def no_silent_request_failure(scenario: TrainerScenario, capture: Capture) -> list[CheckResult]:
    """Every request either finished or failed loudly (the trainer raised an error that names the failure)."""
    check = "no_silent_request_failure"
    if not capture.generations:
        return [_result(check, scenario, FAIL, f"no generation happened ({_err(capture.run_error)})")]
    for record in capture.generations:
        failed = _raw_failures(record)
        if failed:
            outcome = "training went on" if capture.run_error is None else f"trainer raised {_err(capture.run_error)}"
            return [_result(check, scenario, FAIL, f"{len(failed)}/{len(record.raw_outputs)} requests failed in the "
                            f"engine ({failed[0][:90]}); the trainer did not check .error: {outcome}")]  # fmt: skip
        if record.completion_ids is not None and len(record.completion_ids) != len(record.prompts):
            return [_result(check, scenario, FAIL, f"{len(record.prompts)} prompts but "
                            f"{len(record.completion_ids)} completions reached the trainer")]  # fmt: skip
    return [_result(check, scenario, PASS, f"{len(capture.generations)} generation(s), every request finished")]


def masked_as_truncated(scenario: TrainerScenario, completion: list[int], eos_ids) -> bool:
    """Whether TRL masks this completion out entirely: ``mask_truncated_completions`` and it did not end on EOS."""
    return scenario.mask_truncated_completions and not (completion and completion[-1] in eos_ids)


def completions_aligned(scenario: TrainerScenario, capture: Capture, eos_ids: tuple[int, ...]) -> list[CheckResult]:
    """Count, order, prompt ids and the EOS convention of what reached the trainer, and the scored batch's rows."""
    check = "completions_aligned"
    problems: list[str] = []
    bos_dropped = 0  # rows whose prompt ids are the expected ones without their leading BOS (a model reads it)
    for g, record in enumerate(capture.generations):
        if record.completion_ids is None:
            problems.append(f"generation {g} returned nothing ({_err(record.error) if record.error else '?'})")
            continue
        n = len(record.prompts)
        if len(record.completion_ids) != n or len(record.prompt_ids) != n:
            problems.append(f"generation {g}: {n} prompts, {len(record.prompt_ids)} prompt ids, "
                            f"{len(record.completion_ids)} completions")  # fmt: skip
            continue
        first = capture.trainer_info.get("process_index", 0) * n  # this process's rows of the global batch
        groups: dict[int, set] = {}
        for i, prompt in enumerate(record.prompts):  # a group may start on an earlier process
            groups.setdefault((first + i) // scenario.num_generations, set()).add(json.dumps(prompt, default=str))
        if split := [k for k, members in groups.items() if len(members) != 1]:
            problems.append(f"generation {g}: the rows of group {split[0]} are not one prompt's")
        for i, (prompt, ids, completion) in enumerate(
            zip(record.prompts, record.prompt_ids, record.completion_ids, strict=True)
        ):
            expected = [tasks.BOS_ID, *tasks.encode(prompt)]
            if ids != expected:
                problems.append(f"row {i}: prompt ids {ids} != {expected} for {prompt!r}")
                bos_dropped += ids == expected[1:]
            if not completion:
                problems.append(f"row {i}: empty completion")
            if len(completion) > scenario.max_completion_length:
                problems.append(f"row {i}: {len(completion)} tokens > max_completion_length")
            early = [p for p, t in enumerate(completion[:-1]) if t in eos_ids]
            if early:
                problems.append(f"row {i}: EOS at position {early[0]} is followed by more tokens")
        for r, raw in enumerate(record.raw_outputs or []):
            tokens = list(raw.generated_tokens)
            cut = next((p + 1 for p, t in enumerate(tokens) if t in eos_ids), len(tokens))
            if r < n and tokens[:cut] != record.completion_ids[r]:
                problems.append(f"row {r}: engine output {tokens[:cut]} != trainer's {record.completion_ids[r]}")
    for s, scored in enumerate(capture.scored):
        record = capture.generations[s] if s < len(capture.generations) else None
        if record is None or record.completion_ids is None:
            continue
        rows = [row[m.bool()].tolist() for row, m in zip(scored["completion_ids"], scored["completion_mask"],
                                                         strict=True)]  # fmt: skip
        rows = [c if masked_as_truncated(scenario, c, eos_ids) and not r else r
                for r, c in zip(rows, record.completion_ids, strict=False)]  # fmt: skip
        if rows != record.completion_ids:
            problems.append(f"scored batch {s}: completion rows differ from what generation returned")
    if problems:
        seen = (("problems", (float(len(problems)),)), ("bos_dropped", (float(bos_dropped),)))
        return [_result(check, scenario, FAIL, f"{len(problems)} problem(s); first: {problems[0]}", seen)]
    if not capture.generations:
        return [_result(check, scenario, FAIL, "no generation happened")]
    rows = sum(len(r.prompts) for r in capture.generations)
    return [_result(check, scenario, PASS, f"{rows} rows: counts, group order, prompt ids, EOS convention ok")]


def _rng_comparable(scenario: TrainerScenario, capture: Capture) -> bool:
    """Sampling with torch.multinomial (generate, cb) legitimately advances the global RNG; greedy decoding and
    counter-based samplers (our rollout_func backends) must not touch it."""
    return scenario.greedy or scenario.path == "rollout_func"


def generation_leaves_no_trace(scenario: TrainerScenario, capture: Capture) -> list[CheckResult]:
    """Five checks comparing the model and the global RNG before and after every generation."""
    names = ("generation_keeps_attn_and_config", "generation_keeps_params", "generation_keeps_mode",
             "generation_keeps_rng", "generation_keeps_forward")  # fmt: skip
    found: dict[str, str] = {}
    seen: dict[str, tuple] = {}  # what a finding's model reads: the probe's change and its scale
    for g, record in enumerate(capture.generations):
        before, after = record.before, record.after
        if after is None:
            continue
        if before.attn_implementation != after.attn_implementation:
            found.setdefault(names[0], f"attn {before.attn_implementation} -> {after.attn_implementation}")
        elif before.config_json != after.config_json:
            found.setdefault(names[0], "model.config.to_dict() changed")
        changed = [(b, a) for b, a in zip(before.params, after.params, strict=True) if b != a]
        if len(before.params) != len(after.params) or changed:
            b, a = changed[0] if changed else (before.params, after.params)
            found.setdefault(
                names[1],
                f"{len(changed)} parameter(s) changed, first {b[0]}: dtype {b[1]}->{a[1]}, "
                f"device {b[2]}->{a[2]}, same object {b[3] == a[3]}, requires_grad {b[4]}->{a[4]}",
            )
        if before.training != after.training:
            found.setdefault(names[2], f"generation {g} in {record.mode} mode: model.training "
                             f"{before.training[0]} -> {after.training[0]}")  # fmt: skip
        if _rng_comparable(scenario, capture) and not torch.equal(before.rng_state, after.rng_state):
            found.setdefault(names[3], "global torch RNG state changed although nothing was sampled from it")
        if not torch.equal(before.probe_logits, after.probe_logits):
            diff = (before.probe_logits - after.probe_logits).abs().max().item()
            found.setdefault(names[4], f"probe forward after generation differs (max |diff| {diff:.3g})")
            seen.setdefault(
                names[4], (("max_abs_diff", (diff,)), ("max_abs_logit", (before.probe_logits.abs().max().item(),)))
            )
    results = []
    for name in names:
        if not capture.generations or capture.generations[0].after is None:
            results.append(_result(name, scenario, FAIL, "no generation was observed"))
        elif name == names[3] and not _rng_comparable(scenario, capture):
            results.append(_result(name, scenario, NA, "sampling via torch.multinomial advances the global RNG"))
        elif name in found:
            results.append(_result(name, scenario, FAIL, found[name], seen.get(name, ())))
        else:
            results.append(_result(name, scenario, PASS, f"unchanged across {len(capture.generations)} generation(s)"))
    return results


def sampler_logprobs_reach_trainer(scenario: TrainerScenario, capture: Capture) -> list[CheckResult]:
    check = "sampler_logprobs_reach_trainer"
    if not capture.generations or capture.generations[0].completion_ids is None:
        if capture.run_error is not None:
            return [_result(check, scenario, NA, "the run crashed before completions (see run_completes)")]
        return [_result(check, scenario, FAIL, "no completions reached the trainer")]
    record = capture.generations[0]
    raw = [list(o.logprobs) for o in record.raw_outputs or [] if getattr(o, "logprobs", None)]
    if scenario.path == "generate" or scenario.trainer == "rloo":
        return [_result(check, scenario, NA, f"{scenario.trainer}/{scenario.path} returns no sampler log-probs")]
    if scenario.path == "cb" and not raw:
        return [_result(check, scenario, NA, "CB config did not ask for return_logprobs")]
    if record.sampler_logprobs is None:
        return [_result(check, scenario, FAIL, f"the engine returned log-probs for {len(raw)} rows; the trainer "
                        "received logprobs=None")]  # fmt: skip
    scored = capture.scored[0] if capture.scored else {}
    if "sampling_per_token_logps" not in scored:
        return [_result(check, scenario, FAIL, "sampler log-probs were returned but are absent from the scored batch")]
    sampled, mask = scored["sampling_per_token_logps"], scored["completion_mask"]
    eos_ids = capture.trainer_info.get("eos_ids", ())
    for i, lps in enumerate(record.sampler_logprobs):
        if not mask[i].any() and masked_as_truncated(scenario, record.completion_ids[i], eos_ids):
            continue  # a truncated row TRL masked out (mask_truncated_completions): nothing of it is used
        got = sampled[i][mask[i].bool()].double()
        if got.numel() != len(lps) or not torch.allclose(
            got, torch.tensor(lps, dtype=torch.float64), atol=PASS_THROUGH_ATOL
        ):
            return [_result(check, scenario, FAIL, f"row {i}: sampling_per_token_logps != the rollout's log-probs")]
    return [_result(check, scenario, PASS, f"{len(record.sampler_logprobs)} rows reach sampling_per_token_logps")]


def is_correction_applied(scenario: TrainerScenario, capture: Capture) -> list[CheckResult]:
    check = "is_correction_applied"
    if not scenario.is_correction:
        return [_result(check, scenario, NA, "vllm_importance_sampling_correction not enabled")]
    if not capture.losses and capture.run_error is not None:
        return [_result(check, scenario, NA, "the run crashed before any loss call (see run_completes)")]
    if not capture.losses:
        return [_result(check, scenario, FAIL, "no loss was computed")]
    missing = [i for i, loss in enumerate(capture.losses) if "importance_sampling_ratio" not in loss.inputs]
    if missing:
        return [_result(check, scenario, FAIL, f"correction enabled ({scenario.is_mode}) but {len(missing)}/"
                        f"{len(capture.losses)} loss call(s) got no importance_sampling_ratio")]  # fmt: skip
    return [_result(check, scenario, PASS, "importance_sampling_ratio reached every loss call")]


def mixed_precision_completes(scenario: TrainerScenario, capture: Capture) -> list[CheckResult]:
    check = "mixed_precision_completes"
    if not scenario.bf16:
        return [_result(check, scenario, NA, "fp32 scenario")]
    if capture.run_error is not None:
        return [_result(check, scenario, FAIL, f"bf16 run raised {_err(capture.run_error)}")]
    unfinished = [r for g in capture.generations for r in (g.raw_outputs or []) if getattr(r, "error", None)]
    if unfinished or not capture.losses:
        return [_result(check, scenario, FAIL, f"{len(unfinished)} unfinished request(s), {len(capture.losses)} loss")]
    return [_result(check, scenario, PASS, f"bf16: {len(capture.losses)} loss call(s), every request finished")]


def trainer_precision_follows_its_config(scenario: TrainerScenario, capture: Capture) -> list[CheckResult]:
    """The trainer runs in the precision its own config asks for (``bf16`` -> bf16 autocast, else the one the process
    was launched with: ``accelerate launch --mixed_precision``, or none), whatever trainers the process built before
    it (``after_bf16_trainer``)."""
    check = "trainer_precision_follows_its_config"
    got = capture.trainer_info.get("mixed_precision")
    if got is None:
        return [_result(check, scenario, NA, "the trainer was never built (see run_completes)")]
    want = "bf16" if scenario.bf16 else capture.trainer_info.get("launch_mixed_precision", "no")
    after = ", built after a bf16 trainer in this process" if scenario.after_bf16_trainer else ""
    if got != want:
        return [_result(check, scenario, FAIL, f"bf16={scenario.bf16}{after}: the accelerator's mixed precision is "
                        f"{got!r}, not {want!r}")]  # fmt: skip
    return [_result(check, scenario, PASS, f"bf16={scenario.bf16}{after}: mixed precision {got!r}")]


def exercised(scenario: TrainerScenario, capture: Capture) -> dict[str, int]:
    """What the run gave the checks to judge, counted over every generation: rows, rows cut at
    ``max_completion_length``, rows masked out for it, groups whose rewards differ (nonzero advantages) or are all
    equal, completion tokens, and importance-sampling ratios at a clip bound. A check's PASS means as much as these
    numbers: no truncated row, no truncation masking exercised."""
    eos_ids = capture.trainer_info.get("eos_ids", ())
    out = dict(rows=0, truncated=0, masked=0, groups_with_spread=0, equal_reward_groups=0, tokens=0, is_clipped=0)
    for record in capture.generations:
        for completion in record.completion_ids or []:
            out["rows"] += 1
            out["tokens"] += len(completion)
            if not (completion and completion[-1] in eos_ids):
                out["truncated"] += 1
                out["masked"] += masked_as_truncated(scenario, completion, eos_ids)
    n = scenario.num_generations
    for rewards in capture.rewards:
        total = rewards.nan_to_num().sum(-1)  # (B,)
        for g in range(len(total) // n):
            spread = bool((total[g * n : (g + 1) * n] != total[g * n]).any())
            out["groups_with_spread" if spread else "equal_reward_groups"] += 1
    lo, hi = scenario.is_clip_min, scenario.is_clip_max
    for scored in capture.scored:
        ratio = scored.get("importance_sampling_ratio")
        if isinstance(ratio, torch.Tensor):
            clipped = ratio >= hi if lo is None else (ratio >= hi) | (ratio <= lo)
            out["is_clipped"] += int(clipped.sum())
    return out


def unexercised(scenario: TrainerScenario, facts: dict) -> list[str]:
    """What ``scenario`` was built to exercise and its run (:func:`exercised`'s ``facts``) did not: truncation
    masking with no row cut, importance-sampling bounds that clipped nothing where the correction was applied."""
    if "not run" in facts:
        return []
    missing = []
    if scenario.mask_truncated_completions and not facts.get("masked"):
        missing.append("mask_truncated_completions is set but no row was cut at max_completion_length")
    if (
        scenario.path == "vllm"
        and scenario.is_correction
        and scenario.is_clip_min is not None
        and not facts.get("is_clipped")
    ):
        missing.append("importance-sampling bounds are set but no ratio reached them")
    return missing
