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
