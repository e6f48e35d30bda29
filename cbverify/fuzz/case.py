"""A fuzz case as plain data: the engine configuration and the program of calls, serialisable to JSON.

A :class:`FuzzCase` is what the fuzzer draws, what a failure is shrunk over and what a repro script replays.
``config`` holds the engine's own configuration (transformers CB: ``ContinuousBatchingConfig`` fields; cb_impl:
``EngineConfig`` fields; hf-generate: adapter options) and ``generation`` the manager-wide generation options a user
puts in the ``GenerationConfig`` (``do_sample``, ``min_new_tokens``, ``repetition_penalty``, ``min_p``).
Requests carry what a user passes per request: transformers CB's per-request ``temperature`` / ``top_k`` /
``top_p`` keyword arguments are passed as drawn (``top_k=0`` included), never translated.

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

    def sampling(self, generation: dict) -> SamplingParams:
        """The oracle's reading of the request: ``top_k=0`` means "no top-k", as in a ``GenerationConfig``."""
        greedy = self.temperature == 0.0 or not generation.get("do_sample", True)
        return SamplingParams(
            temperature=0.0 if greedy else self.temperature, top_k=0 if greedy else (self.top_k or 0),
            top_p=1.0 if greedy or self.top_p is None else self.top_p,
            min_p=0.0 if greedy else float(generation.get("min_p") or 0.0), max_new_tokens=self.max_new_tokens,
        )  # fmt: skip

    def rollout_request(self, generation: dict) -> RolloutRequest:
        sampling = self.sampling(generation)
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
