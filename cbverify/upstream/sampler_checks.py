"""Numerical invariants of a captured trainer run's sampler, each against ``reference`` (the oracle), never TRL.

- sampled tokens inside the support the requested options allow (an option a path ignores shows up here);
- the log-prob semantics of a path's sampler log-probs: processed or full-support, and the size of the gap;
- the importance-sampling weights TRL computes from the sampler's log-probs, in each ``vllm_importance_sampling_mode``.

As in ``cbverify.upstream.numerics`` (the trainer's side), checks use the caller's untouched model and the *first*
generation only; the sampler's log-probs are judged at the weights the sampler really had (``capture.sampler_model``
where it is not the policy: the ``vllm`` path's off-policy sampler).
"""

from __future__ import annotations

import math

import torch

from cbverify.tolerances import BOUNDARY_RELAX, FP32, LOW_PRECISION, SEMANTICS_GAP
from cbverify.upstream.capture import Capture, rows
from cbverify.upstream.findings import FAIL, NA, PASS, CheckResult
from cbverify.upstream.findings import scenario_result as _result
from cbverify.upstream.scenario import TrainerScenario
from reference.spec import SamplingParams

FP32_MAX, BF16_MAX = FP32.logprob_max_abs, LOW_PRECISION.logprob_max_abs


def _sampling(scenario: TrainerScenario, *, relax: bool = False) -> SamplingParams:
    """The scenario's options; ``relax`` widens top-p / min-p by ``BOUNDARY_RELAX`` (a token at a numerical cut)."""
    top_p, min_p = scenario.top_p, scenario.min_p
    if relax:
        top_p, min_p = min(1.0, top_p + BOUNDARY_RELAX), min_p * (1 - BOUNDARY_RELAX)
    return SamplingParams(temperature=scenario.temperature, top_k=scenario.top_k, top_p=top_p, min_p=min_p,
                          max_new_tokens=scenario.max_completion_length)  # fmt: skip


def _penalised_argmax_ok(model, prompt, completion, penalty: float) -> tuple[int | None, int]:
    """``(first position whose token is not the argmax of the penalised logits or None, number of positions where
    the penalty changes the argmax)``: where it changes none, honouring and ignoring it look the same."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from reference.logprobs import completion_logits

    logits = completion_logits(model, prompt, completion)  # (L, V)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    changed = 0
    for i, token in enumerate(completion):
        prefix = torch.tensor([list(prompt) + list(completion[:i])])  # (1, P + i)
        scores = processor(prefix, logits[i : i + 1].clone())[0]  # (V,)
        changed += int(torch.argmax(scores)) != int(torch.argmax(logits[i]))
        top2 = torch.topk(scores, 2).values
        if token != int(torch.argmax(scores)) and float(top2[0] - top2[1]) > FP32.near_tie_gap:
            return i, changed
    return None, changed


def sampled_tokens_within_processed_support(scenario: TrainerScenario, capture: Capture, model) -> list[CheckResult]:
    from reference.logprobs import processed_per_token_logps

    check = "sampled_tokens_within_processed_support"
    restricted = scenario.top_k or scenario.top_p < 1 or scenario.min_p > 0 or scenario.repetition_penalty != 1
    if not restricted:
        return [_result(check, scenario, NA, "no support-restricting option drawn")]
    if scenario.bf16:
        return [_result(check, scenario, NA, "bf16 sampling boundaries are not comparable to fp32 teacher forcing")]
    if not capture.generations or capture.generations[0].completion_ids is None:
        return [_result(check, scenario, FAIL, "no completions to check")]
    record = capture.generations[0]
    if scenario.repetition_penalty != 1:
        if not scenario.greedy:
            return [_result(check, scenario, NA, "repetition penalty is checked under greedy decoding only")]
        changed = 0
        for i, (p, c) in enumerate(zip(record.prompt_ids, record.completion_ids, strict=True)):
            pos, changes = _penalised_argmax_ok(model, p, c, scenario.repetition_penalty)
            changed += changes
            if pos is not None:
                return [
                    _result(
                        check,
                        scenario,
                        FAIL,
                        f"row {i} pos {pos}: token is not the argmax of the "
                        f"repetition_penalty={scenario.repetition_penalty} logits (option ignored)",
                    )
                ]
        if not changed:
            return [_result(check, scenario, NA, "the penalty changes no greedy choice here: honoured = ignored")]
        return [_result(check, scenario, PASS, f"every greedy token is the penalised argmax ({changed} changed)")]
    if scenario.greedy:
        return [_result(check, scenario, NA, "greedy decoding ignores top-k/top-p/min-p")]
    sampling = [_sampling(scenario, relax=True)] * len(record.completion_ids)
    lps = processed_per_token_logps(model, record.prompt_ids, record.completion_ids, sampling)
    outside = [(i, int(torch.nonzero(torch.isinf(lp))[0])) for i, lp in enumerate(lps) if torch.isinf(lp).any()]
    total = sum(len(c) for c in record.completion_ids)
    if outside:
        i, pos = outside[0]
        return [
            _result(
                check,
                scenario,
                FAIL,
                f"{len(outside)} row(s) hold tokens the options exclude; first row {i} "
                f"pos {pos} (top_k={scenario.top_k}, top_p={scenario.top_p}, min_p={scenario.min_p})",
            )
        ]
    return [_result(check, scenario, PASS, f"{total} sampled tokens all inside the processed support")]


def sampler_logprob_semantics(scenario: TrainerScenario, capture: Capture, model) -> list[CheckResult]:
    """Identify a path's sampler log-probs as processed or full-support; report the gap between the two."""
    from reference.logprobs import per_token_logps, processed_per_token_logps

    check = "sampler_logprob_semantics"
    if not capture.generations or capture.generations[0].completion_ids is None:
        return [_result(check, scenario, NA, "no completions")]
    record = capture.generations[0]
    given = record.sampler_logprobs or [list(o.logprobs) for o in record.raw_outputs or [] if o.logprobs] or None
    if given is None or scenario.greedy:
        return [_result(check, scenario, NA, "path exposes no sampler log-probs" if given is None else "greedy")]
    tol = BF16_MAX if scenario.bf16 else SEMANTICS_GAP
    cut = [lp[: len(c)] for lp, c in zip(given, record.completion_ids, strict=True)]
    sampling = [_sampling(scenario)] * len(cut)
    processed = processed_per_token_logps(model, record.prompt_ids, record.completion_ids, sampling)
    full = per_token_logps(model, record.prompt_ids, record.completion_ids, scenario.temperature)
    got = torch.cat([torch.tensor(x, dtype=torch.float32) for x in cut])
    proc, fullc = torch.cat(processed), torch.cat(full)
    gap = (proc - fullc).abs()
    d_proc, d_full = float((got - proc).abs().max()), float((got - fullc).abs().max())
    gap_text = f"|processed-full| mean {float(gap.mean()):.3g} max {float(gap.max()):.3g}"
    if d_proc <= tol:
        return [_result(check, scenario, PASS, f"processed (max |diff| {d_proc:.1e}); {gap_text}")]
    if d_full <= tol:
        return [_result(check, scenario, PASS, f"full-support (max |diff| {d_full:.1e}); {gap_text}")]
    seen = (("max_diff_processed", (d_proc,)), ("max_diff_full", (d_full,)))
    return [_result(check, scenario, FAIL, f"neither: max |diff| processed {d_proc:.2e}, full {d_full:.2e}", seen)]


