"""The request and result types of ``reference.spec`` accept exactly their documented domains: every field at each
edge of its range is accepted, one step outside it or of another type is refused with a ``ValueError`` naming the
field, before any engine sees it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from property_tests.strategies import positions
from reference.spec import SamplingParams, gumbel_noise, noise_keys

EDGES = {"temperature": [0, 0.0, 1e-6, 1e6], "top_k": [0, 1, 10**9], "top_p": [1e-9, 1.0, 1],
         "min_p": [0, 0.0, 1.0, 1], "max_new_tokens": [1, 10**6]}  # fmt: skip
OUTSIDE = {"temperature": [-1e-9, math.inf, -math.inf, math.nan, "1", None],
           "top_k": [-1, 1.5, True, "3", None], "top_p": [0, 0.0, 1.0 + 1e-9, math.nan, "1", None],
           "min_p": [-1e-9, 1.0 + 1e-9, 1.5, math.nan, "0", None],
           "max_new_tokens": [0, -1, 2.5, True, "8", None]}  # fmt: skip


@pytest.mark.parametrize("field", list(EDGES))
def test_sampling_params_accept_each_field_at_the_edges_of_its_range(field):
    for value in EDGES[field]:
        assert getattr(SamplingParams(**{field: value}), field) == value


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, vs in OUTSIDE.items() for v in vs], ids=repr)
def test_sampling_params_refuse_a_value_outside_the_range_or_of_another_type_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


@given(rows=st.lists(st.tuples(st.integers(0, 2**31 - 1), positions()), min_size=1, max_size=6))
def test_the_noise_of_int32_seeds_and_positions_is_the_noise_of_the_same_values_in_int64(rows):
    """The hash is defined on int64; callers' index tensors are often int32 (a token of the noise must not depend on
    the dtype its seed and position arrive in)."""
    seeds, pos = torch.tensor([s for s, _ in rows]), torch.tensor([p for _, p in rows])
    want = gumbel_noise(seeds, pos, 11)
    assert torch.equal(gumbel_noise(seeds.to(torch.int32), pos.to(torch.int32), 11), want)
    assert torch.equal(noise_keys(seeds.to(torch.int32), pos.to(torch.int32)), noise_keys(seeds, pos))
