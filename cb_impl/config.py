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
    - ``float64_attention``: compute the paged attention in float64 and cast back (off by default). It was once the
      CPU default, when the float32 path moved log-probs of the trained tiny Llama by up to 1.24e-5 per request; on
      the current code float32 stays at or below float64's error (``cbverify verify`` on the three bundled models,
      seeds 0 and 1: max |dlogp| 5.7e-6 against 7.6e-6, against the fp32 tier's 5e-5) while float64 batched matmuls
      on CPU run ~15x slower than float32 ones (a decode layer of 64 sequences: 7.8 ms against 0.5 ms).
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_memory_fraction: float = 0.5
    max_batch_tokens: int = 512
    max_num_seqs: int = 256
    enable_prefix_sharing: bool = True
    max_model_len: int | None = None
    float64_attention: bool = False

    def __post_init__(self) -> None:
        def positive_int(name: str, value: object) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")

        positive_int("block_size", self.block_size)
        positive_int("max_batch_tokens", self.max_batch_tokens)
        positive_int("max_num_seqs", self.max_num_seqs)
        if self.num_blocks is not None:
            positive_int("num_blocks", self.num_blocks)
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)
        fraction = self.max_memory_fraction
        if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0.0 < fraction <= 1.0):
            raise ValueError(f"EngineConfig.max_memory_fraction must be in (0, 1], got {fraction!r}")
        if not isinstance(self.float64_attention, bool):
            raise ValueError(f"EngineConfig.float64_attention must be a bool, got {self.float64_attention!r}")
        if not isinstance(self.enable_prefix_sharing, bool):
            raise ValueError(f"EngineConfig.enable_prefix_sharing must be a bool, got {self.enable_prefix_sharing!r}")
