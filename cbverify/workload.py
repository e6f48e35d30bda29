"""What ``cbverify verify`` asks every engine: a GRPO-shaped workload, drawn deterministically from ``--seed``.

Prompts: the user's file (:mod:`cbverify.prompts`), else the bundled arithmetic problems for a checkpoint with the
arithmetic task's tokenizer, else the built-in natural-language set (conversations included where the tokenizer has a
chat template). Per prompt: one greedy request and a GRPO group of ``group_size`` samples sharing the prompt, each
member with its own seed. Sampling: the GRPO recipe's for every group (:mod:`cbverify.grpo_config`, its
``num_generations`` as the group size), else :data:`SPREAD`, rotated over the prompts, so temperatures below and
above 1 and each processor (top-k, top-p, min-p) alone and combined are all exercised. Every third prompt gets a
quarter of the completion budget, so some requests stop on EOS and others hit ``max_new_tokens``. Every request
carries all of the checkpoint's EOS ids (TRL stops on any of them). ``probes`` (the default) says that ``verify``
adds the mechanism probes of :mod:`cbverify.mechanisms` to these requests (they need the model and the oracle).
"""

from __future__ import annotations

from dataclasses import dataclass

from cbverify.checkpoint import Checkpoint
from cbverify.prompts import Prompt, builtin_prompts, load_prompts, token_ids
from reference import tasks
from reference.spec import RolloutRequest, SamplingParams

SPREAD = (
    SamplingParams(temperature=1.0, top_k=10, top_p=0.95),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.4, top_k=10),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.6, min_p=0.1),
    SamplingParams(temperature=1.4, top_k=20, top_p=0.9, min_p=0.05),
)
DEFAULT_GROUP_SIZE = 4


@dataclass(frozen=True, slots=True)
class Workload:
    requests: tuple[RolloutRequest, ...]
    prompt_source: str  # "arithmetic", "built-in" or the file's path
    samplings: tuple[SamplingParams, ...]  # the distinct sampled configurations used
    group_size: int
    num_prompts: int
    probes: bool = True  # verify adds the mechanism probes (cbverify.mechanisms) to ``requests``

    @property
    def longest_prompt(self) -> int:
        return max(len(r.prompt_ids) for r in self.requests)


def prompt_token_ids(ckpt: Checkpoint, prompts_file: str | None, num_prompts: int, seed: int) -> tuple[list, str]:
    """``(token id lists, source)`` of up to ``num_prompts`` prompts (see the module docstring)."""
    if prompts_file is None and ckpt.arithmetic:
        problems = tasks.make_problems(num_prompts, seed=seed, max_terms=4)
        return [tasks.prompt_ids(p) for p in problems], "arithmetic"
    chat = bool(getattr(ckpt.tokenizer, "chat_template", None))
    prompts: list[Prompt] = load_prompts(prompts_file) if prompts_file else _interleaved(builtin_prompts(
        conversational=chat))  # fmt: skip
    return [token_ids(p, ckpt.tokenizer) for p in prompts[:num_prompts]], prompts_file or "built-in"


def _interleaved(prompts: list[Prompt]) -> list[Prompt]:
    """Standard and conversational prompts alternating, so the first few already include both kinds."""
    standard = [p for p in prompts if not p.conversational]
    chat = [p for p in prompts if p.conversational]
    out = []
    for i in range(max(len(standard), len(chat))):
        out += standard[i : i + 1] + chat[i : i + 1]
    return out


def build_workload(
    ckpt: Checkpoint,
    *,
    prompts_file: str | None,
    num_prompts: int,
    seed: int,
    max_new_tokens: int,
    sampled: SamplingParams | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    eos_token_ids: tuple[int, ...] | None = None,
    probes: bool = True,
) -> Workload:
    """The requests (see the module docstring); ``sampled`` (a recipe's sampling) replaces :data:`SPREAD`.
    ``ValueError`` before any model work when a prompt plus its budget exceeds the checkpoint's context, or a prompt
    token lies outside the model's vocabulary."""
    ids_list, source = prompt_token_ids(ckpt, prompts_file, num_prompts, seed)
    for i, ids in enumerate(ids_list):
        outside = sorted({t for t in ids if ckpt.vocab_size is not None and not 0 <= t < ckpt.vocab_size})
        if outside:  # a tokenizer with more tokens than the model's embedding has rows
            raise ValueError(f"prompt {i} ({source}) has token ids {outside[:5]} outside the model's vocabulary of "
                             f"{ckpt.vocab_size}")  # fmt: skip
    if ckpt.context_length is not None:
        for i, ids in enumerate(ids_list):
            if len(ids) + max_new_tokens > ckpt.context_length:
                raise ValueError(f"prompt {i} ({source}) has {len(ids)} tokens; with --max-new-tokens "
                                 f"{max_new_tokens} it exceeds the context of {ckpt.context_length}")  # fmt: skip
    eos = ckpt.eos_token_ids if eos_token_ids is None else eos_token_ids
    spread = (sampled,) if sampled is not None else SPREAD
    requests, used = [], []
    for i, ids in enumerate(ids_list):
        budget = max(1, max_new_tokens // 4) if i % 3 == 2 else max_new_tokens
        greedy = SamplingParams(temperature=0.0, max_new_tokens=budget)
        requests.append(RolloutRequest(f"q{i}-greedy", ids, greedy, seed=seed * 1000 + i, eos_token_ids=eos))
        s = spread[(i + seed) % len(spread)]
        s = SamplingParams(s.temperature, s.top_k, s.top_p, s.min_p, budget)
        used += [s] if s not in used else []
        for g in range(group_size):
            member_seed = seed * 1000 + i + g * 1_000_003  # distinct per member, reproducible from --seed
            requests.append(RolloutRequest(f"q{i}-g{g}", ids, s, seed=member_seed, eos_token_ids=eos))
    return Workload(tuple(requests), source, tuple(used), group_size, len(ids_list), probes)
