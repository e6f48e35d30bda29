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
  ``-log u >= 1 - u``, ``g <= -log(1 - u) = 32 ln 2 - ln(c + 0.5)`` with ``c = 2**32 - 1 - bits``, and
  ``ln(c + 0.5) >= (B / 2**23 - 127) ln 2`` for ``B`` the bits of float32 ``c`` (exponent ``e``, mantissa ``f``:
  ``B / 2**23 - 127 = e + f <= e + log2(1 + f) = log2 c``; the classic fast log2 is a lower bound; ``c = 0`` reads as
  a bound of 159 ln 2, above any noise). So ``lp_v + (159 - B_v / 2**23) ln 2`` bounds each score from above, within
  0.06 of ``-log(1 - u)``, with conversions only. A token whose bound is below the exact score of one token (the
  one with the largest bound) cannot win; the two logarithms are computed for the few tokens left (about one per
  flat row of 4096). The search runs over chunks of 64 tokens: their maxima are one fast pass, and only the chunks
  whose maximum reaches that score are compared token by token. Tokens removed by a processor (-inf) never win.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from reference.spec import MASK32, MIX_MUL1, MIX_MUL2, SEED_SALT

__all__ = ["gumbel_race", "gumbel_upper_bound", "minus_gumbel", "mix32_", "seed_key", "step_keys"]

_MUL1, _MUL2 = (c - 2**32 if c >= 2**31 else c for c in (MIX_MUL1, MIX_MUL2))  # the hash constants as int32
RACE_MIN_VOCAB = 256  # CPU, 256 rows: the race is 1.8x slower at V = 64, 1.25x at 128, 1.4x faster at 256
RACE_CHUNK = 64  # CPU: argmax, comparisons and nonzero cost ~10x a max per element; only chunks reaching it pay them
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


def _xorshift_(x: torch.Tensor, n: int) -> None:
    """In place ``x ^= x >>> n`` (logical shift) on int32 bits."""
    x.bitwise_xor_((x >> n).bitwise_and_((1 << (32 - n)) - 1))


def mix32_(x: torch.Tensor) -> torch.Tensor:
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
    return mix32_(seed_keys.to(torch.int32) ^ positions.to(torch.int32))


def minus_gumbel(bits: torch.Tensor) -> torch.Tensor:
    """``-reference.spec.bits_to_gumbel`` of int32 bits, float64: the spec's operations in its order, in place, but
    the final negation."""
    u = bits.view(torch.uint32).to(torch.float64).add_(0.5).mul_(1.0 / 2**32)
    return u.log_().neg_().log_()


def gumbel_upper_bound(bits: torch.Tensor) -> torch.Tensor:
    """float32 ``(159 - B / 2**23) ln 2 + margin`` with ``B`` the bits of float32 ``c = 2**32 - 1 - bits`` (int32
    bits): at least ``bits_to_gumbel(bits)`` (module docstring; the float32 roundings of ``c``, ``B`` and the sum are
    below 1e-5, inside the margin)."""
    c = bits.bitwise_not().view(torch.uint32).float()  # (...) 2**32 - 1 - bits, the unsigned value of ~bits
    return c.view(torch.int32).float().mul_(-math.log(2) / 2**23).add_(159 * math.log(2) + _BOUND_MARGIN)


def gumbel_race(processed: torch.Tensor, keys: torch.Tensor, min_vocab: int = RACE_MIN_VOCAB) -> torch.Tensor:
    """``argmax_v(processed.double() + gumbel_noise(seeds, positions, V))`` per row (R,), lowest id on ties, with
    exact noise only for the tokens whose upper bound reaches one token's exact score (see the module docstring);
    below ``min_vocab`` tokens the pruning costs more than it saves and every token gets its exact noise. ``keys``
    (R,) are the rows' :func:`step_keys`."""
    rows, vocab = processed.shape
    ids = torch.arange(vocab, dtype=torch.int32, device=keys.device)  # (V,)
    bits = mix32_(keys.unsqueeze(1) ^ ids)  # (R, V) int32: reference.spec.noise_bits
    if vocab < min_vocab:
        return processed.double().sub_(minus_gumbel(bits)).argmax(dim=-1)  # first maximum on ties
    bound = gumbel_upper_bound(bits).add_(processed)  # (R, V) float32, >= each token's score
    pad = -vocab % RACE_CHUNK  # chunks of the row: -inf past its end
    chunks = (F.pad(bound, (0, pad), value=float("-inf")) if pad else bound).view(rows, -1, RACE_CHUNK)  # (R, C, 64)
    chunk_max = chunks.amax(dim=-1)  # (R, C)
    top = chunk_max.argmax(dim=-1)  # (R,) the first chunk holding the row's largest bound
    first = chunks[torch.arange(rows, device=top.device), top].argmax(dim=-1)  # (R,) its first largest bound
    anchor = (top * RACE_CHUNK + first)[:, None]  # (R, 1) that token
    floor = processed.gather(1, anchor).double().sub_(minus_gumbel(bits.gather(1, anchor))).float()  # (R, 1)
    rc, c = (chunk_max >= floor).nonzero(as_tuple=True)  # (K,) the chunks that can hold a winner
    hit, offset = (chunks[rc, c] >= floor[rc]).nonzero(as_tuple=True)  # (N,) their tokens that can win
    r, v = rc[hit], c[hit] * RACE_CHUNK + offset  # (N,) each, row-major
    score = processed[r, v].double().sub_(minus_gumbel(bits[r, v]))  # (N,) exact scores
    best = torch.full((rows,), float("-inf"), dtype=torch.float64, device=score.device)
    best.scatter_reduce_(0, r, score, "amax")  # (R,)
    winners = score == best[r]  # (N,) the row's maximum, possibly tied
    tokens = torch.full((rows,), vocab, dtype=torch.int64, device=score.device)
    return tokens.scatter_reduce_(0, r[winners], v[winners], "amin")  # lowest id among tied maxima
