"""Requests the conformance properties draw: GRPO groups (one prompt, several samples with distinct seeds) of
arithmetic prompts from the bundled task, every sampling option alone and combined, one or two EOS ids."""

from __future__ import annotations

from hypothesis import strategies as st

from reference import tasks
from reference.spec import RolloutRequest, SamplingParams

TEMPERATURES = (0.0, 0.6, 1.0, 1.4)


@st.composite
def samplings(draw, *, greedy: bool | None = None, max_new_tokens: int = 8) -> SamplingParams:
    temperature = 0.0 if greedy else draw(st.sampled_from(TEMPERATURES[1:] if greedy is False else TEMPERATURES))
    if temperature == 0.0:
        return SamplingParams(temperature=0.0, max_new_tokens=draw(st.integers(1, max_new_tokens)))
    return SamplingParams(
        temperature=temperature, top_k=draw(st.sampled_from([0, 0, 3, 10])), top_p=draw(st.sampled_from([1.0, 0.9])),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.05])), max_new_tokens=draw(st.integers(1, max_new_tokens)),
    )  # fmt: skip


@st.composite
def request_groups(draw, *, greedy: bool | None = None, max_groups: int = 3, max_group: int = 3):
    """1-``max_groups`` groups of 1-``max_group`` requests; ids unique, seeds distinct within a group."""
    out = []
    for g in range(draw(st.integers(1, max_groups))):
        problem = tasks.make_problems(1, seed=draw(st.integers(0, 2**16)), max_terms=draw(st.integers(2, 4)))[0]
        eos = draw(st.sampled_from([(tasks.EOS_ID,), (tasks.EOS_ID, tasks.VOCAB["\n"])]))
        sampling = draw(samplings(greedy=greedy))
        seed = draw(st.integers(0, 2**31 - 1000))
        for m in range(draw(st.integers(1, max_group))):
            out.append(RolloutRequest(f"g{g}-m{m}", tuple(tasks.prompt_ids(problem)), sampling, seed + m, eos))
    return out
