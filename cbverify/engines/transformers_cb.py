"""transformers continuous batching (``generation/continuous_batching``, 5.8 to 5.24) through its manager.

What the adapter relies on (read in the 5.24 source; what older releases name differently is in
:mod:`cbverify.engines.transformers_compat`; ``continuous_api.py``, ``cb_logits_processors.py``,
``model_runner.py``, ``requests.py``):

- ``generate_batch`` takes one ``max_new_tokens`` for all prompts and *logs and swallows* exceptions, returning
  partial results; so the adapter drives the manager: ``init_continuous_batching`` / ``start`` / ``add_request``
  (per-request ``max_new_tokens``, ``eos_token_id`` and processor kwargs) / ``get_result`` / ``stop``.
- ``do_sample`` and min-p are global to a manager; temperature, top-k and top-p are per-request only with
  ``per_request_processors=True`` *and* a processor built at creation (temperature != 1, top-k != 0, top-p < 1 in
  the ``GenerationConfig``). So requests are grouped by ``(greedy, min_p)`` (one manager per group, first-appearance
  order), the sampling manager is built with placeholder values that force all three processors, and every request
  passes its own ``temperature``, ``top_k`` (0 -> vocab size: CB's top-k has no "disabled" value) and ``top_p``.
- Log-probs (``return_logprobs=True``): ``log(softmax(processed_scores)[token])`` in float32, i.e. *processed*
  semantics when sampling and ``log_softmax(logits)`` when greedy (no processors are built) — the spec's semantics.
- EOS: ``eos_token_id=[]`` means "no EOS"; an EOS is appended to ``generated_tokens`` (the ``Rollout`` convention).
- Randomness: ``torch.multinomial`` on torch's global RNG, which the manager itself reseeds (``torch.manual_seed``)
  from ``ContinuousBatchingConfig.seed``; the adapter passes its ``seed`` option (before 5.9, which has no such
  field, it seeds the global RNG itself) and restores the caller's RNG.

CPU sizing: small explicit ``page_size`` / ``num_blocks`` / ``max_batch_tokens`` (the defaults reserve GBs).
``num_blocks=None`` sizes the cache for the whole workload: sum over requests of ceil(len / page_size) + 1 -- unless
``max_memory_percent`` is given, in which case the library sizes it from that share of free memory. ``page_size`` /
``max_batch_tokens`` ``None``: the library's defaults. ``capabilities.sizing`` declares the three for the conformance
suite's draws: ``page_size`` from 4 (the manager refuses less: "page_size must be at least 4"), ``num_blocks`` and
``max_batch_tokens`` from 1.

Driving it as TRL 1.16 does (the benchmarks): ``max_memory_percent=0.5``, ``warmup`` (CUDA-graph capture before the
first request), ``return_logprobs=False`` (TRL does not read them; rollouts carry NaN and ``capabilities`` say
``logprob_semantics="none"``) and ``per_request_processors=False``: temperature / top-k / top-p then go into the
manager's ``GenerationConfig`` (top-k 0 -> ``None``) as TRL's single config does, so a group that differs in them is
refused with :class:`cbverify.engines.NotApplicable`. The defaults keep the per-request driving described above.

Cost (``last_run``, :class:`cbverify.engines.RunStats`): the window runs from the first ``add_request`` to the last
result (``record_timestamps=True`` gives TTFT); manager construction, ``warmup()``, ``start()`` and ``stop()`` (which
runs ``gc.collect``) are ``setup_s``; KV is the manager's ``cache_tensor``.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from transformers import GenerationConfig

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
from cbverify.engines import transformers_compat as compat
from reference.spec import Rollout, RolloutRequest

_PLACEHOLDER_TEMPERATURE = 0.5  # != 1.0, so the temperature processor exists; every request overrides it
_PLACEHOLDER_TOP_P = 0.999  # < 1.0, so the top-p processor exists; every request overrides it


class TransformersCBEngine:
    """transformers' CB manager: own RNG, processed log-probs, packed (unpadded) batches."""

    name = "transformers-cb"
    capabilities = Capabilities(
        spec_sampling=False,
        per_request_max_new_tokens=True,
        per_request_sampling=True,  # temperature / top-k / top-p per request; min-p by grouping
        per_request_eos=True,
        logprob_semantics="processed",
        claims_batch_invariance=False,  # packed varlen batches change reduction shapes; the RNG stream is shared
        follows_weight_updates=True,  # it runs the caller's model object
        sizing=(  # upper bounds: how far the suite may draw, not limits of the library
            SizingOption("page_size", "block_size", 4, 256),
            SizingOption("num_blocks", "kv_blocks", 1, 2**20),
            SizingOption("max_batch_tokens", "batch_tokens", 1, 2**16),
        ),
    )

    def __init__(
        self,
        model,
        *,
        seed: int = 0,
        page_size: int | None = 16,
        num_blocks: int | None = None,
        max_batch_tokens: int | None = 256,
        timeout_s: float = 600.0,
        return_logprobs: bool = True,
        max_memory_percent: float | None = None,
        warmup: bool = False,
        per_request_processors: bool = True,
        window_hook: WindowHook | None = None,
    ) -> None:
        if any(v is not None and v < 1 for v in (page_size, num_blocks, max_batch_tokens)):
            raise ValueError("page_size, max_batch_tokens and num_blocks must be >= 1 (or None)")
        if max_memory_percent is not None and not 0 < max_memory_percent <= 1:
            raise ValueError(f"max_memory_percent must be in (0, 1], got {max_memory_percent}")
        self.model = model
        self.seed = seed
        self.page_size = page_size
        self.num_blocks = num_blocks
        self.max_batch_tokens = max_batch_tokens
        self.timeout_s = timeout_s
        self.return_logprobs = return_logprobs
        self.max_memory_percent = max_memory_percent
        self.warmup = warmup
        self.per_request_processors = per_request_processors
        self.window_hook = window_hook or nullcontext
        if not return_logprobs:
            self.capabilities = dataclasses.replace(type(self).capabilities, logprob_semantics="none")
        self.vocab_size = model.config.get_text_config().vocab_size
        self.last_run: RunStats | None = None

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        check_unique_ids(self.name, requests)
        groups: dict[tuple[bool, float], list[RolloutRequest]] = {}
        for request in requests:
            s = request.sampling
            groups.setdefault((s.greedy, 0.0 if s.greedy else s.min_p), []).append(request)
        if not self.per_request_processors:
            for (greedy, _), group in groups.items():
                shared = {(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p) for r in group}
                if not greedy and len(shared) > 1:
                    why = f"per_request_processors=False needs one (temperature, top_k, top_p), got {sorted(shared)}"
                    raise NotApplicable(self.name, why)
        by_id: dict[str, Rollout] = {}
        stats = RunStats()
        # The manager calls gc.collect() twice per stop: ~0.3 s each in a process holding a big heap (pytest, an
        # interpreter with a model loaded). Freezing the existing heap for the call makes those collections scan
        # only the manager's own objects; unfreeze() hands the heap back to the collector afterwards.
        gc.freeze()
        try:
            with torch.random.fork_rng(devices=[]):  # the manager reseeds torch's global RNG
                for (greedy, min_p), group in groups.items():
                    by_id.update(self._run_group(group, greedy=greedy, min_p=min_p, stats=stats))
        finally:
            gc.unfreeze()
        self.last_run = stats
        return [by_id[r.request_id] for r in requests]

    def _configs(self, group: list[RolloutRequest], *, greedy: bool, min_p: float):
        """The manager's ``(GenerationConfig, ContinuousBatchingConfig kwargs)`` for one group."""
        cfg = self.model.config
        common = dict(
            max_new_tokens=max(r.sampling.max_new_tokens for r in group), pad_token_id=cfg.pad_token_id,
            eos_token_id=cfg.eos_token_id,  # unused: every request passes its own (silences a warning)
        )  # fmt: skip
        s = group[0].sampling
        if greedy:
            gen = GenerationConfig(do_sample=False, **common)
        elif self.per_request_processors:
            gen = GenerationConfig(
                do_sample=True, temperature=_PLACEHOLDER_TEMPERATURE, top_k=self.vocab_size, top_p=_PLACEHOLDER_TOP_P,
                min_p=min_p if min_p > 0 else None, **common,
            )  # fmt: skip
        else:  # TRL's one GenerationConfig (the group shares these, checked in generate)
            gen = GenerationConfig(
                do_sample=True, temperature=s.temperature, top_k=s.top_k or None, top_p=s.top_p,
                min_p=min_p if min_p > 0 else None, repetition_penalty=1.0, **common,
            )  # fmt: skip
        cb: dict = dict(return_logprobs=self.return_logprobs, per_request_processors=self.per_request_processors)
        if compat.has("seed"):
            cb["seed"] = self.seed
        page = self.page_size or compat.DEFAULT_PAGE_SIZE
        if self.page_size is not None:
            cb["page_size"] = self.page_size
        if self.num_blocks is not None:
            cb["num_blocks"] = self.num_blocks
        elif self.max_memory_percent is None:  # sized for this group
            cb["num_blocks"] = sum(
                math.ceil((len(r.prompt_ids) + r.sampling.max_new_tokens) / page) + 1 for r in group
            )
        if self.max_memory_percent is not None:
            cb["max_memory_percent"] = self.max_memory_percent
        if self.max_batch_tokens is not None:
            cb["max_batch_tokens"] = self.max_batch_tokens
        return gen, cb

    def _run_group(
        self, group: list[RolloutRequest], *, greedy: bool, min_p: float, stats: RunStats
    ) -> dict[str, Rollout]:
        device = next(self.model.parameters()).device
        gen, cb = self._configs(group, greedy=greedy, min_p=min_p)
        setup_start = time.perf_counter()
        if "seed" not in cb:  # before 5.9 the manager samples from the global RNG as it finds it (generate forks it)
            torch.manual_seed(self.seed)
        try:
            manager = compat.init_manager(self.model, gen, **cb)
        except compat.MissingFeature as err:
            raise NotApplicable(self.name, str(err)) from err
        except ValueError as err:  # refused before any work (e.g. "Invalid layer type: conv"): not a crash
            raise NotApplicable(self.name, f"transformers CB refuses this model: {err}") from err
        if self.warmup:
            manager.warmup()
        manager.start()
        stats.setup_s += time.perf_counter() - setup_start
        stats.extra.update(cb_config=cb, num_managers=stats.extra.get("num_managers", 0) + 1)
        outputs = {}
        try:
            with self.window_hook(), compat.count_evictions() as evictions:
                start = clock(device)
                for r in group:
                    kwargs = {}
                    if not greedy and self.per_request_processors:
                        s = r.sampling
                        kwargs = dict(temperature=float(s.temperature), top_k=s.top_k or self.vocab_size)
                        kwargs["top_p"] = float(s.top_p)
                    accepted = manager.add_request(
                        list(r.prompt_ids), request_id=r.request_id, max_new_tokens=r.sampling.max_new_tokens,
                        eos_token_id=list(r.eos_token_ids), record_timestamps=True, **kwargs,
                    )  # fmt: skip
                    if accepted is None:
                        raise EngineError(f"{self.name}: the manager refused request {r.request_id!r}")
                self._collect(manager, group, outputs)
                end = clock(device)
            self._note_cost(manager, outputs, start, end, stats)
            stats.extra["evictions"] = stats.extra.get("evictions", 0) + evictions[0]
        finally:
            stop_start = time.perf_counter()
            manager.stop(block=True)
            compat.destroy(manager)  # what generate_batch does after stopping a non-persistent manager
            stats.setup_s += time.perf_counter() - stop_start
        return {r.request_id: self._to_rollout(r, outputs.get(r.request_id)) for r in group}

    def _collect(self, manager, group: list[RolloutRequest], outputs: dict) -> None:
        """Wait for every request of ``group``; a dead generation thread or the timeout is an :class:`EngineError`."""
        deadline = time.monotonic() + self.timeout_s
        while len(outputs) < len(group):
            result = manager.get_result(timeout=1.0)
            if result is not None and result.is_finished():
                outputs[result.request_id] = result
            elif result is None and not manager.is_running():
                fatal = compat.fatal_error(manager)
                done = f"{len(outputs)}/{len(group)}"
                raise EngineError(f"{self.name}: generation thread died with {done} done: {fatal!r}")
            if time.monotonic() > deadline:
                left = len(group) - len(outputs)
                raise EngineError(f"{self.name}: {left} requests unfinished after {self.timeout_s}s")

    @staticmethod
    def _note_cost(manager, outputs: dict, start: float, end: float, stats: RunStats) -> None:
        """Add one window to ``stats``: its length, the first token's time (first window only) and the cache size."""
        firsts = [o.timestamps[0] for o in outputs.values() if getattr(o, "timestamps", None)]
        if stats.generate_s == 0.0 and firsts:  # TTFT counts from the first window's start
            stats.ttft_s = min(firsts) - start
        stats.generate_s += end - start
        cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
        if getattr(cache, "cache_tensor", None) is not None:  # managers run one after another: the largest counts
            stats.kv_reserved_bytes = max(stats.kv_reserved_bytes or 0, int(cache.cache_tensor.nbytes))

    def _to_rollout(self, request: RolloutRequest, output) -> Rollout:
        """Upstream output -> Rollout, refusing anything failed, missing or malformed (never an empty rollout)."""
        if output is None:
            raise EngineError(f"{self.name}: request {request.request_id!r} came back missing")
        if output.error is not None:
            raise EngineError(f"{self.name}: request {request.request_id!r} failed upstream: {output.error}")
        tokens = list(output.generated_tokens)
        logprobs = list(output.logprobs) if self.return_logprobs else [float("nan")] * len(tokens)
        if not tokens or len(tokens) != len(logprobs):
            raise EngineError(
                f"{self.name}: request {request.request_id!r} returned {len(tokens)} tokens, {len(logprobs)} logprobs"
            )
        if list(output.prompt_ids) != list(request.prompt_ids):
            raise EngineError(f"{self.name}: request {request.request_id!r} came back with a different prompt")
        reason = "stop" if tokens[-1] in request.eos_token_ids else "length"
        return Rollout(request.request_id, request.prompt_ids, tuple(tokens), tuple(logprobs), reason)
