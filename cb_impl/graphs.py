"""Decode steps replayed from graphs: one launch for the model's forward instead of a few kernels per layer.

A graph replays the kernels it recorded on the tensors it recorded, so every input has one static tensor per shape.
A decode-only step is padded to a bucket: its sequences to :func:`batch_bucket`, its key length to
:func:`length_bucket` (the model runner pads, ``model_runner``); the bucket's static inputs receive the step's values
(``copy_``) and its graph is replayed. Padding rows write their keys and values into a scratch block that no sequence
owns and attend only to it; their logits are dropped. The graph of a bucket is recorded the first time a step needs
it, into one memory pool shared by every bucket (only one replays at a time).

Invariant: a replay computes what the eager forward computes on the same inputs. A graph reads the weights, buffers
and KV cache at the addresses it recorded: updated in place (an optimizer step), they are seen; moved or reallocated
(``release_cache``, a re-cast model, a sharded optimizer gathering parameters anew), every graph is dropped and
recorded again (``Graphs.run`` compares the addresses before each replay).

On CUDA the recorder is :class:`CudaGraph`. Anywhere else it is :class:`ReplayedForward`, which "replays" by running
the recorded forward again on the same static tensors into the same output tensor. That has a graph's semantics:
the inputs are read from the static tensors, the output is written in place. So the CPU tests exercise the padding,
the static inputs and the invalidation, and the only code they do not run is the CUDA capture itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace

import torch

# the forward a graph records: input ids (1, B), positions (1, B), the attention metadata -> logits (B, V)
Forward = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]


def batch_bucket(num_seqs: int) -> int:
    """Sequences a decode step is padded to: a power of two up to 32, then a multiple of 32 (at most 31 rows of
    padding, a bounded number of graphs)."""
    return 1 << (num_seqs - 1).bit_length() if num_seqs <= 32 else -(-num_seqs // 32) * 32


def length_bucket(length: int, limit: int) -> int:
    """Keys a decode step attends over, padded: four buckets an octave (less than a quarter of ``length`` added), at
    least 16, never past ``limit`` (the width of the step's slot grid)."""
    step = 1 << max(2, (length - 1).bit_length() - 3)
    return min(max(16, -(-length // step) * step), limit)


def _tensors(obj: object) -> list[torch.Tensor]:
    """Every tensor of a step's inputs, in a fixed order (dataclasses field by field, tuples item by item)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if is_dataclass(obj):
        return [t for f in fields(obj) for t in _tensors(getattr(obj, f.name))]
    if isinstance(obj, tuple | list):
        return [t for item in obj for t in _tensors(item)]
    return []


def _cloned(obj: object) -> object:
    """The same structure with every tensor cloned: a bucket's static inputs."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if is_dataclass(obj):
        return replace(obj, **{f.name: _cloned(getattr(obj, f.name)) for f in fields(obj)})
    if isinstance(obj, tuple | list):
        return type(obj)(_cloned(item) for item in obj)
    return obj


class ReplayedForward:
    """A graph's semantics without a device graph: ``replay`` runs the forward again on the static inputs and writes
    the logits into the tensor returned at recording."""

    def __init__(self, forward: Forward, inputs: tuple, pool: object) -> None:
        self._run = lambda: forward(*inputs)
        self.output = self._run()
        self.pool = pool

    def replay(self) -> None:
        self.output.copy_(self._run())


class CudaGraph:
    """``torch.cuda.CUDAGraph`` of the forward: warmed up on a side stream (its cache writes are the step's own),
    then recorded into ``pool`` (``None``: a new one, kept in ``self.pool`` for the next bucket)."""

    def __init__(self, forward: Forward, inputs: tuple, pool: object) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = forward(*inputs)
        self.pool = self.graph.pool() if pool is None else pool

    def replay(self) -> None:
        self.graph.replay()


class Graphs:
    """One recorded forward per (batch, key length) bucket, and the static inputs it reads.

    ``watched`` returns the tensors whose addresses the graphs bake in besides the inputs (the model's parameters
    and buffers, the KV cache); when one moved, every graph is dropped. A recording that fails (a model whose
    forward reads a device value back cannot be captured) turns the graphs off for this engine with a warning; the
    step then runs eagerly, as every later one does."""

    def __init__(self, forward: Forward, watched: Callable[[], list[torch.Tensor]], recorder: type) -> None:
        self.forward, self.watched, self.recorder = forward, watched, recorder
        self.graphs: dict[tuple[int, ...], tuple[object, tuple]] = {}
        self.pool: object = None
        self.addresses: tuple[int, ...] = ()
        self.disabled: str | None = None
        self.num_recorded = self.num_replays = 0

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: object) -> torch.Tensor:
        """The forward's logits (B, V) for a padded decode step, from its bucket's graph."""
        if self.disabled is not None:
            return self.forward(input_ids, positions, meta)
        addresses = tuple(t.data_ptr() for t in self.watched())
        if addresses != self.addresses:
            self.clear()
            self.addresses = addresses
        step = (input_ids, positions, meta)
        fresh = _tensors(step)
        key = tuple(s for t in fresh for s in (*t.shape, t.dtype.itemsize))
        if key not in self.graphs:
            inputs = _cloned(step)
            try:
                graph = self.recorder(self.forward, inputs, self.pool)
            except Exception as err:  # noqa: BLE001 - any capture failure: said, and this engine runs eagerly
                self.disabled = f"{type(err).__name__}: {err}"
                self.clear()
                reason = f"the forward could not be recorded ({self.disabled})"
                warnings.warn(f"cb_impl: decode graphs turned off, {reason}", RuntimeWarning, stacklevel=2)
                return self.forward(input_ids, positions, meta)
            self.pool = graph.pool
            self.graphs[key] = (graph, inputs)
            self.num_recorded += 1
        graph, inputs = self.graphs[key]
        for static, value in zip(_tensors(inputs), fresh, strict=True):
            static.copy_(value)
        graph.replay()
        self.num_replays += 1
        return graph.output
