"""The conformance properties (run with ``pytest --pyargs cbverify.conformance --cbverify-engine NAME``). Each holds
the engine to the oracle (``reference``) on drawn GRPO-shaped requests, within the float32 tier; a property about a
capability the engine does not claim is NOT-APPLICABLE, naming it. An engine that declares sizing options
(``Capabilities.sizing``) is built for each example with sizes drawn for its requests (``strategies.sizings``: the
tight end half the time, so prompts are prefilled in chunks and requests preempted or evicted under every
property)."""

from __future__ import annotations

import copy
import os
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cbverify import compare
from cbverify.conformance.strategies import request_groups, sizings
from cbverify.distribution import distribution_test
from cbverify.engines import DEVIATIONS
from cbverify.tolerances import FP32, logprob_scale
from reference import tasks
from reference.generate import generate as oracle
from reference.models import perturb
from reference.spec import RolloutRequest, SamplingParams

EXAMPLES = int(os.environ.get("CBVERIFY_CONFORMANCE_EXAMPLES", "10"))
CHECKED = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def engine(engine_name, conformance_engines, conformance_model):
    """The engine at its factory's own sizes (what capabilities are read from)."""
    return conformance_engines(engine_name, conformance_model)


def sized_runner(engine, engine_name: str, sized_engines, model, options: dict):
    """``sized(data, requests, base=engine, model=model)``: the engine to run ``requests`` on. Where it declares
    sizing options, one built on ``model`` by ``sized_engines`` with sizes drawn for ``requests`` (the draw is part of
    the example: Hypothesis prints it and shrinks it; ``options``, the user's, are not drawn); otherwise ``base``."""

    def build(data, requests, base=engine, model=model):
        drawn = sizings(base.capabilities.sizing, requests, options)
        sizing = data.draw(drawn, label="sizing") if base.capabilities.sizing else {}
        return sized_engines(engine_name, model, sizing) if sizing else base

    return build


@pytest.fixture
def sized(engine, engine_name, sized_engines, conformance_model, conformance_options):
    return sized_runner(engine, engine_name, sized_engines, conformance_model, conformance_options)


def _needs(engine, claim: str, wanted=True):
    if getattr(engine.capabilities, claim) != wanted:
        pytest.skip(f"the engine does not claim {claim}={wanted!r}")


def _outside_declared_deviations(engine, requests) -> None:
    """Draw around the domains of the deviations the engine declares (``Capabilities.deviations``)."""
    assume(not any(DEVIATIONS[d].applies(r.sampling) for d in engine.capabilities.deviations for r in requests))


def _assert_matches_oracle(engine, model, requests, got) -> None:
    """Tokens equal the oracle's (greedy, or sampled where ``spec_sampling`` is claimed) except at a near-tie, and the
    returned log-probs equal teacher forcing in the declared semantics, within the float32 tier."""
    assert not compare.check_results(requests, got), compare.check_results(requests, got)
    for q, r, want in zip(requests, got, oracle(model, requests), strict=True):
        if q.sampling.greedy or engine.capabilities.spec_sampling:
            div = compare.compare_tokens(model, q, want, r, engine=engine.name, tier=FP32)
            assert div is None or div.accepted, div.describe()
    if engine.capabilities.logprob_semantics != "none":
        _assert_logprobs_match_teacher_forcing(engine, model, requests, got)


def _assert_logprobs_match_teacher_forcing(engine, model, requests, got) -> None:
    semantics = engine.capabilities.logprob_semantics
    diff = compare.logprob_diffs(got, compare.teacher_forced_logprobs(model, requests, got, semantics), requests)
    assert diff.max_abs <= FP32.logprob_max_abs and diff.mean_abs <= FP32.logprob_mean_abs, (
        f"declared {semantics!r}: max |dlogp| {diff.max_abs:.3g} at {diff.worst_request!r}[{diff.worst_position}], "
        f"mean {diff.mean_abs:.3g}"
    )


@CHECKED
@given(requests=request_groups(), data=st.data())
def test_results_are_complete_in_request_order_and_follow_the_eos_and_length_conventions(
    sized, conformance_model, requests, data
):
    got = sized(data, requests).generate(requests)
    assert not compare.check_results(requests, got), compare.check_results(requests, got)
    problems = [p for q, r in zip(requests, got, strict=True) for p in compare.check_conventions(q, r)]
    assert not problems, problems


@CHECKED
@given(requests=request_groups(greedy=True), data=st.data())
def test_greedy_tokens_equal_the_oracles_except_at_a_near_tie(engine, sized, conformance_model, requests, data):
    got = sized(data, requests).generate(requests)
    assert not compare.check_results(requests, got), compare.check_results(requests, got)
    for q, r, want in zip(requests, got, oracle(conformance_model, requests), strict=True):
        div = compare.compare_tokens(conformance_model, q, want, r, engine=engine.name, tier=FP32)
        assert div is None or div.accepted, div.describe()


