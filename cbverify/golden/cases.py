"""The golden cases: bundled model x dtype x device class x sampling configuration x prompt set.

Contract: a :class:`GoldenCase` fully determines the requests it generates (:meth:`GoldenCase.requests`), so a record
made from it can be re-derived and checked anywhere. Its ``name`` is the record's file stem; the record lives at
``golden/records/<device_class>/<name>.json`` (:func:`record_path`). Changing anything in a case definition makes its
record stale: :func:`cbverify.golden.check.check_case` refuses a record whose stored case differs from the current one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

from cbverify import data
from reference import tasks
from reference.models import BUNDLED, DTYPES, load_tokenizer, resolve
from reference.spec import RolloutRequest, SamplingParams

RECORDS_DIR = data.path("records")  # golden/records in a checkout, the installed copy otherwise

SAMPLINGS: dict[str, SamplingParams] = {
    # greedy: no processors; tokens are argmax, log-probs plain log_softmax.
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=48),
    # sampled at T=1 with both top-k and top-p biting: on the random Qwen2 (near-uniform over 32 tokens) top-k=5 then
    # top-p=0.8 keeps ~4 tokens, while top-p first would keep ~26 and then top-k 5, so processor order is visible.
    "sampled": SamplingParams(temperature=1.0, top_k=5, top_p=0.8, max_new_tokens=48),
}


# Every bundled model: those whose tokenizer is the arithmetic task's are asked the task's character ids, a chat
# checkpoint the same problems as chats through its own template (:func:`prompt_set_for`).
GOLDEN_MODELS = BUNDLED


@dataclass(frozen=True, slots=True)
class PromptSet:
    """Fixed prompts: ``reference.tasks.make_problems(num, seed=seed, max_terms=max_terms)`` as the task's character
    ids, stopping on the task's EOS; request ``i`` gets sampling seed ``request_seed + i``."""

    name: str
    num: int
    seed: int
    max_terms: int
    request_seed: int

    def __post_init__(self) -> None:
        if self.num < 1:
            raise ValueError(f"prompt set {self.name!r}: num must be >= 1, got {self.num}")
        if not 2 <= self.max_terms <= 8:
            raise ValueError(f"prompt set {self.name!r}: max_terms must be in [2, 8], got {self.max_terms}")

    def problems(self) -> list[tasks.ArithProblem]:
        return tasks.make_problems(self.num, seed=self.seed, max_terms=self.max_terms)

    def prompts(self, model: str) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
        """``(prompt ids per problem, EOS ids)`` for ``model``: the task's character ids and its EOS."""
        return [tuple(tasks.prompt_ids(p)) for p in self.problems()], (tasks.EOS_ID,)

    def fits(self, model: str) -> bool:
        """Whether ``model`` reads these prompts as meant: its tokenizer is the task's."""
        return _tokenizer(model).get_vocab() == tasks.VOCAB


@dataclass(frozen=True, slots=True)
class ChatPromptSet(PromptSet):
    """The same problems asked in a chat: the user turn ``What is 12+7+33?`` rendered by the checkpoint's own chat
    template with the generation prompt (as ``cbverify verify`` and TRL tokenise a conversation), stopping on any
    of the checkpoint's EOS ids (``generation_config.json``: a chat model ends a turn and a document differently)."""

    def prompts(self, model: str) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
        tokenizer = _tokenizer(model)
        chats = [[{"role": "user", "content": f"What is {'+'.join(map(str, p.terms))}?"}] for p in self.problems()]
        rendered = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
                    for chat in chats]  # fmt: skip
        return [tuple(ids) for ids in rendered], _eos_ids(model)

    def fits(self, model: str) -> bool:
        return bool(getattr(_tokenizer(model), "chat_template", None))


@cache
def _tokenizer(model: str):
    return load_tokenizer(resolve(model))


@cache
def _eos_ids(model: str) -> tuple[int, ...]:
    """The checkpoint's EOS ids as ``generation_config.json`` lists them (``config.json``'s when it has none)."""
    import json

    path = resolve(model)
    for name in ("generation_config.json", "config.json"):
        eos = json.loads((path / name).read_text()).get("eos_token_id") if (path / name).is_file() else None
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (eos,)
    raise ValueError(f"{model}: no eos_token_id in generation_config.json or config.json")


PROMPT_SETS: dict[str, PromptSet] = {
    # 4 short problems (2-4 terms): completions of ~10-30 tokens, so every case stays well under a second per engine.
    "arith4": PromptSet(name="arith4", num=4, seed=20261130, max_terms=4, request_seed=1000),
    # the same 4 problems as chats, for a checkpoint with a chat template (tiny-qwen3-chat)
    "chat4": ChatPromptSet(name="chat4", num=4, seed=20261130, max_terms=4, request_seed=1000),
}


