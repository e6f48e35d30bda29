"""Every engine against the reference oracle on drawn workloads (bundled arithmetic Llama, float32, CPU).

Each property draws a batch of requests (``property_tests.strategies.rollout_requests``: prompts, per-request
sampling parameters, seeds, EOS sets) and judges the engine with the same :mod:`cbverify.compare` functions that
``cbverify verify`` uses, under the float32 tier of :mod:`cbverify.tolerances`. One engine per name is built per
module and reused across examples (cheap examples: prompts <= 16 tokens, <= 8 new tokens, <= 3 prompts).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from cbverify import compare
from cbverify.cli.verify import DEFAULT_ENGINE_OPTIONS
from cbverify.engines import get_engine
from cbverify.tolerances import FP32, logprob_scale
from property_tests.strategies import rollout_requests
from reference import generate as ref_gen

ENGINES = ("cb_impl", "hf-generate", "transformers-cb")
SMALL = dict(max_requests=3, max_prompt_len=16, max_new_tokens=(1, 8))


@pytest.fixture(scope="module")
def model(llama):
    return llama[0]


@pytest.fixture(scope="module")
def engines(model):
    return {name: get_engine(name, model, **DEFAULT_ENGINE_OPTIONS.get(name, {})) for name in ENGINES}


def _assert_tokens_match(model, name, requests, expected, got) -> None:
    assert not compare.check_results(requests, got), compare.check_results(requests, got)
    for request, ref, out in zip(requests, expected, got, strict=True):
        div = compare.compare_tokens(model, request, ref, out, engine=name, tier=FP32)
        if div is not None:
            event(f"{name}: accepted near tie" if div.accepted else f"{name}: divergence")
            assert div.accepted, div.describe()


@pytest.mark.parametrize("name", ENGINES)
@given(requests=rollout_requests(**SMALL, greedy=True))
def test_greedy_tokens_match_the_reference_on_every_engine(name, engines, model, requests):
    _assert_tokens_match(model, name, requests, ref_gen.generate(model, requests), engines[name].generate(requests))


@pytest.mark.parametrize("name", [n for n in ENGINES if n == "cb_impl"])  # the engines that declare spec_sampling
@given(requests=rollout_requests(**SMALL, greedy=False, group_size=(1, 3)))
def test_sampled_tokens_equal_the_reference_where_both_follow_the_spec(name, engines, model, requests):
    assert engines[name].capabilities.spec_sampling
    _assert_tokens_match(model, name, requests, ref_gen.generate(model, requests), engines[name].generate(requests))


@pytest.mark.parametrize("name", ENGINES)
@given(requests=rollout_requests(**SMALL))
def test_returned_logprobs_agree_with_the_reference_teacher_forced_on_the_engines_own_tokens(
    name, engines, model, requests
):
    engine = engines[name]
    got = engine.generate(requests)
    expected = compare.teacher_forced_logprobs(model, requests, got, engine.capabilities.logprob_semantics)
    diff = compare.logprob_diffs(got, expected, requests)
    assert diff.max_abs <= FP32.logprob_max_abs and diff.mean_abs <= FP32.logprob_mean_abs, (
        f"{name}: max |dlogp| {diff.max_abs:.3g} at {diff.worst_request!r}[{diff.worst_position}], "
        f"mean {diff.mean_abs:.3g}"
    )


@pytest.mark.parametrize("name", ENGINES)
@given(requests=rollout_requests(**SMALL, group_size=(1, 3)))
def test_results_are_complete_in_request_order_and_follow_the_eos_and_length_conventions(
    name, engines, model, requests
):
    got = engines[name].generate(requests)
    assert not compare.check_results(requests, got), compare.check_results(requests, got)
    pairs = zip(requests, got, strict=True)
    problems = [p for request, rollout in pairs for p in compare.check_conventions(request, rollout)]
    assert not problems, problems


BATCH_INVARIANCE: dict[str, dict[str, float]] = {}


@pytest.fixture(scope="module", autouse=True)
def batch_invariance_report():
    """Prints what was measured for every engine (``-s`` shows it), whether or not the engine claims invariance."""
    yield
    for name, m in sorted(BATCH_INVARIANCE.items()):
        print(f"\nbatch invariance [{name}]: {m['changed']:.0f}/{m['runs']:.0f} comparable runs changed tokens, "
              f"max |dlogp| alone vs crowd {m['max_dlogp']:.3g}")  # fmt: skip


@pytest.mark.parametrize("name", ENGINES)
@given(crowd=rollout_requests(**SMALL), target=rollout_requests(max_requests=1, max_prompt_len=16), data=st.data())
def test_batch_invariance_is_measured_for_every_engine_and_holds_where_claimed(
    name, engines, model, crowd, target, data
):
    engine = engines[name]
    request = replace(target[0], request_id="target")
    slot = data.draw(st.integers(0, len(crowd)), label="slot")
    alone = engine.generate([request])[0]
    in_crowd = engine.generate([*crowd[:slot], request, *crowd[slot:]])[slot]
    m = BATCH_INVARIANCE.setdefault(name, {"runs": 0, "changed": 0, "max_dlogp": 0.0})
    if compare.tokens_comparable(engine.capabilities, request) or engine.capabilities.claims_batch_invariance:
        same = alone.completion_ids == in_crowd.completion_ids
        pairs = zip(alone.logprobs, in_crowd.logprobs, strict=True)
        d = max((abs(a - b) for a, b in pairs), default=0.0) * logprob_scale(request.sampling) if same else 0.0
        m["runs"] += 1
        m["changed"] += not same
        m["max_dlogp"] = max(m["max_dlogp"], d)
        event(f"{name}: tokens {'unchanged' if same else 'CHANGED'} in a crowd")
        if engine.capabilities.claims_batch_invariance:
            div = compare.compare_tokens(model, request, alone, in_crowd, engine=name, tier=FP32)
            assert div is None or div.accepted, div.describe()
            assert d <= FP32.logprob_max_abs, f"{name}: log-probs moved by {d:.3g} in a crowd"
