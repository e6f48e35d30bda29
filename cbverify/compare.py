"""Comparing an engine's rollouts with the reference oracle: one set of functions for the tests and the CLI alike.

- :func:`check_results` — completeness and order (one rollout per request, in request order).
- :func:`check_conventions` — EOS and length conventions of one rollout.
- :func:`compare_tokens` — first divergence from the reference's rollout, with near-tie acceptance per the
  :mod:`cbverify.tolerances` tier and full diagnostics (:class:`Divergence`; both live in :mod:`cbverify.divergence`).
- :func:`teacher_forced_logprobs` / :func:`logprob_diffs` — the engine's returned log-probs against the reference's
  teacher-forced log-probs *of the engine's own tokens* (so RNG engines are checked too), in the semantics the
  engine declares; :func:`noise_positions` + :func:`judge_logprobs` scale them by the tier's unit per position.
- :func:`mismatch` — Mismatch metrics via ``reference.metrics.mismatch_metrics`` (one source of truth).

Tokens are comparable when both sides follow the spec: greedy requests always, sampled ones only for engines that
declare ``spec_sampling`` (:func:`tokens_comparable`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cbverify.divergence import Divergence, boundary_tokens, compare_tokens, decision_scores, first_divergence
from cbverify.engines import Capabilities, LogprobSemantics
from cbverify.tolerances import Tier, logprob_scale
from reference import logprobs as ref_logprobs
from reference.generate import process_logits
from reference.metrics import mismatch_metrics
from reference.spec import Rollout, RolloutRequest

__all__ = ["Divergence", "compare_tokens", "decision_scores", "first_divergence"]  # re-exported: one import site


def tokens_comparable(capabilities: Capabilities, request: RolloutRequest) -> bool:
    """Whether the engine's tokens for ``request`` must equal the reference's (greedy, or spec sampling)."""
    return request.sampling.greedy or capabilities.spec_sampling


def check_results(requests: Sequence[RolloutRequest], rollouts: Sequence[Rollout]) -> list[str]:
    """Problems with completeness and order: a count mismatch, a rollout in the wrong slot or with another prompt."""
    problems = []
    if len(rollouts) != len(requests):
        problems.append(f"{len(rollouts)} rollouts for {len(requests)} requests")
    for i, (request, rollout) in enumerate(zip(requests, rollouts, strict=False)):
        if rollout.request_id != request.request_id:
            problems.append(f"slot {i}: rollout {rollout.request_id!r} where request {request.request_id!r} belongs")
        elif rollout.prompt_ids != request.prompt_ids:
            problems.append(f"request {request.request_id!r}: rollout carries a different prompt")
    return problems


def check_conventions(request: RolloutRequest, rollout: Rollout) -> list[str]:
    """Problems with the rollout conventions: 1 <= length <= max_new_tokens, EOS kept and only last, finish_reason."""
    rid, ids, limit = request.request_id, rollout.completion_ids, request.sampling.max_new_tokens
    problems = []
    if not 1 <= len(ids) <= limit:
        problems.append(f"request {rid!r}: {len(ids)} completion tokens, allowed 1..{limit}")
    eos_at = [i for i, t in enumerate(ids) if t in request.eos_token_ids]
    if eos_at and eos_at[0] != len(ids) - 1:
        problems.append(f"request {rid!r}: EOS at position {eos_at[0]} but the completion goes on to {len(ids)}")
    ends_on_eos = bool(ids) and ids[-1] in request.eos_token_ids
    if rollout.finish_reason == "stop" and not ends_on_eos:
        problems.append(f"request {rid!r}: finish_reason 'stop' but the last token {ids[-1:]} is not an EOS")
    if rollout.finish_reason == "length" and (ends_on_eos or len(ids) != limit):
        problems.append(f"request {rid!r}: finish_reason 'length' with {len(ids)}/{limit} tokens, EOS={ends_on_eos}")
    return problems


def teacher_forced_logprobs(
    model, requests: Sequence[RolloutRequest], rollouts: Sequence[Rollout], semantics: LogprobSemantics
) -> list[torch.Tensor]:
    """The reference's log-probs of each rollout's own tokens in ``semantics``: float32 (L_i,) tensors.

    ``processed`` -> ``reference.logprobs.processed_per_token_logps``; ``raw`` -> ``per_token_logps`` at T=1.
    """
    prompts = [r.prompt_ids for r in requests]
    completions = [r.completion_ids for r in rollouts]
    if semantics == "processed":
        return ref_logprobs.processed_per_token_logps(model, prompts, completions, [r.sampling for r in requests])
    if semantics == "raw":
        return ref_logprobs.per_token_logps(model, prompts, completions, temperature=1.0)
    raise ValueError(f"no teacher-forced log-probs for semantics {semantics!r}")


@dataclass(frozen=True, slots=True)
class NoisePositions:
    """Per rollout, per position (each (L_i,)): the tier's unit (``Tier.unit`` of the teacher-forced row's largest
    |logit|; 1 in float32) and whether the position may be skipped at a processor cut (its processed support can
    change within the tier's noise and the engine's token is kept or on that cut); ``bound``: the max in units above
    which such a position is skipped rather than judged."""

    units: list[torch.Tensor]
    at_cut: list[torch.Tensor]
    bound: float


def noise_positions(
    model, requests: Sequence[RolloutRequest], rollouts: Sequence[Rollout], semantics: LogprobSemantics, tier: Tier
) -> NoisePositions:
    """:class:`NoisePositions` of each rollout's own tokens under ``tier`` (one teacher-forced forward per rollout
    when ``tier.ulp > 0``; none in float32, where every unit is 1 and no position is at a cut)."""
    units, cuts = [], []
    for request, rollout in zip(requests, rollouts, strict=True):
        n = len(rollout.completion_ids)
        if tier.ulp == 0:
            units.append(torch.ones(n, dtype=torch.float64))  # (L,)
            cuts.append(torch.zeros(n, dtype=torch.bool))  # (L,)
            continue
        logits = ref_logprobs.completion_logits(model, request.prompt_ids, rollout.completion_ids).cpu()  # (L, V)
        sampling = request.sampling
        t = 1.0 if sampling.greedy or semantics == "raw" else sampling.temperature
        unit = torch.ones(n, dtype=torch.float64)  # (L,)
        cut = torch.zeros(n, dtype=torch.bool)  # (L,)
        for i, (row, token) in enumerate(zip(logits, rollout.completion_ids, strict=True)):
            scale = tier.unit(float(row.abs().max()))
            processed = process_logits(row, sampling) if semantics == "processed" else torch.log_softmax(row, -1)
            logp = float(processed[token])
            # each logit moves by <= d (score units): log p moves by <= log(p + (1 - p) e^(2d)) (-> 2d as p -> 0,
            # -> 0 as p -> 1), plus one ulp of the log-prob's own value (an engine may round it to the dtype)
            d = tier.near_tie_gap / 2 * scale / t
            p_tok = math.exp(logp) if math.isfinite(logp) else 0.0
            sensitivity = math.log(p_tok + (1 - p_tok) * math.exp(2 * d)) / (2 * d)
            unit[i] = scale * sensitivity + (tier.ulp * abs(logp) if math.isfinite(logp) else 0.0)
            unit[i] = max(float(unit[i]), scale * tier.ulp)  # p == 1: second order, one ulp of a unit
            if semantics == "processed":
                edge = boundary_tokens(row, sampling, tier.near_tie_gap / 2 * scale)  # (V,)
                cut[i] = bool(edge.any()) and (math.isfinite(logp) or bool(edge[token]))
        cuts.append(cut)
        units.append(unit)
    return NoisePositions(units, cuts, tier.logprob_max_abs)


@dataclass(frozen=True, slots=True)
class LogprobDiff:
    """|engine - reference| over all judged tokens: ``max_abs``, ``mean_abs``, and where the max is (request,
    position); ``max_units`` / ``mean_units`` the same in the tier's units (equal to them in float32), and
    ``skipped_at_cut`` the positions left out at a processor cut (see :class:`NoisePositions`)."""

    max_abs: float
    mean_abs: float
    num_tokens: int
    worst_request: str | None
    worst_position: int | None
    max_units: float = 0.0
    mean_units: float = 0.0
    skipped_at_cut: int = 0

    def within(self, tier: Tier) -> bool:
        """Whether the differences are inside ``tier``'s max and mean bounds."""
        return self.max_units <= tier.logprob_max_abs and self.mean_units <= tier.logprob_mean_abs


