"""The Engine protocol, capability declarations, and the registry of every system under test.

Contract of an engine: ``generate(requests) -> list[Rollout]`` returns one rollout per request, in request order; an
engine that cannot serve a request raises :class:`NotApplicable` naming the reason (never a silent fallback), and an
upstream failure (a request that comes back failed or missing) raises :class:`EngineError` (never an empty output).

Engine names (used by the CLI, the tests, the benchmarks): ``reference``, ``cb_impl``, ``hf-generate``,
``transformers-cb``, and ``vllm``, which runs in a venv of its own through a worker process
(:mod:`cbverify.engines.remote`, :mod:`cbverify.engines.envs`). Get one with :func:`get_engine`
``(name, model, **options)``.

Cost of a call: after each ``generate`` the ``hf-generate``, ``transformers-cb`` and ``cb_impl`` adapters set
``engine.last_run`` (:class:`RunStats`): the generation window, time to first token, KV bytes reserved. Their
``window_hook`` option (a context-manager factory) is entered around each generation window, so a caller can count or
time exactly what ``RunStats.generate_s`` covers (the benchmarks count model forwards there). These are the one driver
per upstream system: ``cbverify verify``, the tests and ``cbverify bench`` all use them.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from reference.spec import Rollout, RolloutRequest, SamplingParams

LogprobSemantics = Literal["processed", "raw", "none"]
WindowHook = Callable[[], AbstractContextManager]  # entered around each generation window (see module docstring)


class NotApplicable(Exception):
    """The engine cannot serve these requests as asked (e.g. an unsupported sampling option). Carries the reason."""

    def __init__(self, engine: str, reason: str) -> None:
        super().__init__(f"{engine}: not applicable: {reason}")
        self.engine = engine
        self.reason = reason


class EngineError(RuntimeError):
    """The engine (or the upstream library behind it) failed: a request came back failed, missing or malformed."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an engine claims; the suite checks exactly these claims and reports (does not assert) the rest.

    - ``spec_sampling``: sampled tokens follow the counter-based Gumbel noise of ``reference.spec`` (so they must
      equal the reference's token for token); otherwise the engine has its own RNG and is checked by distribution.
    - ``per_request_max_new_tokens`` / ``per_request_sampling`` / ``per_request_eos``: requests in one call may
      differ in these without the engine falling back or refusing.
    - ``logprob_semantics``: ``processed`` (the spec: log-prob under the processed distribution the token was drawn
      from), ``raw`` (``log_softmax`` of the raw logits) or ``none`` (no log-probs returned).
    - ``claims_batch_invariance``: a request's tokens and log-probs do not depend on what else is in the batch.
    - ``supports_min_p``: min-p is honoured (possibly by grouping requests with equal min-p).
    - ``follows_weight_updates``: the engine runs the very model object it was given, so a change to its weights in
      place (an optimizer step, a weight sync) shows in the next call -- what an in-process GRPO sampler must do.
    - ``deviations``: ids of :data:`DEVIATIONS`, documented departures from ``reference.spec`` that the engine
      declares; the suite draws around them, lists them in its report, and holds each declaration to being real.
    - ``sizing``: the factory options that size the engine's memory and its steps (:class:`SizingOption`: name,
      role, accepted range). The conformance suite builds the engine with values drawn from these ranges, their
      tight end included (:func:`pressure_sizes`), so that chunked prefill, preemption and eviction happen under
      every property; an engine that declares none is only ever run at the sizes its factory picks.
    - ``mechanisms``: ids of :data:`MECHANISMS` the engine implements and counts. After each ``generate`` it reports
      in ``last_run.extra["mechanisms"]`` which requests each one touched and how often (``{request_id:
      {mechanism: times}}``, untouched requests left out). ``cbverify verify`` fails a run in which a declared
      mechanism was never reached: a check of an engine is only as good as what its workload made the engine do.
    """

    spec_sampling: bool
    per_request_max_new_tokens: bool
    per_request_sampling: bool
    per_request_eos: bool
    logprob_semantics: LogprobSemantics
    claims_batch_invariance: bool
    supports_min_p: bool = True
    follows_weight_updates: bool = False
    deviations: tuple[str, ...] = ()
    sizing: tuple[SizingOption, ...] = ()
    mechanisms: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.logprob_semantics not in ("processed", "raw", "none"):
            raise ValueError(f"logprob_semantics must be processed|raw|none, got {self.logprob_semantics!r}")
        object.__setattr__(self, "deviations", tuple(self.deviations))  # a list after a JSON round trip
        unknown = [d for d in self.deviations if d not in DEVIATIONS]
        if unknown:
            raise ValueError(f"unknown deviations {unknown}; known: {', '.join(DEVIATIONS)}")
        object.__setattr__(self, "mechanisms", tuple(self.mechanisms))
        unknown = [m for m in self.mechanisms if m not in MECHANISMS]
        if unknown or len(set(self.mechanisms)) != len(self.mechanisms):
            raise ValueError(f"mechanisms must name each of {', '.join(MECHANISMS)} at most once, got "
                             f"{list(self.mechanisms)}")  # fmt: skip
        if isinstance(self.sizing, str | bytes | dict) or not isinstance(self.sizing, Sequence):
            raise ValueError(f"sizing must be a sequence of SizingOption, got {self.sizing!r}")
        sizing = tuple(o if isinstance(o, SizingOption) else SizingOption(**o) if isinstance(o, dict) else o
                       for o in self.sizing)  # dicts after a JSON round trip  # fmt: skip
        object.__setattr__(self, "sizing", sizing)
        wrong = [o for o in sizing if not isinstance(o, SizingOption)]
        if wrong:
            raise ValueError(f"sizing holds {wrong[0]!r}, not a SizingOption")
        names, roles = [o.name for o in sizing], [o.role for o in sizing]
        if len(set(names)) != len(names) or len(set(roles)) != len(roles):
            raise ValueError(f"sizing names each option and each role once, got {[(o.name, o.role) for o in sizing]}")
        if "kv_blocks" in roles and "block_size" not in roles:
            raise ValueError("sizing declares a kv_blocks option without a block_size option: a count of KV blocks "
                             "means nothing without their size (declare a fixed one as min == max)")  # fmt: skip

    def sizing_option(self, role: str) -> SizingOption | None:
        """The declared option of ``role`` (:data:`SIZING_ROLES`), or ``None``."""
        return next((o for o in self.sizing if o.role == role), None)


SIZING_ROLES: dict[str, str] = {
    "block_size": "tokens per KV-cache block (page)",
    "kv_blocks": "KV-cache blocks: fewer than the running requests need preempts or evicts some of them",
    "batch_tokens": "tokens one step computes: a prompt longer than this is prefilled in chunks",
    "num_seqs": "sequences running at once",
}


@dataclass(frozen=True, slots=True)
class SizingOption:
    """One factory option that sizes an engine's memory or its steps (``Capabilities.sizing``).

    ``name`` is the keyword the engine's factory takes, ``role`` what it sizes (:data:`SIZING_ROLES`), ``min`` /
    ``max`` the integer range the engine accepts (inclusive). The suite draws values in the range, and the tight end
    on purpose: ``min`` for ``batch_tokens`` and ``num_seqs``, and for ``kv_blocks`` the fewest blocks that still
    hold the workload's longest request alone (:func:`pressure_sizes`, never below ``min``).
    """

    name: str
    role: str
    min: int
    max: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"a sizing option's name must be a keyword argument's name, got {self.name!r}")
        if self.role not in SIZING_ROLES:
            raise ValueError(f"sizing option {self.name!r}: role must be one of {', '.join(SIZING_ROLES)}, "
                             f"got {self.role!r}")  # fmt: skip
        for bound in (self.min, self.max):
            if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
                raise ValueError(f"sizing option {self.name!r}: min and max must be ints >= 1, got {bound!r}")
        if self.min > self.max:
            raise ValueError(f"sizing option {self.name!r}: min {self.min} > max {self.max}")


def pressure_sizes(requests: Sequence[RolloutRequest], block_size: int) -> tuple[int, int]:
    """``(kv_blocks, batch_tokens)`` that put a CB engine under pressure on ``requests``: KV blocks of
    ``block_size`` for the longest request alone, plus one (so the others are preempted or evicted and recomputed),
    and a per-step token budget of half the longest prompt, at least 2 (so every long prompt is prefilled in
    chunks). ``cbverify verify``'s pressure rows and the conformance suite's tight end both use it."""
    longest = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
    longest_prompt = max(len(r.prompt_ids) for r in requests)
    return -(-longest // block_size) + 1, max(2, longest_prompt // 2)


@dataclass(frozen=True, slots=True)
class Mechanism:
    """A mechanism inside an engine that an engine may declare (``Capabilities.mechanisms``) and must then count.
    ``pressure``: reached only under memory and step pressure (``cbverify verify``'s pressure rows)."""

    id: str
    description: str
    pressure: bool = False


MECHANISMS: dict[str, Mechanism] = {
    m.id: m
    for m in (
        Mechanism("prefix-sharing", "a request forked from another with the same prompt: the prompt's KV shared"),
        Mechanism("cow-2-sharers", "copy-on-write of a shared, partly filled block that 2 sequences hold"),
        Mechanism("cow-3plus-sharers", "copy-on-write of a shared, partly filled block that 3 or more hold"),
        Mechanism("chunked-prefill", "a prompt prefilled over several steps", pressure=True),
        Mechanism("preemption", "a running request preempted and recomputed or resumed", pressure=True),
    )
}


@dataclass(frozen=True, slots=True)
class Deviation:
    """A documented departure from ``reference.spec`` an engine may declare (``Capabilities.deviations``).

    ``applies(sampling)`` is its domain: the requests where the engine's answer differs from the spec's, which the
    conformance suite does not draw for that engine; ``example`` is a sampling in the domain where the difference
    shows on the bundled model, so the suite can hold the declaration to being real (a declaration that is not
    would only hide part of the engine from the suite)."""

    id: str
    description: str
    applies: Callable[[SamplingParams], bool]
    example: SamplingParams
    # the engine's processed log-probs in the domain: (V,) raw logits, sampling -> (V,), as the spec's process_logits
    process: Callable[[torch.Tensor, SamplingParams], torch.Tensor]


def _min_p_first(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """``reference.generate.process_logits`` in vLLM's order: temperature, min-p, top-k, top-p, then ``log_softmax``
    (the spec's processors, each as the oracle applies it)."""
    from reference.generate import apply_min_p, apply_temperature, apply_top_k, apply_top_p

    scores = logits.to(torch.float32)
    if sampling.greedy:
        return torch.log_softmax(scores, dim=-1)
    scores = apply_min_p(apply_temperature(scores, sampling.temperature), sampling.min_p)
    return torch.log_softmax(apply_top_p(apply_top_k(scores, sampling.top_k), sampling.top_p), dim=-1)


DEVIATIONS: dict[str, Deviation] = {
    d.id: d
    for d in (
        Deviation(
            "min-p-before-top-p",
            "min-p is applied before top-p (vLLM's sampler), not after it: top-p then renormalises over another set "
            "(min-p and top-k commute, so only requests with both min-p and top-p differ)",
            lambda s: s.min_p > 0 and s.top_p < 1,
            SamplingParams(temperature=1.5, top_p=0.9, min_p=0.1, max_new_tokens=8),
            _min_p_first,
        ),
    )
}


def declared_processing(
    deviations: Sequence[str], sampling: SamplingParams
) -> tuple[str | None, Callable[[torch.Tensor, SamplingParams], torch.Tensor]]:
    """``(deviation id or None, process)``: how an engine declaring ``deviations`` processes logits under
    ``sampling``: a declared deviation's own processing in its domain, else the spec's ``process_logits``. A request
    in such a domain is judged against what the engine declares it does (verify names the deviation it applied)."""
    from reference.generate import process_logits

    applying = [d for d in deviations if DEVIATIONS[d].applies(sampling)]
    if len(applying) > 1:
        raise ValueError(f"deviations {applying} all apply to {sampling}: their order is not defined")
    return (applying[0], DEVIATIONS[applying[0]].process) if applying else (None, process_logits)


@dataclass(slots=True)
class RunStats:
    """What the last ``generate()`` call cost (``engine.last_run``). Times are seconds of :func:`clock`.

    - ``generate_s``: the generation window, summed over the call's windows (one per upstream batch or manager):
      ``hf-generate`` and ``cb_impl`` the whole call; ``transformers-cb`` from its first ``add_request`` to its last
      result (manager construction, ``warmup()``, ``start()`` and ``stop()`` are ``setup_s``).
    - ``setup_s``: work inside the call but outside the window (``transformers-cb``'s managers; 0 for the others --
      their construction happens in the constructor, which the caller times).
    - ``ttft_s``: from the start of the first window until the first completion token of any request exists
      (``hf-generate``: first logits-processor call; ``transformers-cb``: earliest token timestamp; ``cb_impl``: end
      of its first step); ``None`` when unknown.
    - ``kv_reserved_bytes``: KV-cache bytes allocated (``hf-generate``: the returned cache's tensors, largest batch;
      ``transformers-cb``: the manager's cache tensor, largest group; ``cb_impl``: its cache).
    - ``extra``: engine-specific details (``cb_impl``: its stats; ``transformers-cb``: the configs used;
      ``hf-generate``: the generated width).
    """

    generate_s: float = 0.0
    setup_s: float = 0.0
    ttft_s: float | None = None
    kv_reserved_bytes: int | None = None
    extra: dict = field(default_factory=dict)


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work (CUDA only; a no-op on CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def clock(device: str | torch.device) -> float:
    """``perf_counter`` after the device has finished all queued work."""
    sync(device)
    return time.perf_counter()


@runtime_checkable
class Engine(Protocol):
    """A system under test. ``generate`` follows the module contract above."""

    name: str
    capabilities: Capabilities

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Rollout]: ...


ENGINE_MODULES: dict[str, tuple[str, str]] = {
    "reference": ("cbverify.engines.reference_engine", "ReferenceEngine"),
    "cb_impl": ("cbverify.engines.cb_impl_engine", "CbImplEngine"),
    "hf-generate": ("cbverify.engines.hf_generate", "HFGenerateEngine"),
    "transformers-cb": ("cbverify.engines.transformers_cb", "TransformersCBEngine"),
    "vllm": ("cbverify.engines.remote", "vllm"),  # in its own venv: ``cbverify env build vllm``
}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINE_MODULES)
# Engines served from an environment of their own (``cbverify.engines.envs``): each call starts a worker process.
OWN_ENV_ENGINES: tuple[str, ...] = ("vllm",)
LOCAL_ENGINES: tuple[str, ...] = tuple(n for n in ENGINE_NAMES if n not in OWN_ENV_ENGINES)


ENTRY_POINT_GROUP = "cbverify.engines"  # a third-party package registers ``name = "module:factory"`` here


class PluginError(ValueError):
    """A third-party engine could not be loaded or is not an engine: names the plugin and what is wrong."""


def plugin_engines() -> dict[str, str]:
    """Engines installed by other packages: entry point name -> ``module:factory``."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_engines() -> tuple[str, ...]:
    return (*ENGINE_NAMES, *sorted(set(plugin_engines()) - set(ENGINE_NAMES)))


def load_factory(name: str) -> Callable:
    """The factory behind ``name``: a built-in engine, an installed entry point of :data:`ENTRY_POINT_GROUP`, or a
    ``module:factory`` path."""
    if name in ENGINE_MODULES:
        module, attr = ENGINE_MODULES[name]
        return getattr(importlib.import_module(module), attr)
    target = plugin_engines().get(name, name if ":" in name else None)
    if target is None:
        raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(known_engines())}, or module:factory")
    module, _, attr = target.partition(":")
    try:
        factory = importlib.import_module(module)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except Exception as err:
        raise PluginError(f"engine {name!r} ({target}) could not be loaded: {type(err).__name__}: {err}") from err
    if not callable(factory):
        raise PluginError(f"engine {name!r} ({target}) is a {type(factory).__name__}, not a factory")
    return factory


def get_engine(name: str, model, **options) -> Engine:
    """The engine ``name`` wrapping ``model``: ``factory(model, **options)`` (see each adapter; for third-party
    engines docs/engines.md). An engine from outside the repository is checked on the way out (:class:`Checked`)."""
    engine = load_factory(name)(model, **options)
    return engine if name in ENGINE_MODULES else Checked.wrap(name, engine)


class Checked:
    """A third-party engine behind a guard: it must look like an :class:`Engine` when built, and every ``generate``
    must return a list of :class:`Rollout`, one per request; otherwise :class:`PluginError` / :class:`EngineError`
    name the engine and what came back. Everything else is the engine's own (attributes pass through)."""

    def __init__(self, label: str, engine) -> None:
        self._label, self._engine = label, engine
        self.name = label  # rows and reports name the engine as it was asked for

    @classmethod
    def wrap(cls, label: str, engine) -> Checked:
        missing = [a for a in ("name", "capabilities", "generate") if not hasattr(engine, a)]
        if missing:
            what = f"its factory returned a {type(engine).__name__}, which has no {', '.join(missing)}"
            raise PluginError(f"engine {label!r}: {what} (an engine has name, capabilities and generate(requests))")
        if not isinstance(engine.capabilities, Capabilities):
            raise PluginError(f"engine {label!r}: capabilities is a {type(engine.capabilities).__name__}, not a "
                              "cbverify.engines.Capabilities")  # fmt: skip
        return cls(label, engine)

    def __getattr__(self, attr):
        return getattr(self._engine, attr)

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        out = self._engine.generate(requests)
        if not isinstance(out, list | tuple):
            raise EngineError(f"engine {self._label!r}: generate returned a {type(out).__name__}, not a list")
        if len(out) != len(requests):
            raise EngineError(f"engine {self._label!r}: generate returned {len(out)} rollouts for {len(requests)} "
                              "requests")  # fmt: skip
        wrong = [(i, type(r).__name__) for i, r in enumerate(out) if not isinstance(r, Rollout)]
        if wrong:
            raise EngineError(f"engine {self._label!r}: generate returned a {wrong[0][1]} at position {wrong[0][0]}, "
                              "not a reference.spec.Rollout")  # fmt: skip
        return list(out)


def check_unique_ids(engine: str, requests: Sequence[RolloutRequest]) -> None:
    """Every adapter's first step: request ids key the results, so duplicates would silently merge two requests."""
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{engine}: request_ids must be unique within one generate() call")


def finish_rollout(request: RolloutRequest, tokens: Sequence[int], logprobs: Sequence[float]) -> Rollout:
    """Cut ``tokens`` at the first EOS (kept) and at ``max_new_tokens``; set ``finish_reason`` (``Rollout``).

    For adapters whose upstream keeps going past a request's own limits (a shared ``max_new_tokens`` or a shared
    EOS set). ``logprobs`` must be as long as ``tokens``.
    """
    if len(tokens) != len(logprobs):
        raise EngineError(f"request {request.request_id!r}: {len(logprobs)} logprobs for {len(tokens)} tokens")
    limit = request.sampling.max_new_tokens
    cut, reason = min(len(tokens), limit), "length"
    for i, token in enumerate(tokens[:limit]):
        if token in request.eos_token_ids:
            cut, reason = i + 1, "stop"
            break
    return Rollout(request.request_id, request.prompt_ids, tuple(tokens[:cut]), tuple(logprobs[:cut]), reason)


def kv_bytes_per_token(model) -> int:
    """Keys and values of one token over every layer, in the model's dtype (a standard decoder's KV layout)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * next(model.parameters()).element_size()
