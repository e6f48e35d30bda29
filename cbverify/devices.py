"""The oracle's attention kernels on an accelerator.

The oracle recomputes the full prefix for every token and teacher forcing runs one unpadded forward per rollout, so
nearly every attention call has a shape not seen before. cuDNN's SDPA kernel builds an execution plan for each new
shape: in one bf16 ``verify`` on an H200, 8,216 SDPA calls took 32.5 s of a 64 s run, ~4 ms a call for a few
microseconds of work. :func:`oracle_attention` lets SDPA choose among its other kernels (flash, memory-efficient,
math) while the oracle and teacher forcing run; on a CPU, which has no cuDNN kernel, it changes nothing. The engines
under test keep whatever their own code chooses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.nn.attention import SDPBackend, sdpa_kernel

ORACLE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextmanager
def oracle_attention() -> Iterator[None]:
    with sdpa_kernel(ORACLE_SDPA_BACKENDS):
        yield