def logprob_diffs(
    rollouts: Sequence[Rollout],
    expected: Sequence[torch.Tensor],
    requests: Sequence[RolloutRequest] | None = None,
    positions: NoisePositions | None = None,
) -> LogprobDiff:
    """Compare each rollout's returned ``logprobs`` with ``expected`` (same shapes). Inf/NaN count as inf.

    With ``requests``, each rollout's differences are multiplied by ``tolerances.logprob_scale(request.sampling)``
    (``min(1, T)``: compare in logit units, see there), which is how every check in the suite calls it. With
    ``positions``, each difference is also divided by its unit, and one above ``positions.bound`` units at a position
    marked at a cut is skipped and counted.
    """
    worst, worst_at, total, total_units, count, skipped = -1.0, (None, None), 0.0, 0.0, 0, 0
    worst_units = 0.0
    scales = [logprob_scale(r.sampling) for r in requests] if requests is not None else [1.0] * len(rollouts)
    for k, (rollout, exp, scale) in enumerate(zip(rollouts, expected, scales, strict=True)):
        got = torch.tensor(rollout.logprobs, dtype=torch.float64)  # (L,)
        diff = (got - exp.double().cpu()).abs()  # (L,)
        diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf")))
        diff = torch.where(torch.isneginf(got) & torch.isneginf(exp.double().cpu()), torch.zeros_like(diff), diff)
        diff = diff * scale
        units = positions.units[k] if positions is not None else torch.ones_like(diff)  # (L,)
        in_units, where = diff / units, torch.arange(diff.numel())  # (L,), (L,)
        if positions is not None:
            keep = ~(positions.at_cut[k] & (in_units > positions.bound))  # (L,)
            skipped += int((~keep).sum())
            diff, in_units, where = diff[keep], in_units[keep], where[keep]  # (L',) each
        if diff.numel():
            i = int(torch.argmax(in_units))
            if float(in_units[i]) > worst_units or worst < 0:
                worst, worst_units, worst_at = float(diff[i]), float(in_units[i]), (rollout.request_id, int(where[i]))
            total, total_units = total + float(diff.sum()), total_units + float(in_units.sum())
            count += diff.numel()
    mean, mean_units = (total / count, total_units / count) if count else (0.0, 0.0)
    return LogprobDiff(max(worst, 0.0), mean, count, *worst_at, max(worst_units, 0.0), mean_units, skipped)


def judge_logprobs(
    model, requests: Sequence[RolloutRequest], rollouts: Sequence[Rollout], semantics: LogprobSemantics, tier: Tier
) -> LogprobDiff:
    """The engine's returned log-probs against teacher forcing on its own tokens, in ``tier``'s units: what
    ``cbverify verify`` judges (``.within(tier)``)."""
    expected = teacher_forced_logprobs(model, requests, rollouts, semantics)
    return logprob_diffs(rollouts, expected, requests, noise_positions(model, requests, rollouts, semantics, tier))


def mismatch(model, requests: Sequence[RolloutRequest], rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Mismatch metrics of the engine's (sampler) log-probs against trainer-side log-probs of the same tokens
    (TRL semantics: ``log_softmax(logits / T)``, T = the request's temperature, 1 for greedy)."""
    trainer, sampler = [], []
    for request, rollout in zip(requests, rollouts, strict=True):
        temperature = request.sampling.temperature if not request.sampling.greedy else 1.0
        trainer += ref_logprobs.per_token_logps(model, [request.prompt_ids], [rollout.completion_ids], temperature)
        sampler.append(torch.tensor(rollout.logprobs, dtype=torch.float64))  # (L_i,)
    return mismatch_metrics(trainer, sampler)
