"""Logits processing and counter-based sampling, vectorised over the batch with per-row parameters.

Contract (``reference/spec.py``): greedy rows take ``argmax(logits)`` (lowest id on ties) with log-prob
``log_softmax(logits)``; sampled rows process float32 logits temperature -> top-k -> top-p -> min-p with
transformers' semantics (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
``MinPLogitsWarper``, filter value -inf, one token always kept) and take
``argmax(processed_logprobs.double() + gumbel_noise(seed, position, V))``. Oracle: ``reference.generate``'s
processing and sampling (independent code; the exactness properties compare the two).

Noise: greedy rows get none; sampled rows run ``cb_impl.noise.gumbel_race``, which computes the exact noise only for
the tokens that can still win (bit-identical tokens to the full definition, lowest id on ties).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cb_impl.noise import gumbel_race
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


def process_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Sampled rows' float32 logits (Rs, V) -> processed log-probs (Rs, V)."""
    vocab = logits.shape[1]
    scores = logits.float() / b.temperature[:, None]  # (Rs, V)
    if b.max_top_k > 0:
        k = b.top_k.clamp(max=vocab)  # (Rs,) transformers: top_k = min(top_k, V)
        top = torch.topk(scores, min(b.max_top_k, vocab), dim=-1)  # (Rs, K)
        kth = top.values.gather(1, (k - 1).clamp(min=0)[:, None])  # (Rs, 1)
        on = (k > 0)[:, None]  # (Rs, 1)
        scores = scores.masked_fill((scores < kth) & on, float("-inf"))
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
    return scores.log_softmax(dim=-1)


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
        processed = process_logits(logits[idx], b)  # (Rs, V)
        chosen = gumbel_race(processed, b.seeds, b.positions)  # (Rs,)
        tokens[idx] = chosen
        logprobs[idx] = processed.gather(1, chosen[:, None]).squeeze(1)
    return tokens, logprobs
