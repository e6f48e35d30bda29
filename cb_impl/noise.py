"""Counter-based Gumbel noise, bit-identical to ``reference.spec``, and the Gumbel race run only where a token can win.

Oracle: ``reference.spec.noise_keys`` / ``noise_bits`` / ``bits_to_gumbel`` / ``gumbel_noise`` (``test_cb_sampler``
compares the bits over the full 32-bit range and the race against the full-vocabulary argmax).

- Bits: the spec multiplies in 16-bit halves so int64 never overflows. Here the hash runs on int32 tensors holding
  the 32 bits in two's complement: a product mod 2**32 has the same bits signed or unsigned, and a logical shift is an
  arithmetic one with the sign bits masked off. Half the bytes and a third of the passes of the int64 form. The
  seed's two rounds of the key are computed once per request in Python (:func:`seed_key`); a step mixes in the
  position only (:func:`step_keys`). The race subtracts ``log(-log u)`` (:func:`minus_gumbel`): ``a - b`` is
  ``a + (-b)`` exactly, one pass fewer.
- Race: the token is ``argmax_v(lp_v + g_v)`` with ``g = -log(-log u)``, ``u = (bits + 0.5) / 2**32``. Since
  ``-log u >= 1 - u``, ``g <= -log(1 - u) = 32 ln 2 - ln(c + 0.5)`` with ``c = 2**32 - 1 - bits``, and for ``c >= 1``
  ``ln(c + 0.5) >= floor(log2 c) ln 2``, read exactly off the float32 exponent of ``c >> 8`` (``c < 256`` reads as
  0: a bound of 151 ln 2, above any noise). So ``lp_v + (32 - floor(log2 c_v)) ln 2`` bounds each score from above
  with integer work only; any token whose bound is below the exact score of one token (the one with the largest
  bound) cannot win, and the two logarithms are computed for the few tokens left (a flat row of 4096 tokens keeps a
  handful). Tokens removed by a processor (-inf) are never candidates.
"""

from __future__ import annotations

import math

import torch

from reference.spec import MASK32, MIX_MUL1, MIX_MUL2, SEED_SALT

__all__ = ["fast_noise_bits", "gumbel_race", "gumbel_upper_bound", "minus_gumbel", "seed_key", "step_keys"]

_MUL1, _MUL2 = (c - 2**32 if c >= 2**31 else c for c in (MIX_MUL1, MIX_MUL2))  # the hash constants as int32
RACE_MIN_VOCAB = 128  # CPU, 256 rows: the race is 1.2x slower at V = 64, even at 128, 1.4x faster at 256
_BOUND_MARGIN = 1e-3  # far above the float32 rounding of a bound (~1e-5 at |score| ~ 250); only widens the candidates


def _mix32_int(x: int) -> int:
    """``reference.spec.mix32`` on one Python int in [0, 2**32)."""
    x = ((x ^ (x >> 16)) * MIX_MUL1) & MASK32
    x = ((x ^ (x >> 15)) * MIX_MUL2) & MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """The position-independent part of ``reference.spec.noise_keys`` for one seed (once per request), as the signed
    value of its 32 bits: ``noise_keys(seed, position)`` has the bits of ``mix32(seed_key(seed) ^ position)``."""
    key = _mix32_int(seed & MASK32)
    key = _mix32_int(key ^ ((seed >> 32) & MASK32) ^ SEED_SALT)
    return key - 2**32 if key >= 2**31 else key


