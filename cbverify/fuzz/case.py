"""A fuzz case as plain data: the engine configuration and the program of calls, serialisable to JSON.

A :class:`FuzzCase` is what the fuzzer draws, what a failure is shrunk over and what a repro script replays.
``config`` holds the engine's own configuration (transformers CB: ``ContinuousBatchingConfig`` fields; cb_impl:
``EngineConfig`` fields; hf-generate: adapter options) and ``generation`` the manager-wide generation options a user
puts in the ``GenerationConfig`` (``do_sample``, ``min_new_tokens``, ``repetition_penalty``, ``min_p``).
Requests carry what a user passes per request: transformers CB's per-request ``temperature`` / ``top_k`` /
``top_p`` keyword arguments are passed as drawn (``top_k=0`` included), never translated. With
``per_request_processors`` an option a request leaves unset takes the manager's ``GenerationConfig`` value, which the
session sets to :data:`PER_REQUEST_PLACEHOLDERS`; the oracle reads it so (:meth:`FuzzRequest.sampling`).

``entry`` says which transformers CB entry point runs the calls: ``manager`` (the request API) or
``generate_batch`` (``model.generate_batch``, TRL's). For ``generate_batch`` ``generation`` is the
``GenerationConfig`` passed to every call, as keyword arguments (a key left out is a field left unset); a call's
``Step.generation`` replaces it for that call, ``Step.options`` are ``generate_batch``'s own keyword arguments
(``max_new_tokens``, or a generation option passed there instead of in the config), and a request is one input: only
its id (a label, the library names its own) and prompt are passed; its ``max_new_tokens`` is the call's (sizing).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from reference.spec import RolloutRequest, SamplingParams

# transformers CB with per_request_processors builds a per-request processor only for an option the manager's
# GenerationConfig sets to a value that acts (temperature != 1, top_k, top_p < 1), so the manager session
# (cbverify.fuzz.drivers) and the repro script set these there (top_k: the vocabulary size, which cuts nothing). A
# request that passes no value of its own is processed with the config's: ContinuousBatchingTopPLogitsWarper's
# prepare_tensor_args reads logit_processor_kwargs.get("top_p", self.top_p), so an unset per-request top_p is 0.999
# (the last 0.1% of the mass cut: sampled log-probs up to -log(0.999) = 1.0e-3 above a reading of 1.0).
PER_REQUEST_PLACEHOLDERS = {"temperature": 0.5, "top_p": 0.999}

StepKind = Literal["call", "train", "update_weights"]
Entry = Literal["manager", "generate_batch"]
CALL_PATTERNS = ("one-call", "several-calls", "persistent", "persistent+train", "persistent+weights",
                 "persistent+config-change")  # fmt: skip


def pages_needed(requests, page: int) -> int:
    """KV pages (blocks) the longest of ``requests`` needs: ceil((prompt + max_new_tokens) / page)."""
    return max(-(-(len(r.prompt_ids) + r.max_new_tokens) // page) for r in requests)


@dataclass(frozen=True, slots=True)
class FuzzRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    temperature: float = 0.0  # 0: greedy (the manager's do_sample decides for transformers CB)
    top_k: int | None = None  # None: not passed; 0 is passed as is
    top_p: float | None = None
    seed: int = 0

    def sampling(self, generation: dict, per_request: bool = False) -> SamplingParams:
        """The oracle's reading of the request: ``top_k=0`` means "no top-k", as in a ``GenerationConfig``;
        ``per_request`` (transformers CB with ``per_request_processors``): an unset ``top_p`` is the manager config's
        :data:`PER_REQUEST_PLACEHOLDERS` value, else an unset one is 1.0."""
        greedy = self.temperature == 0.0 or not generation.get("do_sample", True)
        unset_top_p = PER_REQUEST_PLACEHOLDERS["top_p"] if per_request else 1.0
        return SamplingParams(
            temperature=0.0 if greedy else self.temperature, top_k=0 if greedy else (self.top_k or 0),
            top_p=1.0 if greedy else unset_top_p if self.top_p is None else self.top_p,
            min_p=0.0 if greedy else float(generation.get("min_p") or 0.0), max_new_tokens=self.max_new_tokens,
        )  # fmt: skip

    def rollout_request(self, generation: dict, per_request: bool = False) -> RolloutRequest:
        sampling = self.sampling(generation, per_request)
        return RolloutRequest(self.request_id, self.prompt_ids, sampling, self.seed, self.eos_token_ids)


@dataclass(frozen=True, slots=True)
class Step:
    kind: StepKind
    requests: tuple[FuzzRequest, ...] = ()
    staggered: bool = False  # call: add the second half only once the first result is out (requests join mid-run)
    seed: int = 0  # train / update_weights: the perturbation's seed
    generation: dict | None = None  # generate_batch: this call's GenerationConfig when it differs from the case's
    options: dict = field(default_factory=dict)  # generate_batch: its keyword arguments (max_new_tokens, ...)
    paused: bool = False  # generate_batch train / update_weights: inside pause() of the cached manager, restarted


@dataclass(frozen=True, slots=True)
class FuzzCase:
    engine: str
    model: str
    persistent: bool  # one manager / engine for every call (else one per call)
    config: dict = field(default_factory=dict)
    generation: dict = field(default_factory=dict)
    steps: tuple[Step, ...] = ()
    caller_training: bool = False  # the caller's model is in train mode when it hands it over (a GRPO loop's is)
    entry: Entry = "manager"
    caller_attn: str | None = None  # the attention implementation the caller set (None: the checkpoint's as loaded)

    @property
    def calls(self) -> list[Step]:
        return [s for s in self.steps if s.kind == "call"]

    @property
    def requests(self) -> list[FuzzRequest]:
        return [r for s in self.calls for r in s.requests]

    @property
    def per_request(self) -> bool:
        """transformers CB's request API sampling with ``per_request_processors``: each request passes its own
        options, and an option it leaves unset is the manager config's (:data:`PER_REQUEST_PLACEHOLDERS`)."""
        sampled = bool(self.generation.get("do_sample")) and bool(self.config.get("per_request_processors"))
        return self.engine == "transformers-cb" and self.entry == "manager" and sampled

    def generation_of(self, step: Step) -> dict:
        """The generation options ``step`` runs with (generate_batch: a call may carry its own)."""
        return self.generation if step.generation is None else step.generation

    def generations(self) -> list[dict]:
        """Every set of generation options a call of the case runs with."""
        return [self.generation] + [s.generation for s in self.calls if s.generation is not None]

    def call_pattern(self) -> str:
        kinds = {s.kind for s in self.steps}
        if self.persistent and any(s.generation not in (None, self.generation) for s in self.calls):
            return "persistent+config-change"
        if not self.persistent:
            return "several-calls" if len(self.calls) > 1 else "one-call"
        return "persistent+train" if "train" in kinds else "persistent+weights" if "update_weights" in kinds else (
            "persistent")  # fmt: skip

    def with_steps(self, steps) -> FuzzCase:
        return replace(self, steps=tuple(steps))

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> FuzzCase:
        steps = []
        for s in data["steps"]:
            reqs = tuple(
                FuzzRequest(**{**r, "prompt_ids": tuple(r["prompt_ids"]), "eos_token_ids": tuple(r["eos_token_ids"])})
                for r in s["requests"]
            )  # fmt: skip
            extra = {k: s[k] for k in ("generation", "options", "paused") if k in s}
            steps.append(Step(s["kind"], reqs, s.get("staggered", False), s.get("seed", 0), **extra))
        fields = {k: data[k] for k in ("engine", "model", "persistent", "config", "generation", "caller_training")}
        return FuzzCase(**fields, steps=tuple(steps), entry=data.get("entry", "manager"),
                        caller_attn=data.get("caller_attn"))  # fmt: skip

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)
