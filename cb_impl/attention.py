"""Paged attention routed through transformers' ``AttentionInterface``, so unmodified Hugging Face decoders run on
our KV cache.

One forward carries many sequences packed as ``input_ids`` (1, T): prefill chunks and decode tokens. Each layer's
attention call (1) writes the new keys/values into the paged cache at ``slot_mapping``, then (2) for each group of
sequences (decodes, then prefill chunks; padding is per group so decodes are never padded to a chunk's length)
gathers every sequence's keys/values from the cache into a padded (S, Hkv, L, D) tensor and runs causal SDPA. A
layer called with ``sliding_window=w`` masks keys more than ``w - 1`` positions behind the query (transformers'
``sliding_window_overlay``); a layer of a model that passes no ``sliding_window`` (Qwen2-MoE, PhiMoE) gets the window
its own mask carries (``support.mask_window``); one called with ``softcap`` (Gemma 2) or ``s_aux`` (gpt-oss sinks)
gets its scores computed explicitly (:func:`explicit_attention`). Features that reach attention any other way are
refused at construction by ``cb_impl.support``.

Oracle: equals the model's own attention (``eager``/``sdpa``) over each sequence's full prefix — checked end to end
against ``reference.generate`` by the exactness properties. Padding never reads an unwritten slot: padded key
columns point at the sequence's own position 0 and are masked out; padded query rows attend to that column only
and are discarded.

Because the implementation is not registered in ``AttentionMaskInterface``, transformers builds no mask at all: a
window that only the mask would carry is read from the config, as transformers' mask builder reads it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

from cb_impl.kv_cache import PagedKVCache
from cb_impl.support import UnsupportedModel, mask_window

NOT_ROUTED = "is not supported by cb_impl: its attention does not go through transformers' AttentionInterface"

GATHER_BUDGET = 1 << 18  # CPU: elements of gathered keys (and as many values) per SDPA call (``cb_impl.tuning``)


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences attended together; a padding query row reads the sequence's first query and has position 0."""

    q_index: torch.Tensor  # (S, Q) rows of the packed T
    valid_flat: torch.Tensor  # (N,) the real entries of the flattened (S * Q) grid
    dst_rows: torch.Tensor  # (N,) their packed rows
    kv_slots: torch.Tensor  # (S, L) cache slots
    mask: torch.Tensor | None  # (S, 1, Q, L) True = attend; None when no entry is masked
    q_pos: torch.Tensor  # (S, Q) query positions

    def window_mask(self, window: int) -> torch.Tensor:
        """(S, 1, Q, L): ``mask`` and key position > query position - ``window`` (padding rows keep column 0)."""
        k = torch.arange(self.kv_slots.shape[1], device=self.q_pos.device)  # (L,)
        inside = (k[None, None, :] > self.q_pos[:, :, None] - window)[:, None]  # (S, 1, Q, L)
        return inside if self.mask is None else self.mask & inside


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """Everything the attention needs for one forward, built once per step by the model runner."""

    slot_mapping: torch.Tensor  # (T,)
    groups: tuple[AttentionGroup, ...]
    num_pairs: torch.Tensor  # () query-key pairs actually needed
    num_padded_pairs: int  # query-key pairs computed (padding included)


