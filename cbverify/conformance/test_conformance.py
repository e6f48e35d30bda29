"""The conformance properties (run with ``pytest --pyargs cbverify.conformance --cbverify-engine NAME``). Each holds
the engine to the oracle (``reference``) on drawn GRPO-shaped requests, within the float32 tier; a property about a
capability the engine does not claim is NOT-APPLICABLE, naming it."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbverify import compare
from cbverify.conformance.strategies import request_groups
from cbverify.distribution import distribution_test
from cbverify.tolerances import FP32, logprob_scale
from reference import tasks
from reference.generate import generate as oracle
from reference.spec import RolloutRequest, SamplingParams

EXAMPLES = int(os.environ.get("CBVERIFY_CONFORMANCE_EXAMPLES", "10"))
CHECKED = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def engine(engine_name, conformance_engines):
    return conformance_engines(engine_name)


def _needs(engine, claim: str, wanted=True):
    if getattr(engine.capabilities, claim) != wanted:
        pytest.skip(f"the engine does not claim {claim}={wanted!r}")


@CHECKED
@given(requests=request_groups())
def test_results_are_complete_in_request_order_and_follow_the_eos_and_length_conventions(
    engine, conformance_model, requests
):
    got = engine.generate(requests)
    assert not compare.check_results(requests, got), compare.check_results(requests, got)
    problems = [p for q, r in zip(requests, got, strict=True) for p in compare.check_conventions(q, r)]
    assert not problems, problems


@CHECKED
@given(requests=request_groups(greedy=True))
def test_greedy_tokens_equal_the_oracles_except_at_a_near_tie(engine, conformance_model, requests):
    got = engine.generate(requests)
    assert not compare.check_results(requests, got), compare.check_results(requests, got)
    for q, r, want in zip(requests, got, oracle(conformance_model, requests), strict=True):
        div = compare.compare_tokens(conformance_model, q, want, r, engine=engine.name, tier=FP32)
        assert div is None or div.accepted, div.describe()


@CHECKED
@given(requests=request_groups())
def test_returned_logprobs_equal_the_oracles_teacher_forcing_in_the_declared_semantics(
    engine, conformance_model, requests
):
    if engine.capabilities.logprob_semantics == "none":
        pytest.skip("the engine declares logprob_semantics='none'")
    got = engine.generate(requests)
    expected = compare.teacher_forced_logprobs(conformance_model, requests, got, engine.capabilities.logprob_semantics)
    diff = compare.logprob_diffs(got, expected, requests)
    assert diff.max_abs <= FP32.logprob_max_abs and diff.mean_abs <= FP32.logprob_mean_abs, (
        f"declared {engine.capabilities.logprob_semantics!r}: max |dlogp| {diff.max_abs:.3g} at "
        f"{diff.worst_request!r}[{diff.worst_position}], mean {diff.mean_abs:.3g}"
    )


@CHECKED
@given(requests=request_groups(greedy=False))
def test_sampled_tokens_equal_the_oracles_where_the_engine_follows_the_sampling_spec(
    engine, conformance_model, requests
):
    _needs(engine, "spec_sampling")
    got = engine.generate(requests)
    for q, r, want in zip(requests, got, oracle(conformance_model, requests), strict=True):
        div = compare.compare_tokens(conformance_model, q, want, r, engine=engine.name, tier=FP32)
        assert div is None or div.accepted, div.describe()


@CHECKED
@given(crowd=request_groups(), target=request_groups(max_groups=1, max_group=1), data=st.data())
def test_a_request_gives_the_same_rollout_alone_and_in_any_crowd_where_batch_invariance_is_claimed(
    engine, conformance_model, crowd, target, data
):
    _needs(engine, "claims_batch_invariance")
    request = replace(target[0], request_id="target")
    slot = data.draw(st.integers(0, len(crowd)))
    alone = engine.generate([request])[0]
    in_crowd = engine.generate([*crowd[:slot], request, *crowd[slot:]])[slot]
    assert alone.completion_ids == in_crowd.completion_ids, "the claim of batch invariance does not hold: tokens"
    d = max((abs(a - b) for a, b in zip(alone.logprobs, in_crowd.logprobs, strict=True)), default=0.0)
    assert d * logprob_scale(request.sampling) <= FP32.logprob_max_abs, f"the claim does not hold: log-probs moved {d}"


DISTRIBUTIONS = (SamplingParams(temperature=1.0, top_k=5, max_new_tokens=3),
                 SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3))  # fmt: skip


def test_own_rng_samples_follow_the_processed_distribution(engine, conformance_model):
    """200 samples per request (temperature above and below 1, a top-k and a top-p cut), a chi-square test at every
    node where the sampled prefixes branch, Holm-corrected over all of them."""
    _needs(engine, "spec_sampling", False)
    prompt = tuple(tasks.prompt_ids(tasks.make_problems(1, seed=3)[0]))
    requests = [RolloutRequest(f"dist{i}", prompt, s, seed=0, eos_token_ids=(tasks.EOS_ID,))
                for i, s in enumerate(DISTRIBUTIONS)]  # fmt: skip
    result = distribution_test(engine, conformance_model, requests, num_samples=200)
    assert result.passed, result.describe()
