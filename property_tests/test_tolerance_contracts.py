"""The tolerance tiers' and tolerances' own contracts (``cbverify.tolerances``: refusals, units, temperature
scaling, the tier of each dtype, a tolerance's bound) and the distribution test's report (``cbverify.distribution``).

Expected values are computed by plain Python arithmetic in float64 (``math``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cbverify.distribution import DistributionResult, NodeTest
from cbverify.tolerances import BF16, FP16, FP32, Tier, Tolerance, logprob_scale, tier_for
from reference.spec import SamplingParams


def _tier(**changes) -> Tier:
    fields = dict(name="t", token_rule="exact_or_near_tie", near_tie_gap=1e-4, logprob_max_abs=5e-5,
                  logprob_mean_abs=1e-5, reason="r", ulp=0.0)  # fmt: skip
    return Tier(**{**fields, **changes})


@pytest.mark.parametrize("field", ["near_tie_gap", "logprob_max_abs", "logprob_mean_abs", "ulp"])
def test_a_tier_refuses_each_negative_or_nan_bound(field):
    _tier()  # the same tier with no negative field is accepted
    for bad in (-1e-3, math.nan):  # a NaN bound would make every comparison against it false
        with pytest.raises(ValueError, match="tolerances must be >= 0"):
            _tier(**{field: bad})


def test_a_tier_refuses_an_unknown_token_rule_and_a_rule_that_does_not_match_its_ulp():
    assert _tier(token_rule="near_tie_in_noise", ulp=2**-7).ulp == 2**-7
    for changes in ({"token_rule": "exact"}, {"token_rule": "near_tie_in_noise"}, {"ulp": 2**-7}):
        with pytest.raises(ValueError):
            _tier(**changes)


@pytest.mark.parametrize("max_abs_logit", [0.0, 0.1, 0.25, 0.5, 1.0, 1.25, 3.0, 40.0])
def test_a_unit_is_the_dtypes_spacing_at_one_times_the_largest_logit_floored_at_a_quarter(max_abs_logit):
    floored = max(0.25, max_abs_logit)
    assert BF16.unit(max_abs_logit) == 2**-7 * floored  # bfloat16 keeps 8 significant bits
    assert FP16.unit(max_abs_logit) == 2**-10 * floored  # float16 keeps 11
    assert FP32.unit(max_abs_logit) == 1.0  # float32 bounds are absolute


@pytest.mark.parametrize(
    ("temperature", "scale"), [(0.0, 1.0), (0.3, 0.3), (0.75, 0.75), (1.0, 1.0), (1.5, 1.0), (2.5, 1.0)]
)
def test_log_prob_differences_are_scaled_by_the_temperature_below_one_and_not_above(temperature, scale):
    assert logprob_scale(SamplingParams(temperature=temperature)) == scale


def test_each_float_dtype_has_its_tier_by_dtype_or_by_name():
    for dtype, tier in ((torch.float32, FP32), (torch.bfloat16, BF16), (torch.float16, FP16)):
        assert tier_for(dtype) is tier
        assert tier_for(str(dtype).removeprefix("torch.")) is tier
    for other in (torch.float64, torch.int8, "half"):
        with pytest.raises(ValueError):
            tier_for(other)


def test_a_tolerance_needs_positive_bounds_a_non_negative_rel_and_a_mean_drift_no_wider_than_its_max():
    for max_abs, mean_drift, rel in ((5e-5, 1e-6, 0.0), (1e-9, 1e-9, 0.0), (0.5, 0.25, 0.5), (3.0, 2.0, 2.0)):
        assert Tolerance(max_abs, mean_drift, "r", rel=rel).bound(0.0) == max_abs
    assert Tolerance(0.5, 0.25, "r", rel=0.5).bound(-3.0) == 0.5 + 0.5 * 3.0
    refused = [(0.0, 1e-3, 0.0), (1e-3, 0.0, 0.0), (1e-3, -1e-4, 0.0), (-1.0, -2.0, 0.0), (1e-3, 1e-4, -0.1),
               (1e-3, 2e-3, 0.0)]  # fmt: skip
    for max_abs, mean_drift, rel in refused:
        with pytest.raises(ValueError):
            Tolerance(max_abs, mean_drift, "r", rel=rel)


@given(value=st.floats(-20, 20), rel=st.sampled_from([0.0, 2**-6, 0.5]))
def test_a_tolerance_bound_is_its_max_abs_plus_rel_times_the_values_magnitude(value, rel):
    tolerance = Tolerance(1e-3, 1e-4, "r", rel=rel)
    assert tolerance.bound(value) == tolerance.bound(-value) == pytest.approx(1e-3 + rel * abs(value), rel=1e-15)


def _node(position: int, p_value: float) -> NodeTest:
    return NodeTest("r", position, tuple(range(4, 4 + position)), 60, p_value, 3, 9, 20.5)


def test_the_distribution_report_gives_the_counts_and_the_first_rejected_nodes():
    tests = tuple(_node(j, 10.0 ** -(j + 4)) for j in range(7))
    failed = DistributionResult(1e-3, tests, tests[:6])
    lines = failed.describe().splitlines()
    assert "7 node tests" in lines[0] and "alpha 0.001" in lines[0] and "6 rejected" in lines[0]
    assert lines[1].strip() == "request 'r' position 0 prefix []: p=0.0001 (n=60; token 3 seen 9x, expected 20.5)"
    assert "position 2 prefix [4, 5]: p=1e-06" in lines[3]
    assert len(lines) == 1 + 5, "the report lists the first five rejected nodes, however many there are"
    passed = DistributionResult(1e-3, tests[:3], ())
    assert passed.passed and "3 node tests" in passed.describe() and "0 rejected" in passed.describe()


@given(length=st.integers(1, 100_000))
def test_the_recurrent_tier_is_the_fp32_tier_grown_by_the_measured_rate_per_token_of_context(length):
    from cbverify.tolerances import RECURRENT_GROWTH, recurrent_tier

    tier = recurrent_tier(length)
    factor = max(1.0, RECURRENT_GROWTH * length / 5e-5)  # 5e-5: the fp32 tier's max, grown once past it
    assert tier.name == "fp32-recurrent" and tier.token_rule == "exact_or_near_tie" and tier.ulp == 0
    assert tier.logprob_max_abs == pytest.approx(max(FP32.logprob_max_abs, RECURRENT_GROWTH * length), rel=1e-12)
    assert tier.logprob_mean_abs == pytest.approx(FP32.logprob_mean_abs * factor, rel=1e-12)
    assert tier.near_tie_gap == pytest.approx(FP32.near_tie_gap * factor, rel=1e-12)
    assert recurrent_tier(length + 1).logprob_max_abs >= tier.logprob_max_abs  # never shrinks with length
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        recurrent_tier(0)


def test_a_model_gets_the_recurrent_tier_only_in_float32_and_only_when_its_decode_carries_a_fixed_size_state(
    tmp_path,
):
    """Read off the model, not its name: a Qwen3-Next config with only full-attention layers is attention; the same
    family with a gated delta-rule layer is recurrent; bf16 keeps the bf16 tier (its units scale with the logits)."""
    from dataclasses import replace

    from cbverify import zoo
    from cbverify.tolerances import recurrent_state, recurrent_tier, tier_for_model
    from reference.models import load

    hybrid = zoo.by_name("qwen3_next")
    attention = replace(hybrid, name="qwen3_next", kwargs=hybrid.kwargs | {"layer_types": ["full_attention"] * 2})
    recurrent_model = zoo.load(hybrid, tmp_path / "hybrid")[0]
    attention_model = zoo.load(attention, tmp_path / "attention")[0]
    assert recurrent_state(recurrent_model) and not recurrent_state(attention_model)
    assert tier_for_model(attention_model, max_length=400) is FP32
    assert tier_for_model(recurrent_model, max_length=400) == recurrent_tier(400)
    assert tier_for_model(recurrent_model, "float32", max_length=3) == recurrent_tier(3)
    bf16 = load(tmp_path / "hybrid" / "qwen3_next", dtype="bfloat16")[0]
    assert tier_for_model(bf16, max_length=400) is BF16