def slot_grid(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block tables (S, W) -> each position's cache slot (S, W * block_size): position ``p`` of sequence ``s`` lives
    in slot ``grid[s, p]``."""
    offsets = torch.arange(block_size, device=tables.device)  # (bs,)
    return (tables[:, :, None] * block_size + offsets).flatten(1)


def build_group(starts: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor, grid: torch.Tensor, q_max: int,
                l_max: int, all_full: bool, num_queries: int) -> AttentionGroup:  # fmt: skip
    """Attention group for S sequences whose chunks begin at position ``starts`` (S,), have ``lengths`` new tokens, sit
    at row ``offsets`` of the packed batch and keep position ``p`` in slot ``grid[s, p]`` (:func:`slot_grid`); host
    ``q_max = max(lengths)``, ``l_max = max(starts + lengths)`` (at most the grid's width), ``all_full`` (every
    sequence ends at ``l_max``) and ``num_queries = sum(lengths)``. Device work only: nothing is read back."""
    device = starts.device
    k = torch.arange(l_max, device=device)  # (L,)
    k_valid = k[None, :] < (starts + lengths)[:, None]  # (S, L)
    slots = grid[:, :l_max]  # (S, L)
    kv_slots = torch.where(k_valid, slots, slots[:, :1])  # (S, L) padding -> the sequence's own position 0
    if q_max == 1:  # one query per sequence, at position start: it sees exactly the valid keys
        mask = None if all_full else k_valid[:, None, None, :]  # (S, 1, 1, L)
        return AttentionGroup(offsets[:, None], torch.arange(len(starts), device=device), offsets, kv_slots, mask,
                              starts[:, None])  # fmt: skip
    q = torch.arange(q_max, device=device)  # (Q,)
    q_valid = q[None, :] < lengths[:, None]  # (S, Q)
    q_index = offsets[:, None] + torch.where(q_valid, q[None, :], 0)  # (S, Q)
    seq_of = torch.repeat_interleave(torch.arange(len(starts), device=device), lengths, output_size=num_queries)
    first = (lengths.cumsum(0) - lengths)[seq_of]  # (N,) the packed index of each query's sequence's first query
    valid_flat = seq_of * q_max + torch.arange(num_queries, device=device) - first  # (N,) no host sync: N is known
    q_pos = torch.where(q_valid, starts[:, None] + q[None, :], 0)  # (S, Q)
    mask = (k[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]  # (S, Q, L)
    mask |= (~q_valid)[:, :, None] & (k == 0)[None, None, :]  # padded query rows see column 0 only
    return AttentionGroup(q_index, valid_flat, q_index.flatten()[valid_flat], kv_slots, mask[:, None], q_pos)


def explicit_attention(
    q: torch.Tensor,  # (s, Hq, Q, D)
    k: torch.Tensor,  # (s, Hkv, L, D)
    v: torch.Tensor,  # (s, Hkv, L, D)
    mask: torch.Tensor | None,  # (s, 1, Q, L) True = attend
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # (Hq,)
) -> torch.Tensor:  # (s, Hq, Q, D)
    """Attention with explicit scores: ``softcap * tanh(scores / softcap)`` when soft-capped, and a per-head sink
    logit joining the softmax then dropped. Oracle: the model's ``eager_attention_forward`` (Gemma 2, gpt-oss)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (s, Hq, L, D), as transformers' repeat_kv
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # (s, Hq, L, D)
    scores = q @ k.transpose(-1, -2) * scale  # (s, Hq, Q, L)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (s, Hq, Q, 1)
        scores = torch.cat([scores, sink], dim=-1)  # (s, Hq, Q, L + 1)
    return scores.softmax(dim=-1)[..., : k.shape[2]] @ v


def folded_gqa_attention(
    q: torch.Tensor,  # (s, Hq, Q, D)
    k: torch.Tensor,  # (s, Hkv, L, D)
    v: torch.Tensor,  # (s, Hkv, L, D)
    mask: torch.Tensor | None,  # (s, 1, Q, L) True = attend
    scale: float | None,
) -> torch.Tensor:  # (s, Hq, Q, D)
    """SDPA with grouped queries folded into the query length: query head ``h`` reads key head ``h // G``
    (transformers' ``repeat_kv``), so the ``G`` heads of a group become ``G * Q`` query rows of one key head. No key
    or value is repeated, and kernels without ``enable_gqa`` (memory-efficient attention, which takes a mask) apply."""
    s, hq, q_len, d = q.shape
    g = hq // k.shape[1]
    folded = q.reshape(s, k.shape[1], g * q_len, d)  # (s, Hkv, G * Q, D): row g * Q + i is head kv * G + g, query i
    if mask is not None:
        mask = mask.expand(s, 1, q_len, mask.shape[-1]).repeat(1, 1, g, 1)  # (s, 1, G * Q, L)
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale).view(s, hq, q_len, d)


