"""Measurement helpers of the benchmarks: environment record, forward counting, memory, and the wasted-compute share
(the synchronised ``clock`` lives in :mod:`cbverify.engines`, whose adapters time their own windows).

Definitions (the same for every engine, so ratios between engines mean something):

- *forward tokens*: token positions fed through the model, summed over forward calls (``input_ids.numel()``: a
  left-padded ``(B, T)`` batch counts ``B * T``; a packed ``(1, T)`` batch counts ``T``). Counted by a forward
  pre-hook on the top-level model, so the engines need no instrumentation of their own. CUDA-graph replays bypass
  hooks: on CUDA a graph-replaying engine reports fewer steps than it ran (marked in the report).
- *necessary tokens*: every distinct prompt once plus every completion token but the last (which is sampled and
  never fed back). ``wasted share = 1 - necessary / forward tokens``: padding, rows that already finished,
  re-prefilling an identical prompt N times, recompute after preemption.
- *engine overhead per step*: ``(wall - time inside model forward) / steps``: scheduling, sampling, bookkeeping.
"""

from __future__ import annotations

import os
import platform
import resource
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cbverify.engines import clock, sync  # noqa: F401  (re-exported: the adapters clock their own windows)
from reference.spec import RolloutRequest


def environment(device: str) -> dict:
    """Versions and hardware: stamped into every output file."""
    import psutil
    import transformers
    import trl

    import cbverify

    env = {
        "cbverify": cbverify.__version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__, "platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "device": device,
    }  # fmt: skip
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        env |= {"gpu": props.name, "gpu_memory_gb": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda}
    return env


@dataclass(slots=True)
class ForwardStats:
    steps: int = 0
    forward_tokens: int = 0
    forward_s: float = 0.0
    first_forward_end: float | None = None
    logit_rows: int = 0  # positions the model returned logits for: the tokens an engine can have sampled so far


@contextmanager
def count_forwards(model: torch.nn.Module, device: str, *, time_forwards: bool, stats: ForwardStats | None = None):
    """Count forward calls and token positions of ``model`` (hooks removed on exit, also on error).

    With ``time_forwards`` the time inside each forward is summed (synchronising CUDA around it, which removes any
    CPU/GPU overlap an engine relies on; on CPU it costs nothing). Counts add to ``stats`` when given (one record over
    several windows: an adapter's ``window_hook`` is entered once per window), else to a fresh one; yields it.
    """
    stats, started = stats if stats is not None else ForwardStats(), [0.0]

    def pre(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"][..., 0]
        stats.steps += 1
        stats.forward_tokens += int(ids.numel())
        if time_forwards:
            started[0] = clock(device)

    def post(module, args, kwargs, output):
        logits = getattr(output, "logits", None)  # shapes only: no device sync
        if logits is not None and logits.dim() >= 2:
            stats.logit_rows += logits.numel() // max(1, logits.shape[-1])
        if time_forwards:
            end = clock(device)
            stats.forward_s += end - started[0]
            if stats.first_forward_end is None:
                stats.first_forward_end = end

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
               model.register_forward_hook(post, with_kwargs=True)]  # fmt: skip
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()


def necessary_tokens(requests: Sequence[RolloutRequest], completion_lengths: Sequence[int]) -> int:
    """Distinct prompts once + each completion token but the last (see module docstring)."""
    unique_prompts = sum(len(p) for p in {r.prompt_ids for r in requests})
    return unique_prompts + sum(max(0, n - 1) for n in completion_lengths)


def wasted_share(necessary: int, forward_tokens: int) -> float | None:
    """``1 - necessary / forward_tokens``; negative when an engine computes less than the naive need (it cannot) is
    reported as is, so a counting bug shows instead of hiding. ``None`` when nothing was counted (graph replays)."""
    return None if forward_tokens == 0 else 1.0 - necessary / forward_tokens


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    """This process's lifetime peak RSS (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak(device: str) -> float:
    """Reset the CUDA peak counter; returns the bytes allocated now (the baseline), 0 on CPU."""
    if device.startswith("cuda"):
        sync(device)
        torch.cuda.reset_peak_memory_stats(torch.device(device))
        return float(torch.cuda.memory_allocated(torch.device(device)))
    return 0.0


def peak_memory(device: str, baseline_bytes: float, base_rss_mb: float) -> dict:
    """CUDA: ``max_memory_allocated`` (total and above the pre-run baseline); CPU: lifetime peak RSS and its excess
    over the RSS just before the run (0 when an earlier phase of the process peaked higher)."""
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated(torch.device(device))
        return {"peak_memory_mb": peak / 2**20, "peak_memory_delta_mb": (peak - baseline_bytes) / 2**20,
                "memory_kind": "cuda max_memory_allocated"}  # fmt: skip
    peak = peak_rss_mb()
    return {"peak_memory_mb": peak, "peak_memory_delta_mb": max(0.0, peak - base_rss_mb), "memory_kind": "peak RSS"}


def pool_groups(rows: Sequence[dict], key: Callable[[dict], tuple], pool: Callable[[list[dict]], dict]) -> list[dict]:
    """Rows grouped by ``key`` (first-seen order), one result per group: its first row with an ``error`` if any
    (an error in any round is the case's result), else ``pool(group)``."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return [next((r for r in group if "error" in r), None) or pool(group) for group in groups.values()]
