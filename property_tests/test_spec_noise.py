"""The counter-based sampling noise of ``reference.spec``: a pure function of (seed, position, token),
standard Gumbel distributed, and bit-identical on CPU and CUDA.

Statistical tests are deterministic (the noise is a function), so "false-alarm rate" means: the chance that a correct
Gumbel source fails the test for the drawn inputs. Each test states it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from cbverify.tolerances import SELF_TEST_PVALUE
from conftest import requires_cuda
from property_tests.strategies import positions, seeds
from reference.spec import gumbel_noise


def _noise(seeds: list[int], positions: list[int], vocab_size: int, device: str = "cpu") -> torch.Tensor:
    return gumbel_noise(
        torch.tensor(seeds, dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        vocab_size,
    )


@given(rows=st.lists(st.tuples(seeds(), positions()), min_size=1, max_size=8), vocab=st.integers(1, 300))
def test_noise_is_deterministic_and_each_row_depends_only_on_its_own_seed_and_position(rows, vocab):
    seeds, positions = [s for s, _ in rows], [p for _, p in rows]
    batch = _noise(seeds, positions, vocab)
    assert batch.shape == (len(rows), vocab) and batch.dtype == torch.float64
    assert torch.equal(batch, _noise(seeds, positions, vocab))  # same call, same bits
    for i, (seed, position) in enumerate(rows):  # alone, or in a reversed batch: the same bits
        assert torch.equal(batch[i], _noise([seed], [position], vocab)[0])
    assert torch.equal(batch.flip(0), _noise(seeds[::-1], positions[::-1], vocab))


@given(seed=seeds(), position=positions(), small=st.integers(1, 64), extra=st.integers(1, 200))
def test_noise_of_a_token_does_not_depend_on_the_vocabulary_size(seed, position, small, extra):
    assert torch.equal(_noise([seed], [position], small)[0], _noise([seed], [position], small + extra)[0, :small])


@given(seed=seeds(), position=positions(), other_seed=seeds(), other_position=positions())
def test_a_different_seed_or_position_gives_different_noise(seed, position, other_seed, other_position):
    if (seed, position) == (other_seed, other_position):
        return
    a, b = _noise([seed, other_seed], [position, other_position], 64)
    assert not torch.equal(a, b)  # 64 shared 32-bit draws: an accidental full match has probability ~2**-2048


def test_noise_is_standard_gumbel_by_a_ks_test_at_one_in_a_million_false_alarm():
    seeds = list(range(0, 2**40, 2**40 // 256))[:256]  # spread-out seeds, including 0
    noise = _noise(seeds, list(range(256)), 512).flatten().numpy()  # 131072 draws
    result = stats.kstest(noise, stats.gumbel_r.cdf)
    assert result.pvalue > SELF_TEST_PVALUE, result


@given(seed=seeds(), position=st.integers(0, 10_000))
def test_noise_along_the_vocabulary_is_gumbel_and_uncorrelated_for_any_drawn_seed(seed, position):
    # false alarm per example: KS 1e-6 + correlation |z| > 5 (~6e-7): under 1e-4 across a 50-example profile
    noise = _noise([seed] * 16, [position + k for k in range(16)], 1024)  # (16, 1024): 16384 draws
    assert stats.kstest(noise.flatten().numpy(), stats.gumbel_r.cdf).pvalue > SELF_TEST_PVALUE
    flat = noise.flatten()
    for a, b in ((flat[:-1], flat[1:]), (noise[:-1].flatten(), noise[1:].flatten())):  # next token, next position
        z = torch.corrcoef(torch.stack([a, b]))[0, 1].item() * (a.numel() ** 0.5)
        assert abs(z) < 5.0, z


@pytest.mark.gpu
@requires_cuda
@given(rows=st.lists(st.tuples(seeds(), positions()), min_size=1, max_size=64), vocab=st.integers(1, 4096))
def test_noise_is_bit_identical_on_cpu_and_cuda(rows, vocab):
    seeds, positions = [s for s, _ in rows], [p for _, p in rows]
    cpu = _noise(seeds, positions, vocab)
    cuda = _noise(seeds, positions, vocab, device="cuda").cpu()
    assert torch.equal(cpu.view(torch.int64), cuda.view(torch.int64))  # the bits, not just the values