def _int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 tensors with the same 32 bits (two's complement), without overflow."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _xorshift_(x: torch.Tensor, n: int) -> None:
    """In place ``x ^= x >>> n`` (logical shift) on int32 bits."""
    x.bitwise_xor_((x >> n).bitwise_and_((1 << (32 - n)) - 1))


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (``reference.spec.mix32``) in place on int32 bits; returns ``x``."""
    _xorshift_(x, 16)
    x.mul_(_MUL1)
    _xorshift_(x, 15)
    x.mul_(_MUL2)
    _xorshift_(x, 16)
    return x


def step_keys(seed_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``reference.spec.noise_keys`` as int32 bits (R,), from :func:`seed_key` values and positions (R,) in
    ``[0, 2**31)`` (completion positions, below any model's context), of any integer dtype."""
    return _mix32_(seed_keys.to(torch.int32) ^ positions.to(torch.int32))


def fast_noise_bits(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``reference.spec.noise_bits``: int64 bits in [0, 2**32) per (key, token), broadcasting like ``keys ^ ids``."""
    return _mix32_(_int32(keys) ^ _int32(token_ids.to(torch.int64))).to(torch.int64).bitwise_and_(MASK32)


def minus_gumbel(bits: torch.Tensor) -> torch.Tensor:
    """``-reference.spec.bits_to_gumbel`` of int32 bits, float64: the spec's operations in its order, in place, but
    the final negation."""
    u = bits.view(torch.uint32).to(torch.float64).add_(0.5).mul_(1.0 / 2**32)
    return u.log_().neg_().log_()


def gumbel_upper_bound(bits: torch.Tensor) -> torch.Tensor:
    """float32 ``(32 - floor(log2 c)) ln 2 + margin`` with ``c = 2**32 - 1 - bits`` (int32 bits): at least
    ``bits_to_gumbel(bits)``. ``floor(log2 c)`` is read off the float32 exponent of ``c >> 8``, exact below 2**24
    (``c < 256`` reads as ``c = 0``: a bound of 151 ln 2, above any noise)."""
    m = (bits.bitwise_not() >> 8).bitwise_and_(0xFFFFFF).float()  # (...) c >> 8, exact in float32
    exponent = m.view(torch.int32) >> 23  # 127 + floor(log2 c) - 8; 0 for m = 0
    return (151 - exponent).float().mul_(math.log(2)).add_(_BOUND_MARGIN)


def gumbel_race(processed: torch.Tensor, keys: torch.Tensor, min_vocab: int = RACE_MIN_VOCAB) -> torch.Tensor:
    """``argmax_v(processed.double() + gumbel_noise(seeds, positions, V))`` per row (R,), lowest id on ties, with
    exact noise only for the tokens whose upper bound reaches one token's exact score (see the module docstring);
    below ``min_vocab`` tokens the pruning costs more than it saves and every token gets its exact noise. ``keys``
    (R,) are the rows' :func:`step_keys`."""
    rows, vocab = processed.shape
    ids = torch.arange(vocab, dtype=torch.int32, device=keys.device)  # (V,)
    bits = _mix32_(keys.unsqueeze(1) ^ ids)  # (R, V) int32: reference.spec.noise_bits
    if vocab < min_vocab:
        return processed.double().sub_(minus_gumbel(bits)).argmax(dim=-1)  # first maximum on ties
    bound = gumbel_upper_bound(bits).add_(processed)  # (R, V) float32, >= each token's score
    anchor = bound.argmax(dim=-1, keepdim=True)  # (R, 1) a token with a finite log-prob and a large bound
    floor = processed.gather(1, anchor).double().sub_(minus_gumbel(bits.gather(1, anchor)))  # (R, 1)
    r, v = (bound >= floor.float()).nonzero(as_tuple=True)  # (N,) each, row-major: the tokens that can win
    score = processed[r, v].double().sub_(minus_gumbel(bits[r, v]))  # (N,) exact scores
    best = torch.full((rows,), float("-inf"), dtype=torch.float64, device=score.device)
    best.scatter_reduce_(0, r, score, "amax")  # (R,)
    winners = score == best[r]  # (N,) the row's maximum, possibly tied
    tokens = torch.full((rows,), vocab, dtype=torch.int64, device=score.device)
    return tokens.scatter_reduce_(0, r[winners], v[winners], "amin")  # lowest id among tied maxima
