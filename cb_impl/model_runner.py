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
from cb_impl.block_manager import blocks_for
from cb_impl.config import EngineConfig
from cb_impl.graphs import CudaGraph, Graphs, ReplayedForward, batch_bucket, length_bucket
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
        self.cuda_graphs = config.cuda_graphs
        self.graphs: Graphs | None = None
        self.set_tuning(tuning_for(self.device))
        self.attention._targets(model)  # a model that refuses a custom attention fails here, not at the first step
        self._depth = self.num_pairs = self.num_padded_pairs = 0
        # the last step if it decoded only: (padded, chunks, starts, grid, l_max, all_full)
        self._decodes: tuple | None = None

    def set_tuning(self, tuning: DeviceTuning) -> None:
        """How the step's work is split (``cb_impl.tuning``): the device's own, or another's to test it here. With
        ``graph_decodes``, decode steps are padded to buckets and replayed from graphs (``cb_impl.graphs``): CUDA
        graphs on a CUDA device (unless ``EngineConfig.cuda_graphs`` is off), their eager stand-in elsewhere."""
        self.tuning = tuning
        self.attention.gather_budget, self.attention.sdpa_backends = tuning.gather_budget, tuning.sdpa_backends
        on_cuda = self.device.type == "cuda"
        if tuning.graph_decodes and (self.cuda_graphs or not on_cuda):
            recorder = CudaGraph if on_cuda else ReplayedForward
            self.graphs = Graphs(self._forward, self._graph_reads, recorder)
        else:
            self.graphs = None
        self._decodes = None

    def _graph_reads(self) -> list[torch.Tensor]:
        """What a recorded forward reads besides its inputs: weights, buffers and the KV cache."""
        return [*self.model.parameters(), *self.model.buffers(), self.cache.key, self.cache.value]

    def release(self) -> None:
        """Hand the KV cache's pages back (``PagedKVCache.release``) and the graphs recorded on them."""
        self.cache.release()
        if self.graphs is not None:
            self.graphs.clear()

    @contextmanager
    def attached(self) -> Iterator[None]:
        """Reentrant: the outermost use switches the model's attention to the paged one and restores it after."""
        with nullcontext() if self._depth else self.attention.attached(self.model):
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1

    def _metadata(self, batch: ScheduledBatch,
                  padded: bool) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, torch.Tensor]:  # fmt: skip
        """Input ids (1, T), positions (1, T), the attention metadata and each chunk's last packed row (C,). A step
        that decodes the same chunks as the last step, itself decodes only, with no block table changed in between
        advances that step's tensors one position instead of rebuilding them from the sequences. ``padded`` (a
        decode-only step, ``cb_impl.graphs``): rows past the chunks pad the batch to its bucket, each at position 0 of
        the cache's scratch block, and the slot grid is as wide as the furthest position any of the chunks reaches."""
        bs, dev, chunks = self.block_size, self.device, batch.chunks
        last, self._decodes = self._decodes, None
        if last is not None and last[0] == padded and not batch.tables_changed and chunks == last[1]:
            ids = array("q", [seq.token_ids[seq.num_computed_tokens] for seq, _ in chunks])  # each one token further
            starts = last[2] + 1
            if padded:
                starts[len(chunks) :] = 0  # padding rows stay at position 0 of the scratch block
            return self._decode_metadata(chunks, ids, starts, last[3], last[4] + 1, last[5], padded)
        ids, starts, lengths, tables = array("q"), array("q"), array("q"), array("q")
        width = max(len(seq.block_table) for seq, _ in chunks)
        if padded:
            width = max(width, max(blocks_for(s.num_prompt_tokens + s.max_new_tokens - 1, bs) for s, _ in chunks))
        pad = [self.cache.scratch_block] * width
        for seq, n in chunks:  # the one per-sequence loop: host arrays, turned into tensors below
            start, table = seq.num_computed_tokens, seq.block_table
            ids.extend(seq.token_ids[start : start + n])
            starts.append(start)
            lengths.append(n)
            tables.extend(table)
            tables.extend(pad[len(table) :])
        if padded:
            extra = batch_bucket(len(chunks)) - len(chunks)
            starts.extend([0] * extra)
            tables.extend(pad * extra)
        num_rows, num_tokens = len(starts), len(ids)
        starts_t, lengths_t = int64_tensor(starts, dev), int64_tensor(lengths, dev)  # (rows,), (C,)
        grid = slot_grid(int64_tensor(tables, dev).view(num_rows, width), bs)  # (rows, width * bs)
        if num_tokens == len(chunks):  # decodes only: one token per chunk
            return self._decode_metadata(chunks, ids, starts_t, grid, max(starts) + 1, min(starts) == max(starts),
                                         padded)  # fmt: skip
        num_chunks = len(chunks)
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
        padded_pairs = sum(int(g.q_index.numel()) * int(g.kv_slots.shape[1]) for g in groups)
        pairs = (lengths_t * (2 * starts_t + lengths_t + 1)).sum() // 2  # a device scalar: no sync for a statistic
        meta = StepMetadata(grid[chunk_of, positions], tuple(groups), pairs, padded_pairs)
        return int64_tensor(ids, dev)[None], positions[None], meta, offsets_t + lengths_t - 1

    def _decode_metadata(self, chunks: list, ids: array, starts: torch.Tensor, grid: torch.Tensor, l_max: int,
                         all_full: bool, padded: bool) -> tuple[torch.Tensor, torch.Tensor, StepMetadata,
                                                                torch.Tensor]:  # fmt: skip
        """Decodes only: row r is chunk r (or padding past them), its token at ``starts[r]``; ``l_max`` (the chunks'
        longest context) and ``all_full`` as in build_group. Padded, the keys are the bucket's
        (:func:`length_bucket`) and every row is masked."""
        num_rows = len(starts)
        ids.extend([0] * (num_rows - len(ids)))  # padding rows read token 0
        rows = torch.arange(num_rows, device=self.device)  # (rows,)
        keys = length_bucket(l_max, grid.shape[1]) if padded else l_max
        group = build_group(starts, torch.ones_like(starts), rows, grid, 1, keys, all_full and not padded, num_rows)
        pairs = (starts[: len(chunks)] if padded else starts) + 1  # the chunks' keys (a device value: no sync)
        meta = StepMetadata(grid[rows, starts], (group,), pairs.sum(), num_rows * keys)
        self._decodes = (padded, chunks, starts, grid, l_max, all_full)
        return int64_tensor(ids, self.device)[None], starts[None], meta, rows

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """One forward over the batch; returns float logits (R, V), row r for ``batch.samples[r]`` (R = 0 for a step
        of partial prefills only). A decode-only step runs from its bucket's graph when the tuning says so."""
        self.cache.copy_blocks(batch.copies)
        in_order = not batch.num_partial_prefills and len(batch.samples) == len(batch.chunks)  # chunk c samples row c
        padded = self.graphs is not None and in_order and batch.num_tokens == len(batch.chunks)
        input_ids, position_ids, meta, last_rows = self._metadata(batch, padded)  # last_rows (C,)
        check_batch(batch, meta)
        self.num_pairs += meta.num_pairs
        self.num_padded_pairs += meta.num_padded_pairs
        if padded:
            with self.attached():
                return self.graphs.run(input_ids, position_ids, meta)[: len(batch.chunks)]  # (C, V)
        rows = None  # each chunk samples once, in order: the kept logits are the rows
        if not batch.samples:  # partial prefills only: keys and values are written, one row of logits is dropped
            last_rows, rows = last_rows[-1:], last_rows[:0]
        elif not in_order:
            kept, inverse = [], []  # the chunks that sample (U,) and each sample's row among them (R,), on the host
            for chunk in batch.sample_chunks:  # non-decreasing
                if not kept or kept[-1] != chunk:
                    kept.append(chunk)
                inverse.append(len(kept) - 1)
            last_rows, rows = last_rows[int64_tensor(kept, self.device)], int64_tensor(inverse, self.device)
        with self.attached():
            logits = self._forward(input_ids, position_ids, meta, last_rows)  # (U, V)
        return logits if rows is None else logits[rows]  # (R, V)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: StepMetadata,
                 keep: torch.Tensor | int = 0) -> torch.Tensor:  # fmt: skip
        """The model on one step's inputs: logits (rows kept, V); ``keep`` = 0 keeps every row."""
        self.attention.metadata = meta
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep)
        finally:
            self.attention.metadata = None
        return out.logits[0]
