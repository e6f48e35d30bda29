"""Packs one step's prefill chunks and decode tokens into a single forward of an unmodified Hugging Face decoder.

Oracle: the logits of row ``r`` equal the model's logits at the last token of sample ``r``'s chunk when the model
is run on that sequence alone (``reference.generate`` does exactly that, without a cache).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from cb_impl.attention import PagedAttention, StepMetadata, build_group
from cb_impl.config import EngineConfig
from cb_impl.kv_cache import PagedKVCache, bytes_per_block, plan_num_blocks
from cb_impl.scheduler import ScheduledBatch
from cb_impl.support import CONTEXT_FIELDS, context_length


class ModelRunner:
    """Owns the KV cache and the attention registration for one model; ``run(batch)`` returns sampling logits."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        cfg = model.config
        self.model = model
        self.block_size = config.block_size
        self.num_layers = int(cfg.num_hidden_layers)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        num_heads = int(cfg.num_attention_heads)
        num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
        self.max_model_len = int(config.max_model_len or context_length(cfg))
        if self.max_model_len < 1:
            raise ValueError(f"the model config has none of {', '.join(CONTEXT_FIELDS)}: set max_model_len")
        param = next(model.parameters())
        self.device, dtype = param.device, param.dtype
        block_bytes = bytes_per_block(num_layers=self.num_layers, block_size=config.block_size,
                                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)  # fmt: skip
        num_blocks = plan_num_blocks(config, block_bytes=block_bytes, max_model_len=self.max_model_len,
                                     device=self.device)  # fmt: skip
        self.cache = PagedKVCache(num_layers=self.num_layers, num_blocks=num_blocks, block_size=config.block_size,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                                  device=self.device)  # fmt: skip
        self.attention = PagedAttention(self.cache, torch.float64 if config.float64_attention else None)
        self.attention._targets(model)  # a model that refuses a custom attention fails here, not at the first step
        self._depth = 0
        self.num_pairs = 0
        self.num_padded_pairs = 0

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @contextmanager
    def attached(self) -> Iterator[None]:
        """Reentrant: the outermost use switches the model's attention to the paged one and restores it after."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        with self.attention.attached(self.model):
            self._depth = 1
            try:
                yield
            finally:
                self._depth = 0

    def _metadata(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, list[int]]:
        bs, dev = self.block_size, self.device
        input_ids: list[int] = []
        starts, lengths, offsets = [], [], []
        for seq, n in batch.chunks:
            start = seq.num_computed_tokens
            offsets.append(len(input_ids))
            input_ids.extend(seq.token_ids[start : start + n])
            starts.append(start)
            lengths.append(n)
        width = max(len(seq.block_table) for seq, _ in batch.chunks)
        tables = torch.tensor(
            [s.block_table + [0] * (width - len(s.block_table)) for s, _ in batch.chunks],
            dtype=torch.int64,
            device=dev,
        )  # (C, W) fmt: skip
        starts_t, lengths_t, offsets_t = torch.tensor([starts, lengths, offsets], dtype=torch.int64, device=dev)
        chunk_of = torch.repeat_interleave(torch.arange(len(starts), device=dev), lengths_t)  # (T,)
        positions = starts_t[chunk_of] + torch.arange(len(input_ids), device=dev) - offsets_t[chunk_of]  # (T,)
        slot_mapping = tables[chunk_of, positions // bs] * bs + positions % bs  # (T,)
        groups = []
        for members in ([c for c, n in enumerate(lengths) if n == 1], [c for c, n in enumerate(lengths) if n > 1]):
            if members:
                sub = tables[members]  # (S, W)
                slots_of = lambda rows, pos, sub=sub: sub[rows, pos // bs] * bs + pos % bs  # noqa: E731
                groups.append(build_group([starts[c] for c in members], [lengths[c] for c in members],
                                          [offsets[c] for c in members], slots_of, dev))  # fmt: skip
        num_pairs = sum(n * s + n * (n + 1) // 2 for s, n in zip(starts, lengths, strict=True))
        padded = sum(int(g.q_index.numel()) * int(g.kv_slots.shape[1]) for g in groups)
        meta = StepMetadata(slot_mapping, tuple(groups), num_pairs, padded)
        ids = torch.tensor([input_ids], dtype=torch.int64, device=dev)  # (1, T)
        return ids, positions[None], meta, offsets

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """One forward over the batch; returns float logits (R, V), row r for ``batch.samples[r]``."""
        if not batch.chunks:
            return torch.empty(0, self.vocab_size, device=self.device)
        self.cache.copy_blocks(batch.copies)
        input_ids, position_ids, meta, offsets = self._metadata(batch)
        chunk_rows: dict[int, int] = {}
        keep: list[int] = []
        for _, c in batch.samples:
            if c not in chunk_rows:
                chunk_rows[c] = len(keep)
                keep.append(offsets[c] + batch.chunks[c][1] - 1)
        self.num_pairs += meta.num_pairs
        self.num_padded_pairs += meta.num_padded_pairs
        with self.attached():
            self.attention.metadata = meta
            try:
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                 logits_to_keep=torch.tensor(keep, dtype=torch.int64, device=self.device))  # fmt: skip
            finally:
                self.attention.metadata = None
        logits = out.logits[0]  # (U, V)
        rows = torch.tensor([chunk_rows[c] for _, c in batch.samples], dtype=torch.int64, device=self.device)
        return logits[rows]  # (R, V)