def prompt_set_for(model: str) -> str:
    """The prompt set a bundled model's golden cases use: the first of :data:`PROMPT_SETS` that fits it."""
    fitting = [name for name, ps in PROMPT_SETS.items() if ps.fits(model)]
    if not fitting:
        raise ValueError(f"{model}: no golden prompt set fits its tokenizer ({', '.join(PROMPT_SETS)})")
    return fitting[0]


@dataclass(frozen=True, slots=True)
class GoldenCase:
    """One golden: a bundled model in one dtype, one sampling configuration, one prompt set (one that fits the
    model's tokenizer: :meth:`PromptSet.fits`).

    ``trajectory_steps > 0`` also records that many steps of ``reference.train`` (loss, grad norm, mean reward).
    """

    model: str
    dtype: str
    sampling: str
    prompt_set: str = "arith4"
    trajectory_steps: int = 0

    def __post_init__(self) -> None:
        if self.model not in GOLDEN_MODELS:
            raise ValueError(f"model must be one of {', '.join(GOLDEN_MODELS)}, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {self.sampling!r}")
        if self.prompt_set not in PROMPT_SETS:
            raise ValueError(f"prompt_set must be one of {', '.join(PROMPT_SETS)}, got {self.prompt_set!r}")
        if not PROMPT_SETS[self.prompt_set].fits(self.model):
            raise ValueError(f"prompt set {self.prompt_set!r} does not fit {self.model}'s tokenizer; use "
                             f"{prompt_set_for(self.model)!r}")  # fmt: skip
        if self.trajectory_steps < 0:
            raise ValueError(f"trajectory_steps must be >= 0, got {self.trajectory_steps}")

    @property
    def name(self) -> str:
        return f"{self.model}.{self.dtype}.{self.sampling}.{self.prompt_set}"

    @property
    def sampling_params(self) -> SamplingParams:
        return SAMPLINGS[self.sampling]

    @property
    def trainer_temperature(self) -> float:
        """Temperature of the trainer-side log-probs: the sampling temperature, 1.0 for greedy (TRL's default)."""
        return self.sampling_params.temperature or 1.0

    def requests(self) -> list[RolloutRequest]:
        ps = PROMPT_SETS[self.prompt_set]
        prompts, eos = ps.prompts(self.model)
        return [
            RolloutRequest(f"{self.prompt_set}-{i}", prompt, self.sampling_params, seed=ps.request_seed + i,
                           eos_token_ids=eos)
            for i, prompt in enumerate(prompts)
        ]  # fmt: skip

    def describe(self) -> dict:
        """The JSON form stored in a record: the case fields plus the resolved sampling and prompt set."""
        return {
            **asdict(self),
            "name": self.name,
            "sampling_params": asdict(self.sampling_params),
            "prompt_set_params": asdict(PROMPT_SETS[self.prompt_set]),
        }


def bf16_supported(device: str | torch.device) -> bool:
    """Whether bfloat16 matmuls run on ``device`` (CPU: a tiny matmul is tried; CUDA: ``is_bf16_supported``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        x = torch.ones((2, 2), dtype=torch.bfloat16, device=device)
        return bool(torch.isfinite((x @ x).float()).all())
    except RuntimeError:
        return False


def all_cases(device: str | torch.device = "cpu") -> list[GoldenCase]:
    """Every case for ``device``: every bundled model (on its prompt set) x (float32, bfloat16 where supported) x
    both samplings.

    The 5-step GRPO trajectory rides on the Llama float32 sampled case (GRPO samples at T=1).
    """
    dtypes = ["float32"] + (["bfloat16"] if bf16_supported(device) else [])
    cases = []
    for model in GOLDEN_MODELS:
        for dtype in dtypes:
            for sampling in SAMPLINGS:
                steps = 5 if (model, dtype, sampling) == ("tiny-llama-arith", "float32", "sampled") else 0
                cases.append(GoldenCase(model, dtype, sampling, prompt_set_for(model), trajectory_steps=steps))
    return cases


def select(names: list[str] | None, device: str | torch.device = "cpu") -> list[GoldenCase]:
    """The cases named (exact names or substrings, e.g. ``qwen2`` or ``float32.greedy``); all when ``names`` is empty.

    Raises ``ValueError`` naming the available cases when a pattern matches nothing.
    """
    cases = all_cases(device)
    if not names:
        return cases
    chosen: list[GoldenCase] = []
    for pattern in names:
        hits = [c for c in cases if c.name == pattern] or [c for c in cases if pattern in c.name]
        if not hits:
            raise ValueError(f"no golden case matches {pattern!r}; cases: {', '.join(c.name for c in cases)}")
        chosen += [c for c in hits if c not in chosen]
    return chosen


def record_path(case: GoldenCase, device_class: str, root: Path = RECORDS_DIR) -> Path:
    return root / device_class / f"{case.name}.json"
