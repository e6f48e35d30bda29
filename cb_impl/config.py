"""Engine configuration: one frozen, slotted dataclass validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the continuous-batching engine uses memory and compute.

    - ``block_size``: tokens per KV-cache block (the paging granularity).
    - ``num_blocks``: KV-cache blocks to preallocate; ``None`` sizes the cache from ``max_memory_fraction`` of the
      free memory of the model's device, capped at what ``max_num_seqs`` sequences of ``max_model_len`` can use.
    - ``max_memory_fraction``: fraction of free device memory the cache may take when ``num_blocks`` is ``None``
      (TRL's ``max_memory_percent``, default 0.5).
    - ``max_batch_tokens``: tokens (prefill chunks + decode tokens) in one forward; longer prompts are chunked.
    - ``max_num_seqs``: sequences admitted at once (running, including those awaiting a shared prefill).
    - ``enable_prefix_sharing``: requests with the same prompt that arrive back to back (a GRPO group) prefill it
      once and share its blocks (reference-counted, copy-on-write for a partly filled last block).
    - ``max_model_len``: longest prompt + completion; ``None`` takes the model config's ``max_position_embeddings``.
    - ``float64_attention``: compute the paged attention in float64 and cast back (off: on the three bundled models
      float32 stays within float64's error, max |dlogp| 5.7e-6 against 7.6e-6 for the fp32 tier's 5e-5, while
      float64 batched matmuls run ~15x slower on CPU).
    - ``cuda_graphs``: on a CUDA device, run decode steps from CUDA graphs, one per (batch, context) bucket
      (``cb_impl.graphs``); off, they run eagerly. A model whose forward cannot be captured (it reads a device value
      back) turns them off with a ``RuntimeWarning``.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_memory_fraction: float = 0.5
    max_batch_tokens: int = 512
    max_num_seqs: int = 256
    enable_prefix_sharing: bool = True
    max_model_len: int | None = None
    float64_attention: bool = False
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        optional = ("num_blocks", "max_model_len")  # None = sized from memory / the model config
        for name in ("block_size", "max_batch_tokens", "max_num_seqs", *optional):
            value = getattr(self, name)
            if (value is not None or name not in optional) and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        fraction = self.max_memory_fraction
        if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0.0 < fraction <= 1.0):
            raise ValueError(f"EngineConfig.max_memory_fraction must be in (0, 1], got {fraction!r}")
        for name in ("float64_attention", "enable_prefix_sharing", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
