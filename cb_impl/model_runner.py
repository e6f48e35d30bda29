"""Packs one step's prefill chunks and decode tokens into a single forward of an unmodified Hugging Face decoder.

Oracle: the logits of row ``r`` equal the model's logits at the last token of sample ``r``'s chunk when the model
is run on that sequence alone (``reference.generate`` does exactly that, without a cache).

Invariant, checked before every forward (:func:`check_batch`): nothing empty reaches the model. Every chunk has at
least one token, every attention group at least one sequence and one query, and logits are asked for at least one
row. A step that only advances partial prefills samples nothing: its forward writes their keys and values and keeps
the logits of one row, which ``run`` drops, and the engine does not call the sampler.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from cb_impl.attention import PagedAttention, StepMetadata, build_group, slot_grid
from cb_impl.config import EngineConfig
from cb_impl.kv_cache import PagedKVCache, bytes_per_block, plan_num_blocks
from cb_impl.scheduler import ScheduledBatch
from cb_impl.support import CONTEXT_FIELDS, context_length
from cb_impl.tuning import DeviceTuning, tuning_for


def int64_tensor(values: Iterable[int], device: torch.device) -> torch.Tensor:
    """A host list of ints -> int64 tensor on ``device``, through a buffer (several times faster than torch.tensor)."""
    buf = array("q", (0, *values))  # a leading 0, sliced off: frombuffer refuses an empty buffer
    return torch.frombuffer(buf, dtype=torch.int64)[1:].to(device)


def check_batch(batch: ScheduledBatch, meta: StepMetadata) -> None:
    """Raise ``RuntimeError`` if any part of the step is empty (the module's invariant): a scheduler or runner bug
    that some models forgive (an empty reshape) and others, or a GPU kernel, do not."""
    empty = [seq.request_id for seq, n in batch.chunks if n < 1]
    if empty or not batch.chunks:
        raise RuntimeError(f"a step scheduled no token for {empty or 'any sequence'}")
    for g in meta.groups:
        if 0 in g.q_index.shape or 0 in g.kv_slots.shape:
            raise RuntimeError(f"an empty attention group reached the forward: queries {tuple(g.q_index.shape)}, "
                               f"keys {tuple(g.kv_slots.shape)}")  # fmt: skip


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
        self.set_tuning(tuning_for(self.device))
        self.attention._targets(model)  # a model that refuses a custom attention fails here, not at the first step
        self._depth = self.num_pairs = self.num_padded_pairs = 0
        self._decodes: tuple | None = None  # the last step if it decoded only: (chunks, starts, grid, l_max, all_full)

    def set_tuning(self, tuning: DeviceTuning) -> None:
        """How the step's work is split (``cb_impl.tuning``): the device's own, or another's to test it here."""
        self.tuning = tuning
        self.attention.gather_budget, self.attention.sdpa_backends = tuning.gather_budget, tuning.sdpa_backends

    @contextmanager
    def attached(self) -> Iterator[None]:
        """Reentrant: the outermost use switches the model's attention to the paged one and restores it after."""
        with nullcontext() if self._depth else self.attention.attached(self.model):
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1

    def _metadata(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, torch.Tensor]:
        """Input ids (1, T), positions (1, T), the attention metadata and each chunk's last packed row (C,). A step
        that decodes the same chunks as the last step, itself decodes only, with no block table changed in between
        advances that step's tensors one position instead of rebuilding them from the sequences."""
        bs, dev, chunks = self.block_size, self.device, batch.chunks
        last, self._decodes = self._decodes, None
        if last is not None and not batch.tables_changed and chunks == last[0]:  # each one token further, same blocks
            ids = array("q", [seq.token_ids[seq.num_computed_tokens] for seq, _ in chunks])
            return self._decode_metadata(chunks, ids, last[1] + 1, last[2], last[3] + 1, last[4])
        ids, starts, lengths, tables = array("q"), array("q"), array("q"), array("q")
        pad = [0] * max(len(seq.block_table) for seq, _ in chunks)
        for seq, n in chunks:  # the one per-sequence loop: host arrays, turned into tensors below
            start, table = seq.num_computed_tokens, seq.block_table
            ids.extend(seq.token_ids[start : start + n])
            starts.append(start)
            lengths.append(n)
            tables.extend(table)
            tables.extend(pad[len(table) :])
        num_chunks, num_tokens = len(starts), len(ids)
        starts_t, lengths_t = int64_tensor(starts, dev), int64_tensor(lengths, dev)  # (C,)
        grid = slot_grid(int64_tensor(tables, dev).view(num_chunks, len(pad)), bs)  # (C, W * bs)
        if num_tokens == num_chunks:  # decodes only: one token per chunk
            return self._decode_metadata(chunks, ids, starts_t, grid, max(starts) + 1, min(starts) == max(starts))
        offsets_t = lengths_t.cumsum(0) - lengths_t  # (C,)
        chunk_of = torch.repeat_interleave(torch.arange(num_chunks, device=dev), lengths_t, output_size=num_tokens)
        positions = starts_t[chunk_of] + torch.arange(num_tokens, device=dev) - offsets_t[chunk_of]  # (T,)
        groups = []
        for members in ([c for c, n in enumerate(lengths) if n == 1], [c for c, n in enumerate(lengths) if n > 1]):
            if not members:
                continue
            ends = [starts[c] + lengths[c] for c in members]
            q_max, l_max = max(lengths[c] for c in members), max(ends)
            sel = slice(None) if len(members) == num_chunks else int64_tensor(members, dev)
            groups.append(build_group(starts_t[sel], lengths_t[sel], offsets_t[sel], grid[sel], q_max, l_max,
                                      min(ends) == l_max, sum(lengths[c] for c in members)))  # fmt: skip
        padded = sum(int(g.q_index.numel()) * int(g.kv_slots.shape[1]) for g in groups)
        pairs = (lengths_t * (2 * starts_t + lengths_t + 1)).sum() // 2  # a device scalar: no sync for a statistic
        meta = StepMetadata(grid[chunk_of, positions], tuple(groups), pairs, padded)
        return int64_tensor(ids, dev)[None], positions[None], meta, offsets_t + lengths_t - 1

    def _decode_metadata(self, chunks: list, ids: array, starts: torch.Tensor, grid: torch.Tensor, l_max: int,
                         all_full: bool) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, torch.Tensor]:  # fmt: skip
        """Decodes only: chunk c is row c, its token at ``starts[c]``; ``l_max`` / ``all_full`` as in build_group."""
        rows = torch.arange(len(chunks), device=self.device)  # (C,)
        group = build_group(starts, torch.ones_like(starts), rows, grid, 1, l_max, all_full, len(chunks))
        meta = StepMetadata(grid[rows, starts], (group,), (starts + 1).sum(), len(chunks) * l_max)
        self._decodes = (chunks, starts, grid, l_max, all_full)
        return int64_tensor(ids, self.device)[None], starts[None], meta, rows

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """One forward over the batch; returns float logits (R, V), row r for ``batch.samples[r]`` (R = 0 for a step
        of partial prefills only)."""
        self.cache.copy_blocks(batch.copies)
        input_ids, position_ids, meta, last_rows = self._metadata(batch)  # last_rows (C,)
        check_batch(batch, meta)
        rows = None  # each chunk samples once, in order: the kept logits are the rows
        if not batch.samples:  # partial prefills only: keys and values are written, one row of logits is dropped
            last_rows, rows = last_rows[-1:], last_rows[:0]
        elif batch.num_partial_prefills or len(batch.samples) != len(batch.chunks):
            kept, inverse = [], []  # the chunks that sample (U,) and each sample's row among them (R,), on the host
            for chunk in batch.sample_chunks:  # non-decreasing
                if not kept or kept[-1] != chunk:
                    kept.append(chunk)
                inverse.append(len(kept) - 1)
            last_rows, rows = last_rows[int64_tensor(kept, self.device)], int64_tensor(inverse, self.device)
        self.num_pairs += meta.num_pairs
        self.num_padded_pairs += meta.num_padded_pairs
        with self.attached():
            self.attention.metadata = meta
            try:
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                 logits_to_keep=last_rows)  # fmt: skip
            finally:
                self.attention.metadata = None
        logits = out.logits[0]  # (U, V)
        return logits if rows is None else logits[rows]  # (R, V)
