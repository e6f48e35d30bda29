"""The shared vocabulary of cbverify: sampling parameters, requests, rollouts, and the sampling noise.

This is the one module of ``reference`` that ``cb_impl`` may import (the layers are in docs/architecture.md): data
types and the definition of the noise, never any computation an engine is judged on.

Sampling is a function, not a random stream. The token at completion position ``i`` of a request with seed
``s`` is::

    argmax_v( processed_logprobs[v] + gumbel(s, i, v) )

where ``gumbel`` is :func:`gumbel_noise` below. By the Gumbel-max theorem this is an exact sample from the processed
distribution, and it does not depend on batch composition, arrival order, chunking or preemption.

Greedy decoding (``temperature == 0``) is ``argmax_v(logits[v])`` with ties broken towards the lowest token id (what
``torch.argmax`` does), and its log-prob is ``log_softmax(logits)`` at the chosen token (no processors applied).

Processor order is temperature -> top-k -> top-p -> min-p with transformers' semantics:

- top-k keeps every token whose score is >= the k-th largest score (ties at the boundary are kept);
- top-p sorts ascending, removes tokens whose cumulative probability is <= 1 - top_p, and always keeps the top token;
- min-p removes tokens whose probability is < min_p * max probability;

``top_k == 0``, ``top_p == 1.0`` and ``min_p == 0.0`` each disable their processor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

FinishReason = Literal["stop", "length"]
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request is sampled. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        n = self.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class RolloutRequest:
    """One prompt to complete. ``seed`` fixes the sampled tokens (see :func:`gumbel_noise`)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_ids is empty")
        if min(self.prompt_ids) < 0:
            raise ValueError(f"request {self.request_id!r}: negative token id in prompt_ids")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"request {self.request_id!r}: sampling must be a SamplingParams")
        if not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"request {self.request_id!r}: seed must be an int in [0, 2**63), got {self.seed!r}")


@dataclass(frozen=True, slots=True)
class Rollout:
    """One finished request.

    ``completion_ids`` includes the first EOS if one was produced and nothing after it; ``logprobs[i]`` is the
    log-probability of ``completion_ids[i]`` under the processed distribution it was sampled from.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "completion_ids", tuple(int(t) for t in self.completion_ids))
        object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"rollout {self.request_id!r}: {len(self.logprobs)} logprobs for {len(self.completion_ids)} tokens"
            )
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"rollout {self.request_id!r}: finish_reason must be 'stop' or 'length'")


# ---------------------------------------------------------------------------------------------------------------
# Counter-based sampling noise.
#
# Every operation below is on int64 tensors holding values in [0, 2**32), and no intermediate exceeds 2**49, so the
# arithmetic is exact and identical on any device: no overflow, no generator state, no global RNG.
# The mixer is Chris Wellons' "lowbias32" integer hash (xorshift-multiply, two rounds).
# ---------------------------------------------------------------------------------------------------------------
# The hash constants are part of the spec (public: a faster implementation, e.g. cb_impl.noise, must reuse them).
MASK32 = 0xFFFFFFFF
MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B
SEED_SALT = 0x9E3779B9  # golden-ratio constant: keeps the seed's high word independent of its low word


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for x in [0, 2**32), computed in 16-bit halves so int64 never overflows."""
    lo = (x & 0xFFFF) * c  # < 2**48
    hi = ((x >> 16) * c) & 0xFFFF  # only the low 16 bits survive the shift below
    return (lo + (hi << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective 32-bit integer hash with good avalanche. ``x`` is int64 in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL2)
    return x ^ (x >> 16)


def noise_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The per-(request, position) hash that :func:`noise_bits` combines with the token id.

    ``seeds`` and ``positions`` are int64 of the same shape (B,); returns int64 (B,) in [0, 2**32).
    """
    seeds = seeds.to(torch.int64)
    key = mix32(seeds & MASK32)
    key = mix32(key ^ ((seeds >> 32) & MASK32) ^ SEED_SALT)
    return mix32(key ^ (positions.to(torch.int64) & MASK32))


def noise_bits(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """32 uniform random bits per (key, token): ``mix32(key ^ token_id)``; broadcasts like ``keys ^ token_ids``."""
    return mix32(keys ^ token_ids.to(torch.int64))


def bits_to_gumbel(bits: torch.Tensor) -> torch.Tensor:
    """Uniform bits -> standard Gumbel noise, float64: ``u = (bits + 0.5) / 2**32``, ``g = -log(-log(u))``."""
    u = (bits.to(torch.float64) + 0.5) * (1.0 / 2**32)
    return -torch.log(-torch.log(u))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise for every token of the vocabulary: float64 (B, V), on ``seeds``' device.

    ``seeds`` (B,) are the requests' seeds, ``positions`` (B,) their completion positions (0 for the first generated
    token). Entry ``[b, v]`` depends only on ``(seeds[b], positions[b], v)``.
    """
    keys = noise_keys(seeds, positions)  # (B,)
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)  # (V,)
    return bits_to_gumbel(noise_bits(keys[:, None], vocab[None, :]))  # (B, V)
