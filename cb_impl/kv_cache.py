"""The paged KV cache: preallocated slots, ``(num_blocks + 1) * block_size`` per layer, addressed by slot index.

Slot ``b * block_size + o`` holds offset ``o`` of block ``b``. Block ``num_blocks``, past those the block manager
hands out, is scratch: a padded decode step's padding rows write there (``cb_impl.graphs``). Allocated with
``torch.empty`` (no page is touched until written; ``release`` hands them back between batches); the attention never
reads an unwritten slot (``attention``).
"""

from __future__ import annotations

import math

import psutil
import torch

from cb_impl.config import EngineConfig


class PagedKVCache:
    """Keys and values of every layer: ``key[layer]`` is (num_slots, num_kv_heads, head_dim)."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks  # owned by no sequence
        shape = (num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.key = torch.empty(shape, dtype=dtype, device=device)  # (L, slots, Hkv, D)
        self.value = torch.empty(shape, dtype=dtype, device=device)  # (L, slots, Hkv, D)

    @property
    def num_bytes(self) -> int:
        """Bytes reserved, the scratch block's included."""
        return 2 * self.key.numel() * self.key.element_size()

    @property
    def block_bytes(self) -> int:
        return self.num_bytes // (self.num_blocks + 1)

    def release(self) -> None:
        """Hand every page back while no block is in use (contents lost): fresh, untouched memory of the same shape."""
        self.key, self.value = torch.empty_like(self.key), torch.empty_like(self.value)

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the new tokens' keys/values: ``slot_mapping`` (T,), ``key``/``value`` (T, Hkv, D)."""
        self.key[layer].index_copy_(0, slot_mapping, key.to(self.key.dtype))
        self.value[layer].index_copy_(0, slot_mapping, value.to(self.value.dtype))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (``src -> dst``) in every layer: the copy-on-write of a shared, partly filled block."""
        if not copies:
            return
        src, dst = (torch.tensor(ids, device=self.key.device) for ids in zip(*copies, strict=True))  # (C,)
        for cache in (self.key, self.value):
            blocks = cache.view(cache.shape[0], self.num_blocks + 1, -1)  # (L, blocks, block_size * Hkv * D)
            blocks.index_copy_(1, dst, blocks.index_select(1, src))


def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def free_device_memory(device: torch.device) -> int:
    """Free bytes on the model's device: CUDA's free memory, or the host's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def plan_num_blocks(config: EngineConfig, *, block_bytes: int, max_model_len: int, device: torch.device) -> int:
    """``config.num_blocks`` if given; else ``max_memory_fraction`` of free memory, the scratch block included,
    capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens could ever use (no point reserving more)."""
    if config.num_blocks is not None:
        return config.num_blocks
    by_memory = int(free_device_memory(device) * config.max_memory_fraction) // block_bytes - 1
    useful = config.max_num_seqs * math.ceil(max_model_len / config.block_size)
    num_blocks = min(by_memory, useful)
    if num_blocks < 1:
        raise ValueError(
            f"max_memory_fraction={config.max_memory_fraction} of free memory holds no KV-cache block "
            f"beside the scratch block ({block_bytes} bytes each): raise it or set num_blocks"
        )
    return num_blocks