def is_weights_match_reference(scenario: TrainerScenario, capture: Capture, model, trainer_args: dict):
    """TRL's importance-sampling weights of the first generation against :func:`reference.loss.importance_weights`
    fed the reference's own log-probs: the policy's (temperature only) at the caller's weights, and the sampler's
    (processed, the semantics TRL asks vLLM for) at the weights the sampler really had. So vLLM's log-probs, what TRL
    does with them and each ``vllm_importance_sampling_mode``'s truncation or masking are judged together.

    A weight is compared in log space within the slack of the log-probs it sums (twice the fp32 tier per token); a
    log-weight within that slack of a bound could fall on either side of it, so it is skipped and counted."""
    from reference.logprobs import per_token_logps, processed_per_token_logps
    from reference.loss import LossConfig, importance_weights

    check = "is_weights_match_reference"
    if not scenario.is_correction:
        return [_result(check, scenario, NA, "vllm_importance_sampling_correction not enabled")]
    scored = capture.scored[0] if capture.scored else {}
    if "importance_sampling_ratio" not in scored:
        return [
            _result(
                check, scenario, NA, "the trainer computed no importance_sampling_ratio (see is_correction_applied)"
            )
        ]
    mask = scored["completion_mask"].double()  # (B, T)
    prompts, completions = rows(scored["prompt_ids"], scored["prompt_mask"]), rows(scored["completion_ids"], mask)
    sampler = capture.sampler_model if capture.sampler_model is not None else model
    old = _padded(per_token_logps(model, prompts, completions, scenario.temperature), mask)
    sampled = _padded(processed_per_token_logps(sampler, prompts, completions, [_sampling(scenario)] * len(prompts)),
                      mask)  # fmt: skip
    lo, hi = trainer_args["is_clip_min"], trainer_args["is_clip_max"]
    config = LossConfig(is_correction=scenario.is_mode, is_clip_min=lo, is_clip_max=hi)
    want = importance_weights(old, sampled, mask, config)
    got = scored["importance_sampling_ratio"].double().reshape(want.shape)
    log_w, counted = (old - sampled) * mask, mask  # the log-weight before the bounds, and the tokens it sums
    if scenario.is_mode.startswith("sequence"):
        log_w, counted = log_w.sum(-1, keepdim=True), mask.sum(-1, keepdim=True)
    slack = 2 * FP32_MAX * counted
    bounds = [math.log(b) for b in (lo, hi) if b is not None and b > 0]
    near = torch.zeros_like(log_w, dtype=torch.bool) | ~log_w.isfinite()
    for b in bounds:
        near |= (log_w - b).abs() <= slack
    judged = (counted > 0) & ~near
    both_zero = (got == 0) & (want == 0)
    err = torch.where(both_zero, torch.zeros_like(got), (got.log() - want.log()).abs())
    bad = judged & ~(err <= slack)  # a NaN or inf error is bad too
    if bad.any():
        i = tuple(int(x) for x in bad.nonzero()[0])
        return [
            _result(
                check,
                scenario,
                FAIL,
                f"{scenario.is_mode}: weight at {i} is {float(got[i]):.6g}, the "
                f"reference's {float(want[i]):.6g} (log-weight {float(log_w[i]):.4g}, bounds {lo}/{hi})",
            )
        ]
    w = want[judged]
    cut = sum(int((w == b).sum()) for b in (0.0, lo, hi) if b is not None)
    spread = f"reference weights in [{float(w.min()):.3g}, {float(w.max()):.3g}]" if w.numel() else "nothing judged"
    return [
        _result(
            check,
            scenario,
            PASS,
            f"{scenario.is_mode}: {int(judged.sum())} weights equal, {spread}, {cut} "
            f"masked or truncated; {int((near & (counted > 0)).sum())} within noise of a bound skipped",
        )
    ]


def _padded(rows_: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Per-row log-prob tensors laid into ``mask``'s (B, T) layout (right-padded completions), float64."""
    out = torch.zeros_like(mask)
    for i, r in enumerate(rows_):
        out[i, : r.numel()] = r.double()
    return out
