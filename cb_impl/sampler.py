"""Logits processing and counter-based sampling, vectorised over the batch with per-row parameters.

Contract (``reference/spec.py``): greedy rows take ``argmax(logits)`` (lowest id on ties) with log-prob
``log_softmax(logits)``; sampled rows process float32 logits temperature -> top-k -> top-p -> min-p with
transformers' semantics (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
``MinPLogitsWarper``, filter value -inf, one token always kept) and take
``argmax(processed_logprobs.double() + gumbel_noise(seed, position, V))``. Oracle: ``reference.generate``'s
processing and sampling (independent code; the exactness properties compare the two).

Noise shortcut: a row with top-k keeps only tokens scoring >= its k-th largest score, and later processors only
remove more, so every other token is -inf and cannot win the argmax. When exactly ``k`` tokens pass (no tie at the
boundary) the noise is computed for those ``k`` candidates only, sorted by token id so that argmax ties still go to
the lowest id: bit-identical tokens to the full definition (``test_cb_sampler`` checks it on tie-heavy logits).
Rows with a boundary tie, or no top-k, get full-vocabulary noise. Greedy rows get none. The noise comes from
``cb_impl.noise`` (bit-identical to ``reference.spec``'s, about 2x cheaper).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cb_impl.noise import fast_bits_to_gumbel, fast_gumbel_noise, fast_noise_bits, noise_keys
from reference.spec import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, on the logits' device. Rows index the logits passed to
    :func:`sample`; ``greedy_rows`` / ``sampled_rows`` are host lists partitioning them."""

    greedy_rows: list[int]
    sampled_rows: list[int]
    temperature: torch.Tensor  # (Rs,) float32
    top_k: torch.Tensor  # (Rs,) int64, 0 = off
    top_p_threshold: torch.Tensor  # (Rs,) float32: 1 - top_p (transformers' comparison value)
    top_p_on: torch.Tensor  # (Rs,) bool
    min_p: torch.Tensor  # (Rs,) float32, 0 = off
    seeds: torch.Tensor  # (Rs,) int64
    positions: torch.Tensor  # (Rs,) int64: completion position of the token being sampled
    max_top_k: int  # host: the largest top_k among sampled rows (0 = no top-k row)
    any_top_p: bool
    any_min_p: bool


def build_sampling_batch(
    params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int], device: torch.device
) -> SamplingBatch:
    """Host lists -> one set of device tensors (built once per step)."""
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    sp = [params[i] for i in sampled]
    f32 = dict(dtype=torch.float32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    return SamplingBatch(
        greedy_rows=greedy,
        sampled_rows=sampled,
        temperature=torch.tensor([p.temperature for p in sp], **f32),
        top_k=torch.tensor([p.top_k for p in sp], **i64),
        top_p_threshold=torch.tensor([1 - p.top_p for p in sp], **f32),
        top_p_on=torch.tensor([p.top_p < 1.0 for p in sp], dtype=torch.bool, device=device),
        min_p=torch.tensor([p.min_p for p in sp], **f32),
        seeds=torch.tensor([seeds[i] for i in sampled], **i64),
        positions=torch.tensor([positions[i] for i in sampled], **i64),
        max_top_k=max((p.top_k for p in sp), default=0),
        any_top_p=any(p.top_p < 1.0 for p in sp),
        any_min_p=any(p.min_p > 0.0 for p in sp),
    )


def process_logits(logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Sampled rows' float32 logits (Rs, V) -> (processed log-probs (Rs, V), top-k candidate ids (Rs, K) or None,
    whether the row may use the candidate shortcut (Rs,) bool)."""
    rs, vocab = logits.shape
    scores = logits.float() / b.temperature[:, None]  # (Rs, V)
    candidates, shortcut = None, torch.zeros(rs, dtype=torch.bool, device=logits.device)
    if b.max_top_k > 0:
        k = b.top_k.clamp(max=vocab)  # (Rs,) transformers: top_k = min(top_k, V)
        top = torch.topk(scores, min(b.max_top_k, vocab), dim=-1)  # (Rs, K)
        kth = top.values.gather(1, (k - 1).clamp(min=0)[:, None])  # (Rs, 1)
        on = (k > 0)[:, None]  # (Rs, 1)
        passing = scores >= kth  # (Rs, V)
        scores = scores.masked_fill(~passing & on, float("-inf"))
        candidates = top.indices
        shortcut = (k > 0) & (k < vocab) & (passing.sum(-1) == k)  # (Rs,) no tie at the k-th score
    if b.any_top_p:
        sorted_scores, sorted_ids = torch.sort(scores, dim=-1, descending=False, stable=True)  # (Rs, V)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # (Rs, V)
        remove = (cumulative <= b.top_p_threshold[:, None]) & b.top_p_on[:, None]  # (Rs, V)
        remove[:, -1] = False  # the top token is always kept
        scores = scores.masked_fill(remove.scatter(1, sorted_ids, remove), float("-inf"))
    if b.any_min_p:
        probs = scores.softmax(dim=-1)  # (Rs, V)
        remove = probs < b.min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # never the top token: min_p <= 1
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.log_softmax(dim=-1), candidates, shortcut


def choose_tokens(
    processed: torch.Tensor, candidates: torch.Tensor | None, shortcut: torch.Tensor, b: SamplingBatch
) -> torch.Tensor:
    """``argmax(processed.double() + gumbel)`` per row (Rs,), with the candidate shortcut where allowed."""
    rs, vocab = processed.shape
    tokens = torch.empty(rs, dtype=torch.int64, device=processed.device)
    use_short = shortcut.tolist() if candidates is not None else [False] * rs  # one host sync per step
    short = [i for i, s in enumerate(use_short) if s]
    full = [i for i, s in enumerate(use_short) if not s]
    if full:
        idx = torch.tensor(full, device=processed.device)
        noise = fast_gumbel_noise(b.seeds[idx], b.positions[idx], vocab)  # (F, V) float64
        tokens[idx] = noise.add_(processed[idx]).argmax(dim=-1)  # float32 + float64 promotes exactly
    if short:
        idx = torch.tensor(short, device=processed.device)
        keys = noise_keys(b.seeds[idx], b.positions[idx])  # (S,)
        cand = candidates[idx].sort(dim=-1).values  # (S, K) ascending ids: argmax ties -> lowest id
        noise = fast_bits_to_gumbel(fast_noise_bits(keys[:, None], cand))  # (S, K) float64
        scores = processed[idx].gather(1, cand).double() + noise  # (S, K)
        tokens[idx] = cand.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
    return tokens


def sample(logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (R,) int64 and their processed log-probs (R,) float32 for logits (R, V) of any float dtype."""
    rows, _ = logits.shape
    logits = logits.float()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if b.greedy_rows:
        idx = torch.tensor(b.greedy_rows, device=logits.device)
        greedy_logits = logits[idx]  # (G, V)
        chosen = greedy_logits.argmax(dim=-1)  # (G,) first maximum = lowest id on ties
        tokens[idx] = chosen
        logprobs[idx] = greedy_logits.log_softmax(dim=-1).gather(1, chosen[:, None]).squeeze(1)
    if b.sampled_rows:
        idx = torch.tensor(b.sampled_rows, device=logits.device)
        processed, candidates, shortcut = process_logits(logits[idx], b)  # (Rs, V)
        chosen = choose_tokens(processed, candidates, shortcut, b)  # (Rs,)
        tokens[idx] = chosen
        logprobs[idx] = processed.gather(1, chosen[:, None]).squeeze(1)
    return tokens, logprobs
