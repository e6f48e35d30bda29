"""What the conformance properties draw: GRPO groups (one prompt, several samples with distinct seeds) of arithmetic
prompts from the bundled task, every sampling option alone and combined, one or two EOS ids; and the sizes an engine
is built with (:func:`sizings`, from the options it declares in ``Capabilities.sizing``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hypothesis import strategies as st

from cbverify.engines import SizingOption, pressure_sizes
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


def _clamp(value: int, option: SizingOption) -> int:
    return min(max(value, option.min), option.max)


def _from(tight: int, roomy: int, option: SizingOption):
    """The tight value itself half the time (a plain integer range would rarely land on it), else a value from the
    tight one up to a roomy one, both kept inside the option's declared range."""
    lo, hi = _clamp(tight, option), _clamp(roomy, option)
    return st.one_of(st.just(lo), st.integers(lo, max(lo, hi)))


@st.composite
def sizings(draw, declared: Sequence[SizingOption], requests: Sequence, fixed: Mapping[str, object] = {}) -> dict:  # noqa: B006
    """Values for the sizing options an engine declares, for a run of ``requests``: ``{option name: value}``, each in
    its declared range. Options in ``fixed`` (the user's own) are not drawn; a fixed block size still sizes the KV
    blocks drawn.

    Half the time every option is at the pressure point together, as ``cbverify verify``'s pressure rows put them
    (:func:`pressure_sizes`): the smallest block, the fewest KV blocks that still hold the longest request alone plus
    one, a step budget of half the longest prompt and every request running at once, so that prompts are prefilled
    in chunks while the requests compete for blocks and some are preempted or evicted (each alone is not enough: a
    one-token step budget, say, decodes one request at a time and never fills the cache). Otherwise each option is
    drawn on its own, at its tight end half the time (the smallest block, that fewest KV blocks, the smallest step
    budget: a step of partial prefills only, one sequence at a time), else up to what the whole workload needs at
    once.
    """
    by_role = {o.role: o for o in declared}
    longest = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    pressure = draw(st.booleans())
    out: dict = {}
    block = None
    if (o := by_role.get("block_size")) is not None:
        block = fixed[o.name] if o.name in fixed else o.min if pressure else draw(_from(o.min, longest, o))
        if o.name not in fixed:
            out[o.name] = block
    if (o := by_role.get("kv_blocks")) is not None and o.name not in fixed and isinstance(block, int):
        tight, _ = pressure_sizes(requests, block)
        roomy = sum(-(-(len(r.prompt_ids) + r.sampling.max_new_tokens) // block) + 1 for r in requests)
        out[o.name] = _clamp(tight, o) if pressure else draw(_from(tight, roomy, o))
    if (o := by_role.get("batch_tokens")) is not None and o.name not in fixed:
        _, budget = pressure_sizes(requests, 1)
        out[o.name] = _clamp(budget, o) if pressure else draw(_from(o.min, prompt_tokens + len(requests), o))
    if (o := by_role.get("num_seqs")) is not None and o.name not in fixed:
        out[o.name] = _clamp(len(requests), o) if pressure else draw(_from(o.min, len(requests), o))
    return out
