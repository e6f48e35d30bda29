"""Comparing an engine's rollouts with the reference oracle: one set of functions for the tests and the CLI alike.

- :func:`check_results` — completeness and order (one rollout per request, in request order).
- :func:`check_conventions` — EOS and length conventions of one rollout.
- :func:`compare_tokens` — first divergence from the reference's rollout, with near-tie acceptance per the
  :mod:`cbverify.tolerances` tier and full diagnostics (:class:`Divergence`).
- :func:`teacher_forced_logprobs` / :func:`logprob_diffs` — the engine's returned log-probs against the reference's
  teacher-forced log-probs *of the engine's own tokens* (so RNG engines are checked too), in the semantics the
  engine declares.
- :func:`mismatch` — Mismatch metrics via ``reference.metrics.mismatch_metrics`` (one source of truth).

Tokens are comparable when both sides follow the spec: greedy requests always, sampled ones only for engines that
declare ``spec_sampling`` (:func:`tokens_comparable`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cbverify.engines import Capabilities, LogprobSemantics
from cbverify.tolerances import Tier, logprob_scale
from reference import logprobs as ref_logprobs
from reference.generate import process_logits
from reference.metrics import mismatch_metrics
from reference.spec import Rollout, RolloutRequest, gumbel_noise


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


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first position where an engine's tokens leave the reference's, with what is needed to judge and repro it.

    ``*_top5`` are ``(token, decision score)`` pairs, best first, at this position given the common prefix (the
    decision score is the raw logit when greedy, processed log-prob + spec Gumbel noise when sampled). ``None`` for a
    token means that side had already ended.
    """

    engine: str
    request_id: str
    position: int
    reference_token: int | None
    engine_token: int | None
    reference_top5: tuple[tuple[int, float], ...]
    engine_top5: tuple[tuple[int, float], ...]
    gap: float  # reference's top-1 minus top-2 decision score (inf when undefined)
    accepted: bool
    reason: str
    repro: str

    def describe(self) -> str:
        top = lambda pairs: ", ".join(f"{t}:{s:.6g}" for t, s in pairs)  # noqa: E731
        verdict = "ACCEPTED (near tie)" if self.accepted else "FAIL"
        return (
            f"[{self.engine}] request {self.request_id!r} diverges at position {self.position}: reference token "
            f"{self.reference_token}, engine token {self.engine_token} -> {verdict}: {self.reason}\n"
            f"  reference top-5 [{top(self.reference_top5)}] (top-2 gap {self.gap:.3g})\n"
            f"  engine    top-5 [{top(self.engine_top5)}]\n  repro: {self.repro}"
        )


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """First index where the token lists differ (or where one ends before the other); ``None`` if identical."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def decision_scores(model, request: RolloutRequest, prefix: Sequence[int]) -> torch.Tensor:
    """(V,) float64: the scores the spec takes the argmax of at completion position ``len(prefix)``."""
    logits = ref_logprobs.completion_logits(model, request.prompt_ids, [*prefix, 0])[-1]  # (V,)
    if request.sampling.greedy:
        return logits.double()
    seeds = torch.tensor([request.seed], dtype=torch.int64, device=logits.device)  # (1,)
    positions = torch.tensor([len(prefix)], dtype=torch.int64, device=logits.device)  # (1,)
    noise = gumbel_noise(seeds, positions, logits.numel())[0]  # (V,)
    return process_logits(logits, request.sampling).double() + noise


def _top5(scores: torch.Tensor) -> tuple[tuple[int, float], ...]:
    top = torch.topk(scores, min(5, scores.numel()))
    return tuple((int(t), float(s)) for t, s in zip(top.indices, top.values, strict=True))


def compare_tokens(
    model, request: RolloutRequest, reference: Rollout, other: Rollout, *, engine: str, tier: Tier, repro: str = ""
) -> Divergence | None:
    """``None`` when the completions are identical, else the first :class:`Divergence`, judged by ``tier``.

    A divergence where one side has ended while the other goes on is never accepted (a length or EOS bug, since both
    sides share ``max_new_tokens`` and the EOS set). Oracle: ``reference.generate`` (whose rule is re-derived here
    from ``reference.spec`` to score the divergent position).
    """
    pos = first_divergence(reference.completion_ids, other.completion_ids)
    if pos is None:
        return None
    ref_tok = reference.completion_ids[pos] if pos < len(reference.completion_ids) else None
    eng_tok = other.completion_ids[pos] if pos < len(other.completion_ids) else None
    scores = decision_scores(model, request, reference.completion_ids[:pos])  # (V,)
    top5 = _top5(scores)
    gap = top5[0][1] - top5[1][1] if len(top5) > 1 else float("inf")
    common = dict(engine=engine, request_id=request.request_id, position=pos, reference_token=ref_tok)
    common |= dict(engine_token=eng_tok, reference_top5=top5, engine_top5=top5, gap=gap, repro=repro)
    if ref_tok is None or eng_tok is None:
        side = "reference" if ref_tok is None else "engine"
        return Divergence(**common, accepted=False, reason=f"the {side} ended here while the other side went on")
    if tier.token_rule == "exact_or_near_tie":
        behind = float(scores[ref_tok] - scores[eng_tok])
        ok = behind <= tier.near_tie_gap
        why = f"engine token scores {behind:.3g} below the reference's (near-tie gap {tier.near_tie_gap:g})"
        return Divergence(**common, accepted=ok, reason=why)
    top_ids = {t for t, _ in top5}
    ok = eng_tok in top_ids and ref_tok in top_ids
    return Divergence(**common, accepted=ok, reason=f"each token in the other's top-5: {ok} (then comparison stops)")


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
class LogprobDiff:
    """|engine - reference| over all tokens: ``max_abs``, ``mean_abs``, and where the max is (request, position)."""

    max_abs: float
    mean_abs: float
    num_tokens: int
    worst_request: str | None
    worst_position: int | None


def logprob_diffs(
    rollouts: Sequence[Rollout], expected: Sequence[torch.Tensor], requests: Sequence[RolloutRequest] | None = None
) -> LogprobDiff:
    """Compare each rollout's returned ``logprobs`` with ``expected`` (same shapes). Inf/NaN count as inf.

    With ``requests``, each rollout's differences are multiplied by ``tolerances.logprob_scale(request.sampling)``
    (``min(1, T)``: compare in logit units, see there), which is how every check in the suite calls it.
    """
    worst, worst_at, total, count = -1.0, (None, None), 0.0, 0
    scales = [logprob_scale(r.sampling) for r in requests] if requests is not None else [1.0] * len(rollouts)
    for rollout, exp, scale in zip(rollouts, expected, scales, strict=True):
        got = torch.tensor(rollout.logprobs, dtype=torch.float64)  # (L,)
        diff = (got - exp.double().cpu()).abs()  # (L,)
        diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf")))
        diff = torch.where(torch.isneginf(got) & torch.isneginf(exp.double().cpu()), torch.zeros_like(diff), diff)
        diff = diff * scale
        if diff.numel():
            i = int(torch.argmax(diff))
            if float(diff[i]) > worst:
                worst, worst_at = float(diff[i]), (rollout.request_id, i)
            total, count = total + float(diff.sum()), count + diff.numel()
    return LogprobDiff(max(worst, 0.0), total / count if count else 0.0, count, *worst_at)


def mismatch(model, requests: Sequence[RolloutRequest], rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Mismatch metrics of the engine's (sampler) log-probs against trainer-side log-probs of the same tokens
    (TRL semantics: ``log_softmax(logits / T)``, T = the request's temperature, 1 for greedy)."""
    trainer, sampler = [], []
    for request, rollout in zip(requests, rollouts, strict=True):
        temperature = request.sampling.temperature if not request.sampling.greedy else 1.0
        trainer += ref_logprobs.per_token_logps(model, [request.prompt_ids], [rollout.completion_ids], temperature)
        sampler.append(torch.tensor(rollout.logprobs, dtype=torch.float64))  # (L_i,)
    return mismatch_metrics(trainer, sampler)