@CHECKED
@given(requests=request_groups(), data=st.data())
def test_returned_logprobs_equal_the_oracles_teacher_forcing_in_the_declared_semantics(
    engine, sized, conformance_model, requests, data
):
    if engine.capabilities.logprob_semantics == "none":
        pytest.skip("the engine declares logprob_semantics='none'")
    _outside_declared_deviations(engine, requests)
    got = sized(data, requests).generate(requests)
    _assert_logprobs_match_teacher_forcing(engine, conformance_model, requests, got)


@CHECKED
@given(requests=request_groups(greedy=False), data=st.data())
def test_sampled_tokens_equal_the_oracles_where_the_engine_follows_the_sampling_spec(
    engine, sized, conformance_model, requests, data
):
    _needs(engine, "spec_sampling")
    _outside_declared_deviations(engine, requests)
    got = sized(data, requests).generate(requests)
    for q, r, want in zip(requests, got, oracle(conformance_model, requests), strict=True):
        div = compare.compare_tokens(conformance_model, q, want, r, engine=engine.name, tier=FP32)
        assert div is None or div.accepted, div.describe()


@CHECKED
@given(crowd=request_groups(), target=request_groups(max_groups=1, max_group=1), data=st.data())
def test_a_request_gives_the_same_rollout_alone_and_in_any_crowd_where_batch_invariance_is_claimed(
    engine, sized, conformance_model, crowd, target, data
):
    _needs(engine, "claims_batch_invariance")
    request = replace(target[0], request_id="target")
    slot = data.draw(st.integers(0, len(crowd)))
    batch = [*crowd[:slot], request, *crowd[slot:]]
    run = sized(data, batch)  # one engine for both calls: the crowd may preempt the request or chunk its prompt
    alone = run.generate([request])[0]
    in_crowd = run.generate(batch)[slot]
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


@pytest.fixture
def engine_on_a_copy(engine, engine_name, conformance_build, conformance_model):
    """A new engine of the same factory on a copy of the model, whose weights the test may change."""
    _needs(engine, "follows_weight_updates")
    model = copy.deepcopy(conformance_model)
    return conformance_build(engine_name, model), model


@torch.no_grad()
def _restore(model, original) -> None:
    """The original weights back, in place (the engine keeps the same model object): each example starts from them,
    so examples neither depend on one another nor drift out of the range the float32 tier was measured on."""
    for p, q in zip(model.parameters(), original.parameters(), strict=True):
        p.copy_(q)


@CHECKED
@given(requests=request_groups(), seed=st.integers(0, 2**16), data=st.data())
def test_after_an_in_place_weight_update_the_next_call_follows_the_new_weights(
    engine_on_a_copy, sized, conformance_model, requests, seed, data
):
    """A GRPO loop's call pattern: generate, change the weights in place (an optimizer step, a weight sync), generate
    again on the same engine; the second call must be the oracle's on the new weights (no stale weights, caches or
    compiled graphs)."""
    engine, model = engine_on_a_copy
    _outside_declared_deviations(engine, requests)
    engine = sized(data, requests, base=engine, model=model)
    _restore(model, conformance_model)
    engine.generate(requests)  # whatever the engine keeps from a call, it has now
    perturb(model, seed, scale=0.02)
    _assert_matches_oracle(engine, model, requests, engine.generate(requests))


def test_declared_deviations_are_real(engine, conformance_model):
    """A declared deviation narrows what the suite draws for the engine, so it must be real: on the deviation's
    example (8 prompts) the engine's processed log-probs differ from the spec's beyond the float32 tier, and follow
    the deviation's own processing (``Deviation.process``, what verify judges them by) within it."""
    if not engine.capabilities.deviations:
        pytest.skip("the engine declares no deviations")
    if engine.capabilities.logprob_semantics != "processed":
        pytest.skip("a deviation shows in processed log-probs, which the engine does not return")
    for deviation in (DEVIATIONS[d] for d in engine.capabilities.deviations):
        requests = [RolloutRequest(f"{deviation.id}-{i}", tuple(tasks.prompt_ids(p)), deviation.example, seed=i,
                                   eos_token_ids=(tasks.EOS_ID,))
                    for i, p in enumerate(tasks.make_problems(8, seed=11))]  # fmt: skip
        got = engine.generate(requests)
        expected = compare.teacher_forced_logprobs(conformance_model, requests, got, "processed")
        diff = compare.logprob_diffs(got, expected, requests)
        assert diff.max_abs > FP32.logprob_max_abs, (
            f"the engine declares the deviation {deviation.id!r} but follows the spec there (max |dlogp| "
            f"{diff.max_abs:.3g} on {deviation.example}): the declaration only hides requests from the suite"
        )
        own = compare.teacher_force(conformance_model, requests, got, "processed", FP32, deviations=(deviation.id,))
        held = compare.logprob_diffs(got, own.expected, requests)
        assert held.max_abs <= FP32.logprob_max_abs, (
            f"the engine declares {deviation.id!r} but does not follow its processing either (max |dlogp| "
            f"{held.max_abs:.3g})"
        )
