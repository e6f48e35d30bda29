"""Benchmark workloads: GRPO-shaped batches of ``RolloutRequest`` (``num_prompts`` prompts x ``N`` generations each).

- ``gsm8k-like``: prompt and completion lengths drawn from clipped lognormals (long right tail). Completions end at a
  per-request length: the requests carry ``max_new_tokens = L_i`` and no EOS, so a random-weight model stops exactly
  there in the engines that take per-request lengths (``cb_impl``, the transformers CB manager). ``generate()`` takes
  one ``max_new_tokens`` for the batch, so it runs every row to ``max(L_i)`` and we cut row ``i`` at ``L_i`` -- the
  same compute as a row that emitted EOS at ``L_i`` and was padded afterwards (its padding waste).
- ``uniform``: every completion runs to the workload's ``max_new_tokens`` (no EOS): the no-waste case for padding.
- ``arith``: the bundled ``tiny-llama-arith`` on ``reference.tasks`` prompts, natural EOS, capped at 128 tokens.

Length assumptions (no dataset access offline, so these are stated assumptions, not fits): a GSM8K question is ~45
words (~60 Llama-3 tokens) and a chat template adds ~40, so the CUDA prompt median is 100 tokens (sigma 0.3); chain-of-
thought answers of a 1B instruct model have a median of ~160 tokens with a long right tail up to
``max_completion_length`` (sigma 0.55, cap 512). The CPU sizes halve both medians and cap completions at 192 so the
full CPU run fits ~10 minutes on 2 cores. Override any of them from the CLI (``--prompt-median`` ...).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, replace

from reference import tasks
from reference.spec import RolloutRequest, SamplingParams

WORKLOADS = ("gsm8k-like", "uniform", "arith")
SPECIAL_IDS = 3  # ids 0..2 are pad/bos/eos in every bench model; random prompts avoid them


@dataclass(frozen=True, slots=True)
class LengthDist:
    """``clip(round(median * exp(sigma * z)), lo, hi)`` with ``z ~ N(0, 1)``; ``sigma == 0`` gives the constant."""

    median: int
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.median <= self.hi:
            raise ValueError(f"need 1 <= lo <= median <= hi, got lo={self.lo} median={self.median} hi={self.hi}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma must be finite and >= 0, got {self.sigma}")

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return [min(self.hi, max(self.lo, round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))))
                for _ in range(n)]  # fmt: skip

    def mean(self) -> float:
        """The clipped mean, by a fixed-seed Monte Carlo of 20k draws (a priori: independent of any run's seed)."""
        return _monte_carlo_mean(self)


@functools.lru_cache(maxsize=256)
def _monte_carlo_mean(dist: LengthDist) -> float:
    draws = dist.sample(random.Random(0), 20_000)
    return sum(draws) / len(draws)


@dataclass(frozen=True, slots=True)
class Workload:
    """One benchmark batch: ``num_prompts`` prompts, each repeated ``num_generations`` times (a GRPO group)."""

    name: str
    num_prompts: int
    num_generations: int
    prompt_len: LengthDist
    completion_len: LengthDist | None  # None: natural EOS (arith), capped at max_new_tokens
    max_new_tokens: int
    temperature: float = 1.0  # TRL's default; 0 makes every engine greedy (token-equality check)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        if self.num_prompts < 1 or self.num_generations < 1:
            raise ValueError(f"need num_prompts >= 1 and num_generations >= 1, got {self.num_prompts}, "
                             f"{self.num_generations}")  # fmt: skip
        if self.completion_len is not None and self.completion_len.hi > self.max_new_tokens:
            raise ValueError(
                f"completion lengths reach {self.completion_len.hi} > max_new_tokens {self.max_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def num_requests(self) -> int:
        return self.num_prompts * self.num_generations

    @property
    def natural_eos(self) -> bool:
        return self.completion_len is None


# Sizes per device; the CPU ones keep `cbverify bench` within ~10 minutes on 2 cores (bench/README.md).
_SIZES: dict[str, dict[str, dict]] = {
    "cpu": {
        "gsm8k-like": dict(num_prompts=2, prompt_len=LengthDist(50, 0.3, 16, 128),
                           completion_len=LengthDist(64, 0.55, 8, 192), max_new_tokens=192),
        "uniform": dict(num_prompts=1, prompt_len=LengthDist(50, 0.3, 16, 128),
                        completion_len=LengthDist(64, 0.0, 64, 64), max_new_tokens=64),
        "arith": dict(num_prompts=4, prompt_len=LengthDist(1, 0.0, 1, 1), completion_len=None, max_new_tokens=128),
    },
    "cuda": {
        "gsm8k-like": dict(num_prompts=8, prompt_len=LengthDist(100, 0.3, 32, 300),
                           completion_len=LengthDist(160, 0.55, 16, 512), max_new_tokens=512),
        "uniform": dict(num_prompts=8, prompt_len=LengthDist(100, 0.3, 32, 300),
                        completion_len=LengthDist(256, 0.0, 256, 256), max_new_tokens=256),
        "arith": dict(num_prompts=16, prompt_len=LengthDist(1, 0.0, 1, 1), completion_len=None, max_new_tokens=128),
    },
}  # fmt: skip


def make_workload(name: str, num_generations: int, *, device: str = "cpu", **overrides) -> Workload:
    """The documented default sizes for ``device`` (``cpu`` or ``cuda``), with any field overridden."""
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    if name not in _SIZES[kind]:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
    return replace(Workload(name=name, num_generations=num_generations, **_SIZES[kind][name]), **overrides)


def make_requests(workload: Workload, *, vocab_size: int) -> list[RolloutRequest]:
    """The batch in GRPO order (prompt p's N generations are contiguous), fully determined by ``workload.seed``.

    Random-prompt workloads draw ids in ``[3, vocab_size)``; arith uses ``reference.tasks`` problems with EOS.
    """
    rng = random.Random(workload.seed)
    if workload.natural_eos:
        prompts = [tasks.prompt_ids(p) for p in tasks.make_problems(workload.num_prompts, seed=workload.seed)]
        lengths = [workload.max_new_tokens] * workload.num_requests
        eos: tuple[int, ...] = (tasks.EOS_ID,)
    else:
        if vocab_size <= SPECIAL_IDS:
            raise ValueError(f"vocab_size must exceed {SPECIAL_IDS}, got {vocab_size}")
        prompt_lens = workload.prompt_len.sample(rng, workload.num_prompts)
        prompts = [
            [tasks.BOS_ID] + [rng.randrange(SPECIAL_IDS, vocab_size) for _ in range(n - 1)] for n in prompt_lens
        ]
        lengths = workload.completion_len.sample(rng, workload.num_requests)
        eos = ()
    requests = []
    for p, prompt in enumerate(prompts):
        for g in range(workload.num_generations):
            i = p * workload.num_generations + g
            sampling = SamplingParams(temperature=workload.temperature, max_new_tokens=lengths[i])
            requests.append(RolloutRequest(f"p{p}-g{g}", tuple(prompt), sampling, seed=workload.seed * 1_000_003 + i,
                                           eos_token_ids=eos))  # fmt: skip
    return requests


def kv_budget_tokens(workload: Workload, requests: list[RolloutRequest], *, headroom: float) -> int:
    """The KV token budget we give ``cb_impl``: every distinct prompt once plus ``headroom`` x the *a-priori* mean
    completion length per request (the distribution's mean, not this batch's realised lengths; the cap for arith).

    A real trainer does not know the lengths in advance either; when the batch needs more, the engine preempts.
    """
    if headroom <= 0:
        raise ValueError(f"headroom must be > 0, got {headroom}")
    unique_prompt_tokens = sum(len(p) for p in {r.prompt_ids for r in requests})
    mean_len = workload.max_new_tokens if workload.natural_eos else workload.completion_len.mean()
    return math.ceil(unique_prompt_tokens + headroom * mean_len * len(requests))
