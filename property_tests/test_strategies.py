"""Meta-tests of the strategies the cross-engine suite draws from: every draw is valid, and the space the suite
claims to explore is actually reached (``hypothesis.find`` must locate each interesting corner)."""

from __future__ import annotations

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from cb_impl.config import EngineConfig
from property_tests.strategies import engine_configurations, rollout_requests, sampling_params
from reference import tasks

FIND = settings(max_examples=1000, derandomize=True, database=None, phases=[Phase.generate])  # no shrinking
SMALL = dict(max_requests=3, max_prompt_len=16, max_new_tokens=(1, 8))  # what test_cross_engine draws


@given(requests=rollout_requests(**SMALL, group_size=(1, 3)))
def test_drawn_batches_are_valid_and_within_their_bounds(requests):
    assert 0 < len({r.prompt_ids for r in requests}) <= 3
    assert len({r.request_id for r in requests}) == len(requests)
    for r in requests:
        assert 0 < len(r.prompt_ids) <= 16 and r.prompt_ids[0] == tasks.BOS_ID
        assert max(r.prompt_ids) < tasks.VOCAB_SIZE
        assert 0 < r.sampling.max_new_tokens <= 8
        assert set(r.eos_token_ids) <= {tasks.EOS_ID, tasks.VOCAB["\n"]}


@given(requests=rollout_requests(**SMALL, greedy=True))
def test_greedy_batches_hold_only_greedy_requests(requests):
    assert all(r.sampling.greedy for r in requests)


@pytest.mark.parametrize(
    "what, condition",
    [
        ("a mixed greedy/sampled batch", lambda rs: len({r.sampling.greedy for r in rs}) == 2),
        ("a GRPO group (one prompt, several seeds)", lambda rs: len(rs) > len({r.prompt_ids for r in rs})),
        ("a request without EOS", lambda rs: any(not r.eos_token_ids for r in rs)),
        ("a request with two EOS ids", lambda rs: any(len(r.eos_token_ids) == 2 for r in rs)),
        ("a one-token budget", lambda rs: any(r.sampling.max_new_tokens == 1 for r in rs)),
        ("an arithmetic prompt", lambda rs: any(r.prompt_ids[1:2] == (tasks.VOCAB["Q"],) for r in rs)),
        ("a BOS-only prompt", lambda rs: any(len(r.prompt_ids) == 1 for r in rs)),
        ("different max_new_tokens in one batch", lambda rs: len({r.sampling.max_new_tokens for r in rs}) > 1),
    ],
)
def test_request_batches_reach_every_corner_the_suite_relies_on(what, condition):
    # find() stops at the first hit; max_examples only bounds the search. derandomize keeps CI deterministic.
    find(rollout_requests(**SMALL, group_size=(1, 3)), condition, settings=FIND)


@pytest.mark.parametrize(
    "what, condition",
    [
        ("top-k, top-p and min-p at once", lambda s: s.top_k > 0 and s.top_p < 1 and s.min_p > 0),
        ("top-k 1 (deterministic sampling)", lambda s: s.top_k == 1),
        ("a temperature above 1", lambda s: s.temperature > 1),
    ],
)
def test_sampling_params_reach_the_processor_corners(what, condition):
    find(sampling_params(greedy=False), condition, settings=FIND)


@given(options=engine_configurations(engine="cb_impl"), data=st.data())
def test_cb_impl_configurations_are_valid_and_hold_one_longest_sequence(options, data):
    config = EngineConfig(**options)
    assert config.num_blocks * config.block_size >= 64


@pytest.mark.parametrize("engine", ["transformers-cb", "hf-generate", "reference"])
@given(data=st.data())
def test_every_engine_has_configurations_to_draw(engine, data):
    assert isinstance(data.draw(engine_configurations(engine=engine)), dict)


def test_configurations_for_an_unknown_engine_are_refused():
    with pytest.raises(ValueError, match="no configurations"):
        find(engine_configurations(engine="vllm"), lambda _: True)
