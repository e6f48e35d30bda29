"""Hypothesis strategies: plural-noun ``@st.composite`` functions with keyword-only bounds (DESIGN §7).

Every model-backed property draws its scenario from here, so a failing example prints as a complete repro.
"""

from __future__ import annotations

from hypothesis import strategies as st

from reference import tasks
from reference.spec import MAX_SEED, RolloutRequest, SamplingParams


@st.composite
def sampling_params(
    draw,
    *,
    greedy: bool | None = None,
    max_new_tokens: tuple[int, int] = (1, 24),
    processors: bool = True,
) -> SamplingParams:
    """Greedy or sampled parameters; with ``processors`` also top-k / top-p / min-p in their valid ranges."""
    is_greedy = draw(st.booleans()) if greedy is None else greedy
    temperature = 0.0 if is_greedy else draw(st.sampled_from([0.3, 0.7, 1.0, 1.5]))
    top_k = draw(st.sampled_from([0, 0, 1, 3, 10])) if processors else 0
    top_p = draw(st.sampled_from([1.0, 1.0, 0.95, 0.8, 0.5])) if processors else 1.0
    min_p = draw(st.sampled_from([0.0, 0.0, 0.05, 0.2])) if processors else 0.0
    return SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        max_new_tokens=draw(st.integers(*max_new_tokens)),
    )  # fmt: skip


@st.composite
def prompt_ids_lists(draw, *, min_len: int = 1, max_len: int = 40, arith: bool | None = None) -> list[int]:
    """A prompt: either an arithmetic question (BOS + text) or arbitrary in-vocabulary character ids."""
    use_arith = draw(st.booleans()) if arith is None else arith
    if use_arith:
        problem = tasks.make_problems(1, seed=draw(st.integers(0, 10**6)))[0]
        ids = tasks.prompt_ids(problem)
        return ids[:max_len] if len(ids) > max_len else ids
    body = draw(st.lists(st.integers(3, len(tasks.VOCAB) - 1), min_size=max(0, min_len - 1), max_size=max_len - 1))
    return [tasks.BOS_ID, *body]


@st.composite
def rollout_requests(
    draw,
    *,
    min_requests: int = 1,
    max_requests: int = 6,
    max_prompt_len: int = 40,
    max_new_tokens: tuple[int, int] = (1, 24),
    greedy: bool | None = None,
    processors: bool = True,
    group_size: tuple[int, int] = (1, 1),
) -> list[RolloutRequest]:
    """A batch of requests with unique ids; each prompt is repeated ``group_size`` times (a GRPO group) with
    distinct seeds. Per-request sampling parameters, seeds and EOS sets vary."""
    num_prompts = draw(st.integers(min_requests, max_requests))
    requests: list[RolloutRequest] = []
    for p in range(num_prompts):
        prompt = draw(prompt_ids_lists(max_len=max_prompt_len))
        for g in range(draw(st.integers(*group_size))):
            eos = draw(st.sampled_from([(tasks.EOS_ID,), (tasks.EOS_ID,), (tasks.EOS_ID, tasks.VOCAB["\n"]), ()]))
            requests.append(
                RolloutRequest(
                    request_id=f"p{p}-g{g}",
                    prompt_ids=tuple(prompt),
                    sampling=draw(sampling_params(greedy=greedy, max_new_tokens=max_new_tokens, processors=processors)),
                    seed=draw(st.integers(0, MAX_SEED)),
                    eos_token_ids=eos,
                )
            )
    return requests
