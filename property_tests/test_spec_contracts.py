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
from reference.generate import process_logits
from reference.spec import MAX_SEED, Rollout, RolloutRequest, SamplingParams, gumbel_noise, noise_keys

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


def test_rollout_requests_accept_their_edges_and_refuse_each_bad_field_by_name():
    ok = RolloutRequest("r", [0], seed=MAX_SEED)
    assert ok.prompt_ids == (0,) and ok.seed == MAX_SEED and RolloutRequest("r", (5,), seed=0).seed == 0
    bad = {"request_id must be a non-empty string": [dict(request_id=""), dict(request_id=5), dict(request_id=None)],
           "prompt_ids is empty": [dict(prompt_ids=())], "negative token id": [dict(prompt_ids=(3, -1))],
           "sampling must be a SamplingParams": [dict(sampling={"temperature": 1.0})],
           "seed must be an int in": [dict(seed=-1), dict(seed=MAX_SEED + 1), dict(seed=1.5), dict(seed="3")],
           }  # fmt: skip
    for message, cases in bad.items():
        for changes in cases:
            with pytest.raises(ValueError, match=message):
                RolloutRequest(**({"request_id": "r", "prompt_ids": (1,)} | changes))


def test_rollouts_refuse_a_log_prob_count_other_than_the_token_count_and_an_unknown_finish_reason():
    assert Rollout("r", (1,), (4, 2), (-0.5, -1.0), "stop").logprobs == (-0.5, -1.0)
    with pytest.raises(ValueError, match="'r': 1 logprobs for 2 tokens"):
        Rollout("r", (1,), (4, 2), (-0.5,), "length")
    with pytest.raises(ValueError, match="finish_reason must be 'stop' or 'length'"):
        Rollout("r", (1,), (4,), (-0.5,), "eos")


def test_processed_log_probs_are_float32_whatever_the_logits_dtype_and_a_batch_of_logits_is_refused():
    logits = torch.tensor([0.5, -1.0, 2.0])
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=2)):
            assert process_logits(logits.to(dtype), sampling).dtype == torch.float32
    with pytest.raises(ValueError, match=r"expects a \(V,\) tensor, got shape \(1, 3\)"):
        process_logits(logits[None], SamplingParams())
