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

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from cb_impl.noise import RACE_MIN_VOCAB, gumbel_race, seed_key, step_keys
from reference.spec import SamplingParams

SAMPLE_BUDGET = 1 << 18  # CPU: logits per slice of sampled rows, heap-reused temporaries, not a fresh mmap (faults)
SamplingRow = tuple[tuple[float, float, float], tuple[int, int]] | None


def sampling_row(params: SamplingParams, seed: int) -> SamplingRow:
    """A request's sampling constants, computed once when it is queued: ``None`` for greedy, else
    ``((temperature, top_p_threshold, min_p), (top_k, seed_key(seed)))``."""
    if params.greedy:
        return None
    top_p_threshold = 1 - params.top_p if params.top_p < 1.0 else -1.0  # -1: top-p off, nothing at or below it
    return (params.temperature, top_p_threshold, params.min_p), (params.top_k, seed_key(seed))


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row sampling constants, on the logits' device (reusable while the rows are the same requests). Rows index
    the logits passed to :func:`sample`; ``greedy_rows`` / ``sampled_rows`` are host lists partitioning them."""

    greedy_rows: list[int]
    sampled_rows: list[int]
    temperature: torch.Tensor  # (Rs, 1) float32
    top_k: torch.Tensor  # (Rs,) int64, 0 = off
    top_p_threshold: torch.Tensor  # (Rs,) float32: 1 - top_p (transformers' comparison value), -1 = off
    min_p: torch.Tensor  # (Rs,) float32, 0 = off
    seed_keys: torch.Tensor  # (Rs,) int32: cb_impl.noise.seed_key of the rows' seeds
    max_top_k: int  # host: the largest top_k among sampled rows (0 = no top-k row)
    any_top_p: bool
    any_min_p: bool

    def rows(self, sl: slice) -> SamplingBatch:
        """The sampled rows ``sl`` (the host flags stay the batch's: a row with its processor off ignores them)."""
        return replace(self, temperature=self.temperature[sl], top_k=self.top_k[sl],
                       top_p_threshold=self.top_p_threshold[sl], min_p=self.min_p[sl],
                       seed_keys=self.seed_keys[sl])  # fmt: skip


def build_sampling_batch(rows: Sequence[SamplingRow], device: torch.device) -> SamplingBatch:
    """Per-row :func:`sampling_row` constants -> one set of device tensors."""
    greedy, sampled = [], []
    floats, ints = array("f", (0, -1, 0)), array("q", (0, 0))  # a row with every processor off, sliced off below
    for i, row in enumerate(rows):
        if row is None:
            greedy.append(i)
        else:
            sampled.append(i)
            floats.extend(row[0])
            ints.extend(row[1])
    f = torch.frombuffer(floats, dtype=torch.float32).view(-1, 3)  # (1 + Rs, 3)
    q = torch.frombuffer(ints, dtype=torch.int64).view(-1, 2)  # (1 + Rs, 2)
    kept = [row for row in rows if row is not None]  # the host flags, read off the rows (no tensor read back)
    flags = (max((r[1][0] for r in kept), default=0), any(r[0][1] >= 0 for r in kept), any(r[0][2] > 0 for r in kept))
    f, q = f[1:].to(device), q[1:].to(device)  # (Rs, 3) float32, (Rs, 2) int64
    return SamplingBatch(greedy, sampled, temperature=f[:, :1], top_k=q[:, 0], top_p_threshold=f[:, 1],
                         min_p=f[:, 2], seed_keys=q[:, 1].to(torch.int32),
                         max_top_k=flags[0], any_top_p=flags[1], any_min_p=flags[2])  # fmt: skip


def process_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Sampled rows' float32 logits (Rs, V) -> processed log-probs (Rs, V)."""
    vocab = logits.shape[1]
    scores = logits.float() / b.temperature  # (Rs, V)
    if b.max_top_k > 0:
        k = b.top_k.clamp(max=vocab)  # (Rs,) transformers: top_k = min(top_k, V)
        top = torch.topk(scores, min(b.max_top_k, vocab), dim=-1)  # (Rs, K)
        kth = top.values.gather(1, (k - 1).clamp(min=0)[:, None])  # (Rs, 1)
        on = (k > 0)[:, None]  # (Rs, 1)
        scores = scores.masked_fill((scores < kth) & on, float("-inf"))
    if b.any_top_p:
        sorted_scores, sorted_ids = torch.sort(scores, dim=-1, descending=False, stable=True)  # (Rs, V)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # (Rs, V)
        remove = cumulative <= b.top_p_threshold[:, None]  # (Rs, V)
        remove[:, -1] = False  # the top token is always kept
        scores = scores.masked_fill(remove.scatter(1, sorted_ids, remove), float("-inf"))
    if b.any_min_p:
        probs = scores.softmax(dim=-1)  # (Rs, V)
        remove = probs < b.min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # never the top token: min_p <= 1
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.log_softmax(dim=-1)


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = logits.argmax(dim=-1)  # (G,) first maximum = lowest id on ties
    return chosen, logits.log_softmax(dim=-1).gather(1, chosen[:, None]).squeeze(1)


def _sampled(logits: torch.Tensor, b: SamplingBatch, positions: torch.Tensor, budget: int | None,
             race_min_vocab: int | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    step = logits.shape[0] if budget is None else max(1, budget // logits.shape[1])  # rows per slice (independent)
    if logits.shape[0] > step:
        parts = [_sampled(logits[i : i + step], b.rows(slice(i, i + step)), positions[i : i + step], budget,
                          race_min_vocab) for i in range(0, logits.shape[0], step)]  # fmt: skip
        return torch.cat([t for t, _ in parts]), torch.cat([lp for _, lp in parts])
    processed = process_logits(logits, b)  # (Rs, V)
    min_vocab = logits.shape[1] + 1 if race_min_vocab is None else race_min_vocab  # None: exact noise everywhere
    chosen = gumbel_race(processed, step_keys(b.seed_keys, positions), min_vocab)  # (Rs,)
    return chosen, processed.gather(1, chosen[:, None]).squeeze(1)


def sample(logits: torch.Tensor, b: SamplingBatch, positions: torch.Tensor, budget: int | None = SAMPLE_BUDGET,
           race_min_vocab: int | None = RACE_MIN_VOCAB) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Tokens (R,) int64 and their processed log-probs (R,) float32 for logits (R, V) of any float dtype, the rows
    sampling the tokens at completion ``positions`` (R,) int64; sampled rows run in slices of ``budget`` logits
    (``None``: one slice) and race from ``race_min_vocab`` tokens (``None``: exact noise for every token).
    Needs R >= 1: a step that samples nothing must not reach the sampler (``cb_impl.model_runner``'s invariant)."""
    if logits.shape[0] == 0:
        raise ValueError("sample() got no rows: a step that samples nothing must not reach the sampler")
    logits = logits.float()
    if not b.greedy_rows:
        return _sampled(logits, b, positions, budget, race_min_vocab)
    if not b.sampled_rows:
        return _greedy(logits)
    tokens, logprobs = (logits.new_empty(logits.shape[0], dtype=d) for d in (torch.int64, torch.float32))  # (R,) each
    g, s = (torch.tensor(rows, device=logits.device) for rows in (b.greedy_rows, b.sampled_rows))
    tokens[g], logprobs[g] = _greedy(logits[g])
    tokens[s], logprobs[s] = _sampled(logits[s], b, positions[s], budget, race_min_vocab)
    return tokens, logprobs
