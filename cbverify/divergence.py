"""The first token divergence between an engine's rollout and the reference's, judged by a tolerance tier.

- :func:`first_divergence` / :func:`compare_tokens` — where the tokens part, and whether that is acceptable: in
  float32 only at a near-tie of the decision score; in bf16 / fp16 (``near_tie_in_noise``) at a near-tie within the
  dtype's logit noise, or at a sampling-processor cut that the same noise can move (:func:`boundary_tokens`).
- :class:`Divergence` — everything needed to judge and reproduce it. Only the reference's scores are known (an engine
  exposes one log-prob per token, not its distribution), so the report gives the reference's top-5 and the engine
  token's rank and score *under the reference*, never a list presented as the engine's.

Oracle: ``reference.generate`` (its rule is re-derived here from ``reference.spec`` to score the divergent position).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cbverify.tolerances import Tier
from reference import logprobs as ref_logprobs
from reference.generate import apply_temperature, apply_top_k, apply_top_p, process_logits
from reference.spec import Rollout, RolloutRequest, SamplingParams, gumbel_noise


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first position where an engine's tokens leave the reference's, with what is needed to judge and repro it.

    ``reference_top5`` holds ``(token, decision score)`` pairs, best first, at this position given the common prefix
    (the decision score is the raw logit when greedy, processed log-prob + spec Gumbel noise when sampled).
    ``engine_rank`` / ``engine_score`` are the engine token's rank (1 = best) and decision score under the reference
    (``-inf`` when the reference's processors removed it). ``None`` for a token means that side had already ended.
    """

    engine: str
    request_id: str
    position: int
    reference_token: int | None
    engine_token: int | None
    reference_top5: tuple[tuple[int, float], ...]
    engine_rank: int | None
    engine_score: float | None
    gap: float  # reference's top-1 minus top-2 decision score (inf when undefined)
    accepted: bool
    reason: str
    repro: str

    def describe(self) -> str:
        top = lambda pairs: ", ".join(f"{t}:{s:.6g}" for t, s in pairs)  # noqa: E731
        verdict = "ACCEPTED (near tie)" if self.accepted else "FAIL"
        engine = "-" if self.engine_rank is None else f"rank {self.engine_rank}, score {self.engine_score:.6g}"
        return (
            f"[{self.engine}] request {self.request_id!r} diverges at position {self.position}: reference token "
            f"{self.reference_token}, engine token {self.engine_token} -> {verdict}: {self.reason}\n"
            f"  reference top-5 [{top(self.reference_top5)}] (top-2 gap {self.gap:.3g})\n"
            f"  engine token under the reference: {engine} (the engine's own scores are not exposed)\n"
            f"  repro: {self.repro}"
        )


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """First index where the token lists differ (or where one ends before the other); ``None`` if identical."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def _noise(request: RolloutRequest, prefix: Sequence[int], vocab: int, device) -> torch.Tensor:
    seeds = torch.tensor([request.seed], dtype=torch.int64, device=device)  # (1,)
    positions = torch.tensor([len(prefix)], dtype=torch.int64, device=device)  # (1,)
    return gumbel_noise(seeds, positions, vocab)[0]  # (V,) float64


def _scores(logits: torch.Tensor, request: RolloutRequest, prefix: Sequence[int]) -> torch.Tensor:
    if request.sampling.greedy:
        return logits.double()
    noise = _noise(request, prefix, logits.numel(), logits.device)  # (V,)
    return process_logits(logits, request.sampling).double() + noise  # (V,)


def decision_scores(model, request: RolloutRequest, prefix: Sequence[int]) -> torch.Tensor:
    """(V,) float64: the scores the spec takes the argmax of at completion position ``len(prefix)``."""
    logits = ref_logprobs.completion_logits(model, request.prompt_ids, [*prefix, 0])[-1]  # (V,)
    return _scores(logits, request, prefix)


def boundary_tokens(logits: torch.Tensor, sampling: SamplingParams, noise: float) -> torch.Tensor:
    """(V,) bool: tokens whose membership in the processed support can flip when each logit moves by <= ``noise``.

    Per processor, in score units (``logits / T``, noise ``d = noise / T``), each side of a cut moving by ``d``:
    top-k: a token within ``2d`` of the k-th / (k+1)-th largest score; top-p: a token whose cumulative (ascending)
    mass has log-odds within ``2d`` of ``log-odds(1 - top_p)`` (every token within ``2d`` of it may swap order, so its
    mass is counted on both sides); min-p: a token whose ``score - max score`` is within ``2d`` of ``log(min_p)``.
    Greedy rows have no processors, so no boundary. A token already removed by an earlier processor is kept in the
    later checks' candidates only through the earlier check (the cascade is judged processor by processor).
    """
    out = torch.zeros(logits.numel(), dtype=torch.bool, device=logits.device)  # (V,)
    if sampling.greedy or noise <= 0:
        return out
    d = noise / sampling.temperature
    scores = apply_temperature(logits.double(), sampling.temperature)  # (V,)
    if 0 < sampling.top_k < scores.numel():
        ordered = torch.sort(scores, descending=True).values  # (V,)
        kth, next_ = ordered[sampling.top_k - 1], ordered[sampling.top_k]
        kept = scores >= kth
        out |= (~kept & (scores >= kth - 2 * d)) | (kept & (scores <= next_ + 2 * d))
        scores = apply_top_k(scores, sampling.top_k)
    if sampling.top_p < 1.0:
        probs = torch.softmax(scores, dim=-1)  # (V,)
        ascending, order = torch.sort(scores)  # (V,), (V,)
        cumulative = torch.cumsum(probs[order], dim=-1)  # (V,)
        hi = cumulative[(torch.searchsorted(ascending, scores + 2 * d, right=True) - 1).clamp(min=0)]  # (V,)
        lo = torch.cat([cumulative.new_zeros(1), cumulative])[torch.searchsorted(ascending, scores - 2 * d)] + probs
        logodds = lambda c: torch.log(c) - torch.log1p(-c.clamp(max=1 - 1e-12))  # noqa: E731
        cut = math.log(1 - sampling.top_p) - math.log(sampling.top_p)
        near = (logodds(lo.clamp(max=1)) - 2 * d <= cut) & (logodds(hi) + 2 * d > cut)
        out |= near & torch.isfinite(scores)  # a top token too: noise may move another above it
        scores = apply_top_p(scores, sampling.top_p)
    if sampling.min_p > 0:
        rel = scores - scores.max()  # (V,)
        out |= torch.isfinite(rel) & ((rel - math.log(sampling.min_p)).abs() <= 2 * d)  # the top one too
    return out


def cut_allowance(logits: torch.Tensor, sampling: SamplingParams, noise: float) -> float:
    """How far a kept token's processed log-prob can move, beyond its full-support log-prob, when each logit moves by
    <= ``noise`` and the processed support changes by any set of :func:`boundary_tokens`.

    Top-k, top-p and min-p only mask: a kept token's processed log-prob is ``log p - log K`` (``p``: its probability
    after temperature, ``K``: the kept mass). Boundary tokens of mass ``b_in`` (kept) and ``b_out`` (removed) can
    move ``K`` anywhere in ``[K - b_in, K + b_out]``, so the processed log-prob by up to
    ``max(-log(1 - b_in / K), log(1 + b_out / K))``. 0 on greedy rows and where no token is at a cut.
    """
    edge = boundary_tokens(logits, sampling, noise)  # (V,)
    if not bool(edge.any()):
        return 0.0
    probs = torch.softmax(apply_temperature(logits.double(), sampling.temperature), dim=-1)  # (V,)
    kept = torch.isfinite(process_logits(logits, sampling))  # (V,)
    mass = float(probs[kept].sum())
    b_in, b_out = float(probs[edge & kept].sum()), float(probs[edge & ~kept].sum())
    return max(-math.log1p(-min(b_in / mass, 1 - 1e-12)), math.log1p(b_out / mass))


def compare_tokens(
    model, request: RolloutRequest, reference: Rollout, other: Rollout, *, engine: str, tier: Tier, repro: str = ""
) -> Divergence | None:
    """``None`` when the completions are identical, else the first :class:`Divergence`, judged by ``tier``.

    A divergence where one side has ended while the other goes on is never accepted (a length or EOS bug, since both
    sides share ``max_new_tokens`` and the EOS set).
    """
    pos = first_divergence(reference.completion_ids, other.completion_ids)
    if pos is None:
        return None
    ref_tok = reference.completion_ids[pos] if pos < len(reference.completion_ids) else None
    eng_tok = other.completion_ids[pos] if pos < len(other.completion_ids) else None
    prefix = reference.completion_ids[:pos]
    logits = ref_logprobs.completion_logits(model, request.prompt_ids, [*prefix, 0])[-1]  # (V,)
    scores = _scores(logits, request, prefix)  # (V,)
    top = torch.topk(scores, min(5, scores.numel()))
    top5 = tuple((int(t), float(s)) for t, s in zip(top.indices, top.values, strict=True))
    gap = top5[0][1] - top5[1][1] if len(top5) > 1 else float("inf")
    rank = None if eng_tok is None else int((scores > scores[eng_tok]).sum()) + 1
    common = dict(engine=engine, request_id=request.request_id, position=pos, reference_token=ref_tok)
    common |= dict(engine_token=eng_tok, reference_top5=top5, gap=gap, repro=repro, engine_rank=rank)
    common |= dict(engine_score=None if eng_tok is None else float(scores[eng_tok]))
    if ref_tok is None or eng_tok is None:
        side = "reference" if ref_tok is None else "engine"
        return Divergence(**common, accepted=False, reason=f"the {side} ended here while the other side went on")
    if tier.token_rule == "exact_or_near_tie":
        behind = float(scores[ref_tok] - scores[eng_tok])
        ok = behind <= tier.near_tie_gap
        why = f"engine token scores {behind:.3g} below the reference's (near-tie gap {tier.near_tie_gap:g})"
        return Divergence(**common, accepted=ok, reason=why)
    ok, why = _within_noise(logits, scores, request, prefix, eng_tok, tier)
    return Divergence(**common, accepted=ok, reason=why)


def _within_noise(logits, scores, request, prefix, eng_tok: int, tier: Tier) -> tuple[bool, str]:
    """``near_tie_in_noise``: could logit noise of ``near_tie_gap / 2`` units per entry make ``eng_tok`` the argmax?

    Yes iff the engine's token is kept or on a processor's cut, and every token that is kept for sure (not on a cut)
    beats it by at most ``near_tie_gap`` units (divided by T when sampled). Removed tokens are compared by their
    unfiltered score (``logits / T`` + noise): the renormalisation shifts every kept token alike.
    """
    unit = tier.unit(float(logits.abs().max()))
    sampling = request.sampling
    allowed = tier.near_tie_gap * unit / (1.0 if sampling.greedy else sampling.temperature)
    edge = boundary_tokens(logits, sampling, tier.near_tie_gap / 2 * unit)  # (V,)
    kept = torch.isfinite(scores)  # (V,)
    raw = (
        scores
        if sampling.greedy
        else logits.double() / sampling.temperature + _noise(request, prefix, len(scores), logits.device)
    )
    if not (kept[eng_tok] or edge[eng_tok]):
        return False, f"engine token is outside the reference's processed support and not at its cut ({unit:.3g}/unit)"
    sure = kept & ~edge
    sure[eng_tok] = False
    behind = float((raw[sure] - raw[eng_tok]).max()) if bool(sure.any()) else 0.0
    at_cut = f"; at a processor cut: {int(edge.sum())} token(s)" if bool(edge.any()) else ""
    why = f"engine token scores {behind:.3g} below the best token kept for sure (allowed {allowed:.3g}: "
    why += f"{tier.near_tie_gap:g} units of {unit:.3g}){at_cut}"
    return behind <= allowed, why
