"""What ``cbverify verify`` asks every engine: prompts as token ids, each once greedy and as a group of samples.

Prompts: the user's file (:mod:`cbverify.prompts`), else the bundled arithmetic problems for a checkpoint with the
arithmetic task's tokenizer, else the built-in natural-language set (conversations included where the tokenizer has a
chat template). Sampling: the GRPO recipe's (:mod:`cbverify.grpo_config`, its ``num_generations`` as the group size)
or the default T=1, top-k 10, top-p 0.95, one sample per prompt. Every request carries the checkpoint's EOS ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from cbverify.checkpoint import Checkpoint
from cbverify.prompts import Prompt, builtin_prompts, load_prompts, token_ids
from reference import tasks
from reference.spec import RolloutRequest, SamplingParams

DEFAULT_SAMPLING = SamplingParams(temperature=1.0, top_k=10, top_p=0.95)


@dataclass(frozen=True, slots=True)
class Workload:
    requests: tuple[RolloutRequest, ...]
    prompt_source: str  # "arithmetic", "built-in" or the file's path
    sampled: SamplingParams
    group_size: int


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
    sampled: SamplingParams = DEFAULT_SAMPLING,
    group_size: int = 1,
    eos_token_ids: tuple[int, ...] | None = None,
) -> Workload:
    """Per prompt: one greedy request and ``group_size`` sampled ones with distinct seeds. ``ValueError`` before any
    model work when a prompt plus ``max_new_tokens`` exceeds the checkpoint's context."""
    ids_list, source = prompt_token_ids(ckpt, prompts_file, num_prompts, seed)
    if ckpt.context_length is not None:
        for i, ids in enumerate(ids_list):
            if len(ids) + max_new_tokens > ckpt.context_length:
                raise ValueError(f"prompt {i} ({source}) has {len(ids)} tokens; with --max-new-tokens "
                                 f"{max_new_tokens} it exceeds the context of {ckpt.context_length}")  # fmt: skip
    eos = ckpt.eos_token_ids if eos_token_ids is None else eos_token_ids
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    sampled = SamplingParams(sampled.temperature, sampled.top_k, sampled.top_p, sampled.min_p, max_new_tokens)
    requests = []
    for i, ids in enumerate(ids_list):
        requests.append(RolloutRequest(f"q{i}-greedy", ids, greedy, seed=seed * 1000 + i, eos_token_ids=eos))
        for g in range(group_size):
            rid = f"q{i}-sampled" if group_size == 1 else f"q{i}-sampled{g}"
            member_seed = seed * 1000 + i + g * 1_000_003  # member 0 keeps the single-sample seed
            requests.append(RolloutRequest(rid, ids, sampled, seed=member_seed, eos_token_ids=eos))
    return Workload(tuple(requests), source, sampled, group_size)
