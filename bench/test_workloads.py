"""Fast, default-run properties of the benchmark workloads (no model, no timing)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cbverify.bench.workloads import LengthDist, Workload, kv_budget_tokens, make_requests, make_workload
from property_tests.strategies import bench_workloads, length_dists
from reference import tasks


@given(dist=length_dists(), seed=st.integers(0, 2**31), n=st.integers(0, 50))
def test_drawn_lengths_stay_within_the_clip_bounds_and_repeat_under_a_seed(dist: LengthDist, seed: int, n: int):
    draws = dist.sample(random.Random(seed), n)
    assert len(draws) == n
    assert all(dist.lo <= x <= dist.hi for x in draws)
    assert draws == dist.sample(random.Random(seed), n)
    if dist.sigma == 0:
        assert set(draws) <= {dist.median}


@given(workload=bench_workloads(), vocab=st.integers(8, 5000))
def test_requests_form_contiguous_grpo_groups_with_the_requested_lengths(workload: Workload, vocab: int):
    requests = make_requests(workload, vocab_size=vocab)
    assert len(requests) == workload.num_prompts * workload.num_generations
    assert len({r.request_id for r in requests}) == len(requests)
    assert len({r.seed for r in requests}) == len(requests)
    groups = [requests[i : i + workload.num_generations] for i in range(0, len(requests), workload.num_generations)]
    for group in groups:
        assert len({r.prompt_ids for r in group}) == 1, "a GRPO group shares one prompt"
        prompt = group[0].prompt_ids
        assert workload.prompt_len.lo <= len(prompt) <= workload.prompt_len.hi
        assert prompt[0] == tasks.BOS_ID and all(3 <= t < vocab for t in prompt[1:])
    for r in requests:
        assert workload.completion_len.lo <= r.sampling.max_new_tokens <= workload.completion_len.hi
        assert r.eos_token_ids == (), "forced-length workloads never stop on EOS"
        assert r.sampling.temperature == workload.temperature
    assert make_requests(workload, vocab_size=vocab) == requests, "a workload is a pure function of its seed"


def test_uniform_workload_runs_every_completion_to_its_cap_and_arith_stops_on_eos():
    uniform = make_requests(make_workload("uniform", 4), vocab_size=4096)
    assert {r.sampling.max_new_tokens for r in uniform} == {make_workload("uniform", 4).max_new_tokens}
    arith = make_requests(make_workload("arith", 4), vocab_size=32)
    assert all(r.eos_token_ids == (tasks.EOS_ID,) and r.sampling.max_new_tokens == 128 for r in arith)
    assert all(tasks.decode(r.prompt_ids).startswith("Q:") for r in arith)


def test_gsm8k_like_lengths_are_long_tailed():
    lengths = [r.sampling.max_new_tokens for r in make_requests(make_workload("gsm8k-like", 512), vocab_size=4096)]
    lengths.sort()
    median, p95 = lengths[len(lengths) // 2], lengths[int(0.95 * len(lengths))]
    assert p95 > 2 * median, f"p95 {p95} vs median {median}: the tail is what makes padding expensive"
    assert sum(lengths) / len(lengths) > median, "right-skewed: mean above median"


@given(workload=bench_workloads(), headroom=st.floats(0.1, 4.0))
def test_the_kv_budget_covers_distinct_prompts_and_grows_with_headroom(workload: Workload, headroom: float):
    requests = make_requests(workload, vocab_size=100)
    budget = kv_budget_tokens(workload, requests, headroom=headroom)
    unique = sum(len(p) for p in {r.prompt_ids for r in requests})
    assert budget >= unique + headroom * workload.completion_len.lo * len(requests) - 1
    assert kv_budget_tokens(workload, requests, headroom=headroom * 2) >= budget


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(median=5, sigma=0.1, lo=6, hi=9), "lo <= median"),
        (dict(median=5, sigma=-1.0, lo=1, hi=9), "sigma"),
    ],
)
def test_bad_length_distributions_are_rejected_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LengthDist(**kwargs)


def test_bad_workloads_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="workload must be one of"):
        make_workload("gsm9k", 8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        make_workload("gsm8k-like", 8, max_new_tokens=10)
    with pytest.raises(ValueError, match="num_generations"):
        make_workload("uniform", 0)
