"""Comparing an engine's rollouts with the reference oracle: one set of functions for the tests and the CLI alike.

- :func:`check_results` — completeness and order (one rollout per request, in request order).
- :func:`check_conventions` — EOS and length conventions of one rollout.
- :func:`compare_tokens` — first divergence from the reference's rollout, with near-tie acceptance per the
  :mod:`cbverify.tolerances` tier and full diagnostics (:class:`Divergence`; both live in :mod:`cbverify.divergence`).
- :func:`teacher_forced_logprobs` / :func:`logprob_diffs` — the engine's returned log-probs against the reference's
  teacher-forced log-probs *of the engine's own tokens* (so RNG engines are checked too), in the semantics the
  engine declares; :func:`noise_positions` + :func:`judge_logprobs` scale them by the tier's unit per position.
- :func:`mismatch` — Mismatch metrics via ``reference.metrics.mismatch_metrics`` (one source of truth).
- :func:`teacher_force` — one rollout set teacher-forced once (:class:`TeacherForced`): the log-probs in the engine's
  semantics, the trainer's log-probs for :func:`mismatch` and the tier's :class:`NoisePositions`, all read off one
  forward per rollout; :func:`judge_logprobs` and :func:`mismatch` take it instead of forwarding again.

Tokens are comparable when both sides follow the spec: greedy requests always, sampled ones only for engines that
declare ``spec_sampling`` (:func:`tokens_comparable`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cbverify.devices import oracle_attention
from cbverify.divergence import Divergence, boundary_tokens, compare_tokens, decision_scores, first_divergence
from cbverify.engines import Capabilities, LogprobSemantics, declared_processing
from cbverify.tolerances import FP32, Tier, logprob_scale
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


def _semantics_logps(logits: torch.Tensor, request: RolloutRequest, completion, semantics,
                     process: Callable | None = None) -> torch.Tensor:  # fmt: skip
    """(L, V) -> (L,): :func:`teacher_forced_logprobs` of one rollout, read off its logits (``process``: a declared
    deviation's processing instead of the spec's, ``cbverify.engines.declared_processing``)."""
    if semantics == "processed" and process is not None and process is not process_logits:
        values = [process(logits[i], request.sampling)[token] for i, token in enumerate(completion)]
        return torch.stack(values) if values else torch.zeros(0, dtype=torch.float32)
    if semantics == "processed":
        return ref_logprobs.processed_logps_of(logits, completion, request.sampling)
    if semantics == "raw":
        return ref_logprobs.logps_of(logits, completion, 1.0)
    raise ValueError(f"no teacher-forced log-probs for semantics {semantics!r}")


def trainer_temperature(request: RolloutRequest) -> float:
    """The temperature TRL's trainer divides by for this request's rollout: the request's, 1 for greedy."""
    return request.sampling.temperature if not request.sampling.greedy else 1.0


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
        logits = None
        if tier.ulp > 0:
            logits = ref_logprobs.completion_logits(model, request.prompt_ids, rollout.completion_ids)  # (L, V)
        unit, cut = _positions_of(logits, request, rollout, semantics, tier)
        units.append(unit)
        cuts.append(cut)
    return NoisePositions(units, cuts, tier.logprob_max_abs)


