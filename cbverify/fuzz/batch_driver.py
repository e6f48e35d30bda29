"""The ``generate_batch`` session: each call is ``model.generate_batch(inputs, generation_config=...,
continuous_batching_config=..., persistent_manager=..., **options)`` as TRL and most users call it.

- ``generate_batch`` logs and swallows the errors of its loop and returns what it has; it can also wait forever (a
  result it counts on never comes). So it runs in a worker thread under :data:`BATCH_TIMEOUT_S`; past it the
  session stops the call's manager (``generate_batch``'s loop then sees the thread gone and returns) and reports the
  hang. The manager is recorded by wrapping ``init_continuous_batching`` on the instance for the call.
- ``persistent_manager=True``: every call reuses the manager the first one cached on the model; the session
  destroys it at the end. Between calls that manager's loop is stopped, so a training step or a weight update runs
  beside an idle manager, or (``Step.paused``, releases with ``pause()``) inside ``pause()`` of the cached manager
  restarted for it (``start()``, ``pause()``, ``stop(keep_for_next_session=True)``): the only way to hold a pause
  between two ``generate_batch`` calls.
- Every ``GenerationConfig`` passed is kept with a copy of its contents (``passed_configs``): the judge checks none
  was changed.
- After every call, and inside every training step or weight update between calls, the caller's plain forwards are
  compared with a twin that never had a manager (``plain``: :class:`cbverify.fuzz.drivers.PlainForwards`).
"""

from __future__ import annotations

import copy
import gc
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz.case import FuzzCase, Step
from cbverify.fuzz.drivers import CallResult, Output, PlainForwards, train_once
from reference.models import perturb

BATCH_TIMEOUT_S = 60.0  # a call on the tiny bundled models takes ~1 s; past this it is reported as a hang


@dataclass(slots=True)
class BatchSession:
    model: object
    case: FuzzCase
    passed_configs: list = field(default_factory=list)  # (GenerationConfig, its to_dict() before the call)
    timeout_s: float = BATCH_TIMEOUT_S
    plain: PlainForwards | None = None  # the caller's plain forwards, against a twin that never had a manager

    def open(self) -> None:
        self.plain = PlainForwards.open(self.model, self.case)

    def close(self) -> None:
        if self.case.persistent:
            compat.destroy_cached_manager(self.model)

    def generation_config(self, step: Step):
        from transformers import GenerationConfig

        return GenerationConfig(**self.case.generation_of(step))

    def batch_kwargs(self, step: Step) -> dict:
        return {**compat.batch_kwargs(persistent_manager=self.case.persistent, progress_bar=False), **step.options}

    def call(self, step: Step) -> CallResult:
        """One ``generate_batch`` call (:meth:`generate`), then the caller's plain forwards beside what it left."""
        result = self.generate(step)
        if self.plain is not None:
            done = [(list(o.prompt_ids) + list(o.tokens), len(o.prompt_ids)) for o in result.raw if o.error is None]
            self.plain.remember(done or [(list(r.prompt_ids), len(r.prompt_ids)) for r in step.requests])
            left = "the cached manager, stopped" if self.case.persistent else "no manager left"
            self.plain.probe(f"after call {self.plain.calls - 1} ({left})")
        return result

    def generate(self, step: Step) -> CallResult:
        from transformers.generation import ContinuousBatchingConfig

        try:
            gen = self.generation_config(step)
            self.passed_configs.append((gen, copy.deepcopy(gen.to_dict())))
            cb = ContinuousBatchingConfig(**compat.config_kwargs(**self.case.config))
            kwargs = self.batch_kwargs(step)
        except Exception as err:  # noqa: BLE001 - refused before any work: reported, never a fuzzer crash
            return CallResult([], [], crash=f"refused: {type(err).__name__}: {err}")
        inputs = [list(r.prompt_ids) for r in step.requests]
        box, built, crash = {}, [], None
        original = self.model.init_continuous_batching

        def recording(*args, **kw):
            manager = original(*args, **kw)
            built.append(manager)
            return manager

        def target() -> None:
            try:
                box["out"] = self.model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb,
                                                       **kwargs)  # fmt: skip
            except BaseException as err:  # noqa: BLE001 - reported as the call's crash
                box["error"] = err

        self.model.init_continuous_batching = recording
        gc.freeze()  # the manager's stop() runs gc.collect(): scan only its own objects (as the adapter does)
        try:
            with compat.count_evictions() as evictions:
                worker = threading.Thread(target=target, daemon=True)
                worker.start()
                worker.join(self.timeout_s)
                if worker.is_alive():
                    crash = f"generate_batch did not return within {self.timeout_s:.0f}s (hung); its manager stopped"
                    for manager in built:
                        manager.stop(block=True, timeout=10)
                    worker.join(30)
        finally:
            gc.unfreeze()
            del self.model.init_continuous_batching
        if "error" in box:
            crash = f"{type(box['error']).__name__}: {box['error']}"
        fatal = next((compat.fatal_error(m) for m in built if compat.fatal_error(m) is not None), None)
        if fatal is not None and crash is None:
            crash = f"generation thread died: {fatal!r}"
        raw = [
            Output(rid, tuple(o.generated_tokens), tuple(getattr(o, "logprobs", None) or ()), o.error,
                   tuple(o.prompt_ids))
            for rid, o in (box.get("out") or {}).items()
        ]  # fmt: skip
        return CallResult(raw, list(raw), evictions=evictions[0], crash=crash)

    @contextmanager
    def held(self, paused: bool):
        """Inside ``pause()`` of the cached manager restarted for it, or beside the idle one (``paused=False``)."""
        manager = compat.cached_manager(self.model) if paused else None
        if manager is None:
            yield
            return
        manager = self.model.init_continuous_batching()  # the cached one, its CB attention switched back on
        manager.start()
        try:
            with manager.pause():
                yield
        finally:
            manager.stop(block=True, keep_for_next_session=True)

    def _where(self, paused: bool) -> str:
        if paused and compat.cached_manager(self.model) is not None:
            return "inside pause()"
        return "beside the cached manager, stopped" if compat.cached_manager(self.model) is not None else (
            "no manager left")  # fmt: skip

    def train_step(self, seed: int, paused: bool = False) -> None:
        where = f"training step ({self._where(paused)})"
        with self.held(paused):
            if self.plain is None:
                train_once(self.model, seed)
                return
            self.plain.train(where, seed, lambda: train_once(self.model, seed))
            self.plain.probe(where)

    def update_weights(self, seed: int, paused: bool = False) -> None:
        where = f"weight update ({self._where(paused)})"
        with self.held(paused):
            perturb(self.model, seed)
            if self.plain is not None:
                self.plain.update(seed)
                self.plain.probe(where)