class PagedAttention:
    """The attention function registered under ``name``; reads the metadata of the step being run."""

    _ids = itertools.count()

    def __init__(self, cache: PagedKVCache, compute_dtype: torch.dtype | None = None) -> None:
        self.cache = cache
        self.compute_dtype = compute_dtype  # None: the query's dtype
        self.metadata: StepMetadata | None = None
        self.gather_budget: int | None = GATHER_BUDGET  # None: one call per group; tests lower it to slice more
        self.sdpa_backends: tuple[SDPBackend, ...] | None = None  # None: SDPA picks any kernel
        self._swap: tuple[torch.nn.Module, list] | None = None
        self.name = f"cb_impl_paged_{next(self._ids)}"
        AttentionInterface.register(self.name, self.__call__)

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs: object) -> tuple[torch.Tensor, None]:  # fmt: skip
        """The packed step's query (1, Hq, T, D), key and value (1, Hkv, T, D) -> attention output (1, T, Hq, D)."""
        meta = self.metadata
        if meta is None:
            raise RuntimeError(f"{self.name} called outside an engine step (model not attached to the engine)")
        if query.shape[0] != 1:
            raise RuntimeError(f"cb_impl packs all sequences into batch 1, got query batch {query.shape[0]}")
        layer, softcap, sinks = module.layer_idx, kwargs.get("softcap"), kwargs.get("s_aux")
        window = kwargs["sliding_window"] if "sliding_window" in kwargs else mask_window(module.config, layer)
        self.cache.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
        q = query[0].transpose(0, 1)  # (T, Hq, D)
        out = torch.empty_like(q)  # (T, Hq, D)
        k_cache, v_cache = self.cache.key[layer], self.cache.value[layer]  # (slots, Hkv, D)
        dtype = self.compute_dtype or q.dtype
        with nullcontext() if self.sdpa_backends is None else sdpa_kernel(list(self.sdpa_backends)):
            self._attend(q, out, k_cache, v_cache, meta.groups, dtype, window, scaling, softcap, sinks)
        return out[None], None  # (1, T, Hq, D)

    def _attend(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                groups: tuple[AttentionGroup, ...], dtype: torch.dtype, window: int | None, scaling: float | None,
                softcap: float | None, sinks: torch.Tensor | None) -> None:  # fmt: skip
        """Each group's attention into ``out`` (T, Hq, D), from the query (T, Hq, D) and one layer's cache."""
        for g in groups:
            (num_seqs, q_len), kv_len = g.q_index.shape, g.kv_slots.shape[1]
            in_order = q_len == 1 and num_seqs == q.shape[0]  # decodes only: row s is sequence s's query, in place
            og = out[:, None] if in_order else q.new_empty(num_seqs, q_len, *q.shape[1:])  # (S, Q, Hq, D)
            group_mask = g.mask if window is None else g.window_mask(int(window))  # (S, 1, Q, L)
            # sequences in slices whose gathered K/V stay small: cache-resident, and below malloc's mmap threshold
            # (a fresh mmap per layer costs page faults); rows of SDPA are independent, so slicing changes nothing
            # (a CPU tuning: on an accelerator ``gather_budget`` is None, one gather and one SDPA per group)
            gathered = kv_len * k_cache.shape[1] * k_cache.shape[2]
            step = num_seqs if self.gather_budget is None else max(1, self.gather_budget // gathered)
            for s0 in range(0, num_seqs, step):
                rows = slice(s0, s0 + step)
                slots = g.kv_slots[rows]  # (s, L)
                flat, shape = slots.reshape(-1), (*slots.shape, *k_cache.shape[1:])  # (s * L,), (s, L, Hkv, D)
                qg = (q[rows, None] if in_order else q[g.q_index[rows]]).transpose(1, 2).to(dtype)  # (s, Hq, Q, D)
                kg = k_cache.index_select(0, flat).view(shape).transpose(1, 2).to(dtype)  # (s, Hkv, L, D)
                vg = v_cache.index_select(0, flat).view(shape).transpose(1, 2).to(dtype)  # (s, Hkv, L, D)
                mask = None if group_mask is None else group_mask[rows]  # (s, 1, Q, L)
                if softcap is None and sinks is None and self.sdpa_backends is not None:
                    o = folded_gqa_attention(qg, kg, vg, mask, scaling)  # (s, Hq, Q, D)
                elif softcap is None and sinks is None:
                    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scaling, enable_gqa=True)
                else:
                    scale = scaling if scaling is not None else qg.shape[-1] ** -0.5
                    o = explicit_attention(qg, kg, vg, mask, scale, softcap, sinks)  # (s, Hq, Q, D)
                og[rows] = o.transpose(1, 2)  # (s, Q, Hq, D)
            if not in_order:
                out[g.dst_rows] = og.flatten(0, 1)[g.valid_flat]  # valid rows only

    def _targets(self, model: torch.nn.Module) -> list:
        """The config objects whose attention setting routes ``model``'s layers, found once by letting transformers
        validate and apply ``set_attn_implementation(self.name)`` (then undone); later switches only swap them."""
        if self._swap is None or self._swap[0] is not model:
            configs = {id(m.config): m.config for m in model.modules()
                       if hasattr(getattr(m, "config", None), "_attn_implementation_internal")}  # fmt: skip
            before = {k: c._attn_implementation_internal for k, c in configs.items()}
            try:
                model.set_attn_implementation(self.name)
            except ValueError as err:  # transformers refuses custom attention for this architecture
                raise UnsupportedModel(f"{type(model).__name__} {NOT_ROUTED} ({err})") from err
            changed = [c for k, c in configs.items() if c._attn_implementation_internal != before[k]]
            for c in changed:
                c._attn_implementation_internal = before[id(c)]
            if not changed:
                raise UnsupportedModel(f"{type(model).__name__} {NOT_ROUTED}")
            self._swap = (model, changed)
        return self._swap[1]

    @contextmanager
    def attached(self, model: torch.nn.Module) -> Iterator[None]:
        """Route ``model``'s attention here (eval mode, no grad, autocast off: the engine computes in the model's
        own dtype); restore its attention setting and training mode afterwards, also when the body raises."""
        targets = self._targets(model)
        originals = [c._attn_implementation_internal for c in targets]
        was_training = model.training
        try:
            for c in targets:
                c._attn_implementation_internal = self.name
            model.eval()
            device_type = next(model.parameters()).device.type
            with torch.no_grad(), torch.autocast(device_type, enabled=False):
                yield
        finally:
            for c, original in zip(targets, originals, strict=True):
                c._attn_implementation_internal = original
            model.train(was_training)
            self.metadata = None
