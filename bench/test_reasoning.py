"""The reasoning-length GRPO workload (``cbverify.bench.reasoning``): the lengths it states are the lengths its model
produces. Default run: the length formulas against the distribution's own sums, the built model against them."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from cbverify.bench import reasoning
from reference.models import load_tokenizer, resolve
from reference.spec import RolloutRequest, SamplingParams


@given(hazard=st.floats(0.002, 0.3), cap=st.integers(1, 600))
def test_the_stated_lengths_are_those_of_the_capped_geometric(hazard: float, cap: int):
    """Independent path: the probability of each length of ``min(Geometric(hazard), cap)`` summed term by term."""
    pmf = [(1 - hazard) ** (k - 1) * hazard for k in range(1, cap)] + [(1 - hazard) ** (cap - 1)]
    cdf = [sum(pmf[: k + 1]) for k in range(cap)]
    got = reasoning.expected_lengths(hazard, cap)
    assert got["mean"] == pytest.approx(sum(k * p for k, p in enumerate(pmf, start=1)), rel=1e-9)
    assert got["cut_share"] == pytest.approx((1 - hazard) ** cap, rel=1e-9)  # no EOS among the cap tokens
    median = next(k for k, c in enumerate(cdf, start=1) if c >= 0.5 - 1e-12)
    if median < cap:  # a median beyond the cap reads as the cap
        assert got["median"] == median


@pytest.fixture(scope="module")
def built():
    tokenizer = load_tokenizer(resolve(reasoning.TOKENIZER))
    return reasoning.build_model(tokenizer), tokenizer


def test_the_models_eos_probability_is_the_calibrated_hazard_at_every_position(built):
    """Held-out random sequences: the mean EOS probability is the hazard, early positions as late ones (the anchor
    channel, not the context, sets it), so lengths are geometric and not shaped by position."""
    model, tokenizer = built
    eos = tokenizer.eos_token_id
    ids = torch.randint(0, eos, (8, 320), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        p = model(input_ids=ids).logits.log_softmax(-1)[..., eos].exp()  # (8, 320)
    assert float(p.mean()) == pytest.approx(reasoning.HAZARD, rel=0.02)
    early, late = float(p[:, :32].mean()), float(p[:, -32:].mean())
    assert early == pytest.approx(late, rel=0.1), (early, late)


def test_sampled_completions_have_the_lengths_the_workload_states(built):
    """128 completions sampled as TRL samples (temperature 1, no top-k/top-p, up to 256 tokens) pass a
    Kolmogorov-Smirnov test against ``min(Geometric(HAZARD), 256)`` at alpha 0.001 (critical D ~1.95 / sqrt(n);
    conservative for a discrete law). A model whose hazard were half or twice the stated one fails it (D ~0.3)."""
    model, tokenizer = built
    cap = reasoning.MAX_COMPLETION
    sampling = SamplingParams(temperature=1.0, max_new_tokens=cap)
    requests = [RolloutRequest(f"r{i}", tuple(tokenizer(prompt)["input_ids"]), sampling, 100 + i,
                               (tokenizer.eos_token_id,))
                for k, prompt in enumerate(reasoning.prompts(2)) for i in range(64 * k, 64 * (k + 1))]  # fmt: skip
    lengths = [len(r.completion_ids) for r in LLMEngine(model, EngineConfig(max_num_seqs=128)).generate(requests)]
    h = reasoning.HAZARD

    def cdf(k: int) -> float:  # P(min(L, cap) <= k)
        return 1.0 if k >= cap else 1 - (1 - h) ** k

    n = len(lengths)
    sorted_lengths = sorted(lengths)
    d = max(max(abs((i + 1) / n - cdf(x)), abs(i / n - cdf(x - 1))) for i, x in enumerate(sorted_lengths))
    assert d < 1.95 / math.sqrt(n), (d, sorted_lengths[::8])


def test_prompts_are_reproducible_question_like_and_of_the_stated_word_counts():
    a, b = reasoning.prompts(20, seed=3), reasoning.prompts(20, seed=3)
    assert a == b and a != reasoning.prompts(20, seed=4)
    median, _, lo, hi = reasoning.PROMPT_WORDS
    counts = [len(p.split(": ", 1)[1].split("?")[0].split()) for p in a]
    assert all(lo <= c <= hi for c in counts) and min(counts) < median < max(counts)


def test_the_reward_is_cheap_in_zero_one_and_spreads_inside_a_group():
    rewards = reasoning.reward(["aaaa", "bcdf", "abab", "", "12"])
    assert rewards == [1.0, 0.0, 0.5, 0.0, 0.0]