def _positions_of(
    logits: torch.Tensor | None,
    request: RolloutRequest,
    rollout: Rollout,
    semantics: LogprobSemantics,
    tier: Tier,
    *,
    processed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rollout's units and cut flags (each (L,)) from its teacher-forced (L, V) logits (unread in float32).
    ``processed``: its processed log-probs already read off the same host logits (``semantics == "processed"``),
    so ``process_logits`` runs once per position."""
    n = len(rollout.completion_ids)
    unit = torch.ones(n, dtype=torch.float64)  # (L,)
    cut = torch.zeros(n, dtype=torch.bool)  # (L,)
    if tier.ulp > 0:
        logits = logits.cpu()  # (L, V): one copy to the host, then the loop below reads host memory only
        sampling = request.sampling
        t = 1.0 if sampling.greedy or semantics == "raw" else sampling.temperature
        for i, (row, token) in enumerate(zip(logits, rollout.completion_ids, strict=True)):
            scale = tier.unit(float(row.abs().max()))
            if semantics == "processed":
                logp = float(processed[i]) if processed is not None else float(process_logits(row, sampling)[token])
            else:
                logp = float(torch.log_softmax(row, -1)[token])
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
    return unit, cut


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


@dataclass(frozen=True, slots=True)
class TeacherForced:
    """One rollout set teacher-forced once: what every comparison of it reads, per rollout (each (L_i,)).

    - ``expected``: the reference's log-probs of the rollout's own tokens in ``semantics``
      (:func:`teacher_forced_logprobs`);
    - ``trainer``: TRL's trainer log-probs of the same tokens, ``log_softmax(logits / T)`` at the request's
      temperature (1 for greedy), for :func:`mismatch`;
    - ``positions``: the tier's :class:`NoisePositions`;
    - ``request_ids``: the rollouts it was computed for (a reader given another set refuses it); ``forwards``: the
      model forwards it took (one per rollout with a completion; an empty completion needs none);
    - ``deviated``: ``{request_id: deviation id}`` for the requests whose ``expected`` follows a deviation the engine
      declares (in processed semantics), not the spec.
    """

    semantics: LogprobSemantics
    expected: list[torch.Tensor]
    trainer: list[torch.Tensor]
    positions: NoisePositions
    request_ids: tuple[str, ...]
    forwards: int
    deviated: dict[str, str] = field(default_factory=dict)

    def check(self, rollouts: Sequence[Rollout]) -> None:
        """Refuse a rollout set other than the one this was computed for."""
        if tuple(r.request_id for r in rollouts) != self.request_ids:
            raise ValueError("teacher-forced quantities of another rollout set")


def teacher_force(
    model,
    requests: Sequence[RolloutRequest],
    rollouts: Sequence[Rollout],
    semantics: LogprobSemantics,
    tier: Tier,
    *,
    progress: Callable[[int], object] | None = None,
    deviations: Sequence[str] = (),
) -> TeacherForced:
    """:class:`TeacherForced` for ``rollouts``: one unpadded forward per rollout (``reference.logprobs.
    completion_logits``, the oracle's own teacher forcing: the tiers were measured against it, and a padded or
    batched forward moves bf16 logits by up to a unit), copied to the host once, every quantity read off that copy.
    ``progress(1)`` is called after each rollout. ``deviations``: those the engine declares; a request in one's
    domain is expected to follow it (processed semantics), and is listed in ``deviated``."""
    if semantics not in ("processed", "raw"):
        raise ValueError(f"no teacher-forced log-probs for semantics {semantics!r}")
    expected, trainer, units, cuts, forwards, deviated = [], [], [], [], 0, {}
    for request, rollout in zip(requests, rollouts, strict=True):
        completion = rollout.completion_ids
        forwards += bool(completion)  # completion_logits runs no forward for an empty completion
        with oracle_attention():  # no per-shape cuDNN plans (cbverify.devices)
            logits = ref_logprobs.completion_logits(model, request.prompt_ids, completion).cpu()  # (L, V)
        deviation, process = declared_processing(deviations, request.sampling)
        if deviation is not None and semantics == "processed":
            deviated[request.request_id] = deviation
        expected.append(_semantics_logps(logits, request, completion, semantics, process))  # (L,)
        trainer.append(ref_logprobs.logps_of(logits, completion, trainer_temperature(request)))  # (L,)
        processed = expected[-1] if semantics == "processed" else None
        unit, cut = _positions_of(logits, request, rollout, semantics, tier, processed=processed)
        units.append(unit)
        cuts.append(cut)
        if progress is not None:
            progress(1)
    positions = NoisePositions(units, cuts, tier.logprob_max_abs)
    ids = tuple(r.request_id for r in rollouts)
    return TeacherForced(semantics, expected, trainer, positions, ids, forwards, deviated)


def judge_logprobs(
    model,
    requests: Sequence[RolloutRequest],
    rollouts: Sequence[Rollout],
    semantics: LogprobSemantics,
    tier: Tier,
    *,
    forced: TeacherForced | None = None,
) -> LogprobDiff:
    """The engine's returned log-probs against teacher forcing on its own tokens, in ``tier``'s units: what
    ``cbverify verify`` judges (``.within(tier)``). ``forced``: the rollouts' :func:`teacher_force` (in ``semantics``
    and ``tier``), computed here when not given."""
    if forced is None:
        forced = teacher_force(model, requests, rollouts, semantics, tier)
    forced.check(rollouts)
    if forced.semantics != semantics or forced.positions.bound != tier.logprob_max_abs:
        raise ValueError("teacher-forced quantities of another semantics or tier")
    return logprob_diffs(rollouts, forced.expected, requests, forced.positions)


def mismatch(
    model,
    requests: Sequence[RolloutRequest],
    rollouts: Sequence[Rollout],
    *,
    forced: TeacherForced | None = None,
) -> dict[str, float]:
    """Mismatch metrics of the engine's (sampler) log-probs against trainer-side log-probs of the same tokens
    (TRL semantics: ``log_softmax(logits / T)``, T = the request's temperature, 1 for greedy). ``forced``: the
    rollouts' :func:`teacher_force` (any semantics), computed here when not given."""
    if forced is None:
        forced = teacher_force(model, requests, rollouts, "raw", FP32)
    forced.check(rollouts)
    sampler = [torch.tensor(r.logprobs, dtype=torch.float64) for r in rollouts]  # (L_i,) each
    return mismatch_metrics(forced.trainer, sampler)
