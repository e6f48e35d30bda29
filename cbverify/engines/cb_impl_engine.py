"""Our continuous-batching engine (``cb_impl.engine.LLMEngine``) behind the Engine protocol.

It claims everything the spec asks for: counter-based (spec) sampling, per-request parameters, processed log-probs,
and batch invariance of tokens (the noise is a function of seed and position, not of the batch). Options are the
fields of ``cb_impl.config.EngineConfig`` (``block_size``, ``num_blocks``, ``max_batch_tokens``, ``max_num_seqs``,
``enable_prefix_sharing``, ...); on CPU pass a small ``num_blocks`` (the default sizes the cache from free memory).
``window_hook`` (see :mod:`cbverify.engines`) is the one adapter option that is not an ``EngineConfig`` field.
``capabilities.sizing`` declares the four that size its memory and steps (``block_size``, ``num_blocks``,
``max_batch_tokens``, ``max_num_seqs``), each down to 1, so the conformance suite runs it with chunked prefills and
preemption.
A model the engine refuses at construction (``cb_impl.support.UnsupportedModel``: a feature it does not implement)
raises :class:`NotApplicable` with the engine's reason.

Cost (``last_run``, :class:`cbverify.engines.RunStats`): the window is the whole call; TTFT is the end of the
engine's first step (``step`` is wrapped on the instance for the call); KV is the engine's cache; ``extra["stats"]``
holds the engine's counters (``LLMEngine.stats``, cumulative since construction) plus ``kv_peak_used_bytes``;
``extra["mechanisms"]`` what its declared mechanisms did to each request of the call (``LLMEngine.last_events``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

from cbverify.engines import (
    Capabilities,
    EngineError,
    NotApplicable,
    RunStats,
    SizingOption,
    WindowHook,
    check_unique_ids,
    clock,
)
from reference.spec import Rollout, RolloutRequest

EVENT_MECHANISMS = {  # cb_impl.sequence.EVENTS -> cbverify.engines.MECHANISMS
    "shared_prefill": "prefix-sharing", "cow_2": "cow-2-sharers", "cow_3plus": "cow-3plus-sharers",
    "partial_prefill": "chunked-prefill", "preemption": "preemption",
}  # fmt: skip


class CbImplEngine:
    """Adapter over ``cb_impl.engine.LLMEngine``; ``stats`` exposes the engine's own counters after each call."""

    name = "cb_impl"
    capabilities = Capabilities(
        spec_sampling=True,
        per_request_max_new_tokens=True,
        per_request_sampling=True,
        per_request_eos=True,
        logprob_semantics="processed",
        claims_batch_invariance=True,
        follows_weight_updates=True,  # it runs the caller's model object
        # EngineConfig takes any int >= 1; the upper bounds are only how far the suite may draw (the largest block
        # a checkpoint's context could fill, and budgets far past any drawn workload)
        sizing=(
            SizingOption("block_size", "block_size", 1, 256),
            SizingOption("num_blocks", "kv_blocks", 1, 2**20),
            SizingOption("max_batch_tokens", "batch_tokens", 1, 2**16),
            SizingOption("max_num_seqs", "num_seqs", 1, 2**10),
        ),
        mechanisms=("prefix-sharing", "cow-2-sharers", "cow-3plus-sharers", "chunked-prefill", "preemption"),
    )

    def __init__(self, model, *, window_hook: WindowHook | None = None, **config) -> None:
        from cb_impl.config import EngineConfig
        from cb_impl.engine import LLMEngine
        from cb_impl.support import UnsupportedModel

        self.config = EngineConfig(**config)
        try:
            self.engine = LLMEngine(model, self.config)
        except UnsupportedModel as err:
            raise NotApplicable(self.name, str(err)) from err
        self.device = next(model.parameters()).device
        self.window_hook = window_hook or nullcontext
        self.last_run: RunStats | None = None

    @property
    def stats(self) -> dict:
        return dict(getattr(self.engine, "stats", {}))

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        check_unique_ids(self.name, requests)
        first_step_end: list[float] = []
        step = self.engine.step

        def timed_step():
            out = step()
            if not first_step_end:
                first_step_end.append(clock(self.device))
            return out

        self.engine.step = timed_step  # an instance attribute shadowing the method, removed below
        try:
            with self.window_hook():
                start = clock(self.device)
                rollouts = list(self.engine.generate(list(requests)))
                end = clock(self.device)
        finally:
            del self.engine.step
        if len(rollouts) != len(requests):
            raise EngineError(f"{self.name}: {len(rollouts)} rollouts for {len(requests)} requests")
        stats = {k: v for k, v in self.stats.items() if isinstance(v, int | float | str)}
        if stats.get("num_blocks"):
            stats["kv_peak_used_bytes"] = stats["kv_block_bytes"] * stats["peak_used_blocks"]
        touched = {rid: {EVENT_MECHANISMS[e]: n for e, n in events.items()}
                   for rid, events in self.engine.last_events.items()}  # fmt: skip
        self.last_run = RunStats(
            generate_s=end - start, ttft_s=first_step_end[0] - start if first_step_end else None,
            kv_reserved_bytes=stats.get("kv_cache_bytes"), extra={"stats": stats, "mechanisms": touched},
        )  # fmt: skip
        return rollouts
