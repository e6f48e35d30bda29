"""The suite's power: each faulty adapter of ``property_tests/faulty.py`` must make its corresponding check fail,
while the correct engine passes the very same check on the very same scenario (so the check is not failing for an
unrelated reason). Scenarios use the bundled random Qwen2, whose near-uniform distributions make every sampling
bug visible; each ``cbverify verify`` row (``report.evaluate_engine``) must also turn FAIL.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cbverify import compare, report
from cbverify.distribution import distribution_test
from cbverify.engines.reference_engine import ReferenceEngine
from cbverify.tolerances import FP32
from property_tests import faulty
from reference.spec import RolloutRequest, SamplingParams

PROMPT = (1, 6, 5, 16, 7, 5, 3)  # "<bos>Q:12+3..." style ids, any in-vocabulary prompt works
PROCESSED = SamplingParams(temperature=1.0, top_k=5, top_p=0.8, max_new_tokens=6)


def group(sampling: SamplingParams, n: int = 6, eos: tuple[int, ...] = ()) -> list[RolloutRequest]:
    """A GRPO group: one prompt, ``n`` seeds."""
    return [RolloutRequest(f"g{k}", PROMPT, sampling, seed=100 + k, eos_token_ids=eos) for k in range(n)]


@pytest.fixture(scope="module")
def qwen2_model(qwen2):
    return qwen2.model


def logprob_check_fails(qwen2_model, engine, requests) -> bool:
    got = engine.generate(requests)
    diff = compare.logprob_diffs(
        got, compare.teacher_forced_logprobs(qwen2_model, requests, got, "processed"), requests
    )
    return diff.max_abs > FP32.logprob_max_abs or diff.mean_abs > FP32.logprob_mean_abs


def token_check_fails(qwen2_model, engine, requests) -> bool:
    expected, got = ReferenceEngine(qwen2_model).generate(requests), engine.generate(requests)
    triples = zip(requests, expected, got, strict=True)
    divs = [compare.compare_tokens(qwen2_model, q, e, g, engine=engine.name, tier=FP32) for q, e, g in triples]
    return any(d is not None and not d.accepted for d in divs)


def conventions_check_fails(engine, requests) -> bool:
    got = engine.generate(requests)
    return any(compare.check_conventions(q, r) for q, r in zip(requests, got, strict=True))


def results_check_fails(engine, requests) -> bool:
    return bool(compare.check_results(requests, engine.generate(requests)))


def test_logprobs_shifted_by_one_position_fail_the_teacher_forced_logprob_check(qwen2_model):
    requests = group(PROCESSED)
    assert not logprob_check_fails(qwen2_model, ReferenceEngine(qwen2_model), requests)
    assert logprob_check_fails(qwen2_model, faulty.ShiftedLogprobs(qwen2_model), requests)


def test_a_shared_rng_across_requests_fails_the_sampled_token_check(qwen2_model):
    requests = group(SamplingParams(temperature=1.0, max_new_tokens=4))
    assert not token_check_fails(qwen2_model, ReferenceEngine(qwen2_model), requests)
    assert token_check_fails(qwen2_model, faulty.SharedRNG(qwen2_model), requests)


def test_a_dropped_last_token_fails_the_eos_and_length_conventions(qwen2_model):
    requests = group(PROCESSED, n=3) + [RolloutRequest("eos", PROMPT, PROCESSED, seed=7, eos_token_ids=(2, 5, 6))]
    assert not conventions_check_fails(ReferenceEngine(qwen2_model), requests)
    assert conventions_check_fails(faulty.DroppedLastToken(qwen2_model), requests)


def test_top_k_applied_after_top_p_fails_both_the_token_and_the_logprob_checks(qwen2_model):
    requests = group(PROCESSED, n=8)
    assert not token_check_fails(qwen2_model, ReferenceEngine(qwen2_model), requests)
    assert token_check_fails(qwen2_model, faulty.TopKAfterTopP(qwen2_model), requests)
    assert logprob_check_fails(qwen2_model, faulty.TopKAfterTopP(qwen2_model), requests)


def test_results_in_completion_order_fail_the_completeness_and_order_check(qwen2_model):
    requests = [
        RolloutRequest(f"r{n}", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=n), eos_token_ids=())
        for n in (5, 3, 1)
    ]  # fmt: skip
    assert not results_check_fails(ReferenceEngine(qwen2_model), requests)
    assert results_check_fails(faulty.CompletionOrder(qwen2_model), requests)


def test_an_own_rng_sampler_that_drops_top_k_fails_the_distribution_test_and_a_correct_one_passes(qwen2_model):
    request = [RolloutRequest("d", PROMPT, SamplingParams(temperature=1.0, top_k=3, max_new_tokens=2))]
    assert distribution_test(faulty.OwnRNG(qwen2_model), qwen2_model, request, num_samples=150).passed
    result = distribution_test(faulty.IgnoresTopK(qwen2_model), qwen2_model, request, num_samples=150)
    assert not result.passed, result.describe()


def test_a_shared_rng_fails_the_distribution_test(qwen2_model):
    request = [RolloutRequest("d", PROMPT, SamplingParams(temperature=1.0, max_new_tokens=2))]
    assert not distribution_test(faulty.SharedRNG(qwen2_model), qwen2_model, request, num_samples=100).passed


@pytest.mark.parametrize(
    "adapter", [faulty.ShiftedLogprobs, faulty.SharedRNG, faulty.DroppedLastToken, faulty.TopKAfterTopP,
                faulty.CompletionOrder],
)  # fmt: skip
def test_the_verify_row_turns_fail_for_every_faulty_adapter(qwen2_model, adapter):
    requests = group(PROCESSED, n=4) + [
        RolloutRequest("short", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=2), eos_token_ids=())
    ]
    reference = ReferenceEngine(qwen2_model).generate(requests)
    assert (
        report.evaluate_engine(ReferenceEngine(qwen2_model), qwen2_model, requests, reference, FP32).status == "PASS"
    )
    row = report.evaluate_engine(adapter(qwen2_model), qwen2_model, requests, reference, FP32)
    assert row.status == "FAIL", row


def test_a_token_divergence_is_accepted_exactly_inside_the_near_tie_gap(qwen2_model):
    """Swap the reference's sampled token for the runner-up at position 0 and move the tier's gap around it."""

    def top2(request):  # (gap, runner-up) of the decision scores at position 0
        top = torch.topk(compare.decision_scores(qwen2_model, request, ()), 2)
        return float(top.values[0] - top.values[1]), int(top.indices[1])

    # the first seed whose gap is in (0, 1), so a lax threshold such as 1.0 would be caught too
    request = next(r for r in group(SamplingParams(temperature=1.0, max_new_tokens=1), n=20) if 0 < top2(r)[0] < 1)
    gap, runner_up = top2(request)
    reference = ReferenceEngine(qwen2_model).generate([request])[0]
    swapped = replace(reference, completion_ids=(runner_up,))
    for factor, accepted in ((0.999, False), (1.001, True)):
        tier = replace(FP32, near_tie_gap=gap * factor)
        div = compare.compare_tokens(qwen2_model, request, reference, swapped, engine="swap", tier=tier)
        assert div is not None and div.position == 0 and div.accepted is accepted, div.describe()
    assert not compare.compare_tokens(qwen2_model, request, reference, swapped, engine="swap", tier=FP32).accepted
