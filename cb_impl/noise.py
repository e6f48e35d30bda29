"""Counter-based Gumbel noise, bit-identical to ``reference.spec`` but with fewer tensor passes.

Oracle: ``reference.spec.noise_keys`` / ``noise_bits`` / ``bits_to_gumbel`` / ``gumbel_noise`` (``test_cb_sampler``
compares the bits over the full 32-bit range). The spec multiplies in 16-bit halves so int64 never overflows
(8 elementwise passes per multiply). Here the multiply splits the *constant* instead, which keeps the low 32 bits
exact with 5 passes, and every intermediate is updated in place (no temporaries per pass): the full-vocabulary
noise of a sampled row is about 2x cheaper. Products stay below 2**48 and shifted terms are masked first, so nothing
overflows and the bits are the same on every device.
"""

from __future__ import annotations

import torch

from reference.spec import MASK32, MIX_MUL1, MIX_MUL2, noise_keys

__all__ = ["fast_bits_to_gumbel", "fast_gumbel_noise", "fast_noise_bits", "noise_keys"]


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """In place: ``x = (x * c) mod 2**32`` for int64 ``x`` in [0, 2**32); returns ``x``."""
    hi = x * (c >> 16)  # < 2**48
    hi.bitwise_and_(0xFFFF).bitwise_left_shift_(16)  # only bits 16..31 of (x * c_hi) << 16 survive the mod
    return x.mul_(c & 0xFFFF).add_(hi).bitwise_and_(MASK32)  # x * c_lo < 2**48


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place lowbias32 (``reference.spec.mix32``); returns ``x``."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, MIX_MUL1)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, MIX_MUL2)
    return x.bitwise_xor_(x >> 16)


def fast_noise_bits(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``reference.spec.noise_bits``: 32 uniform bits per (key, token), broadcasting like ``keys ^ token_ids``."""
    return _mix32_(keys ^ token_ids.to(torch.int64))


def fast_bits_to_gumbel(bits: torch.Tensor) -> torch.Tensor:
    """``reference.spec.bits_to_gumbel`` (same float64 operations in the same order, in place)."""
    u = bits.to(torch.float64).add_(0.5).mul_(1.0 / 2**32)
    return u.log_().neg_().log_().neg_()


def fast_gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``reference.spec.gumbel_noise``: float64 (B, V) Gumbel noise for every token of the vocabulary."""
    keys = noise_keys(seeds, positions)  # (B,)
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)  # (V,)
    return fast_bits_to_gumbel(fast_noise_bits(keys[:, None], vocab[None, :]))  # (B, V)
