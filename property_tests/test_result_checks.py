"""The per-row result checks every engine's rollouts go through (``cbverify.compare.check_results`` and
``check_conventions``), on drawn requests and rollouts built by hand: a rollout that keeps the conventions has no
problem, and one that breaks one rule gets that rule's problem, naming the request and the numbers involved.

The conventions (``reference.spec.Rollout``): 1 <= length <= ``max_new_tokens``; the first EOS is the last token; a
``stop`` ends on an EOS; a ``length`` has exactly ``max_new_tokens`` tokens and no EOS.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cbverify.compare import check_conventions, check_results
from reference.spec import Rollout, RolloutRequest, SamplingParams

EOS = (7, 9)
PLAIN = st.integers(10, 30)  # token ids that are not an EOS


def request(max_new_tokens: int, rid: str = "q") -> RolloutRequest:
    return RolloutRequest(rid, (1, 2), SamplingParams(max_new_tokens=max_new_tokens), eos_token_ids=EOS)


def rollout(ids, finish: str, rid: str = "q", prompt=(1, 2)) -> Rollout:
    return Rollout(rid, prompt, tuple(ids), (0.0,) * len(ids), finish)


@st.composite
def kept(draw):
    """(max_new_tokens, completion ids, finish reason) that keep every convention."""
    limit = draw(st.integers(1, 8))
    if draw(st.booleans()):  # stopped on an EOS, at or before the limit
        body = draw(st.lists(PLAIN, max_size=limit - 1))
        return limit, [*body, draw(st.sampled_from(EOS))], "stop"
    return limit, draw(st.lists(PLAIN, min_size=limit, max_size=limit)), "length"


@given(kept())
def test_a_rollout_that_keeps_the_conventions_has_no_problem(case):
    limit, ids, finish = case
    assert check_conventions(request(limit), rollout(ids, finish)) == []


@given(limit=st.integers(1, 6), extra=st.integers(1, 3))
def test_an_empty_completion_or_one_longer_than_max_new_tokens_breaks_the_length_rule(limit, extra):
    for ids in ([], [11] * (limit + extra)):
        problems = check_conventions(request(limit), rollout(ids, "length"))
        assert f"request 'q': {len(ids)} completion tokens, allowed 1..{limit}" in problems


@given(body=st.lists(PLAIN, max_size=3), tail=st.lists(PLAIN, min_size=1, max_size=3), eos=st.sampled_from(EOS))
def test_an_eos_before_the_last_token_is_reported_at_its_position(body, tail, eos):
    ids = [*body, eos, *tail]  # one EOS, not last
    problems = check_conventions(request(len(ids)), rollout(ids, "length"))
    assert f"request 'q': EOS at position {len(body)} but the completion goes on to {len(ids)}" in problems


@given(ids=st.lists(PLAIN, min_size=3, max_size=6))
def test_a_stop_that_does_not_end_on_an_eos_is_reported_with_its_last_token(ids):
    problems = check_conventions(request(8), rollout(ids, "stop"))
    assert problems == [f"request 'q': finish_reason 'stop' but the last token ({ids[-1]},) is not an EOS"]


@given(limit=st.integers(2, 6), eos=st.sampled_from(EOS))
def test_a_length_finish_short_of_the_limit_or_ending_on_an_eos_is_reported(limit, eos):
    short = check_conventions(request(limit), rollout([11] * (limit - 1), "length"))
    assert short == [f"request 'q': finish_reason 'length' with {limit - 1}/{limit} tokens, EOS=False"]
    on_eos = check_conventions(request(limit), rollout([11] * (limit - 1) + [eos], "length"))
    assert on_eos == [f"request 'q': finish_reason 'length' with {limit}/{limit} tokens, EOS=True"]


@given(n=st.integers(1, 4), missing=st.integers(1, 3))
def test_results_in_order_pass_and_a_missing_or_extra_rollout_is_counted_not_raised(n, missing):
    requests = [request(2, f"r{i}") for i in range(n + missing)]
    rollouts = [rollout([11, 12], "length", f"r{i}") for i in range(n + missing)]
    assert check_results(requests, rollouts) == []
    assert check_results(requests, rollouts[:n]) == [f"{n} rollouts for {n + missing} requests"]
    assert check_results(requests[:n], rollouts) == [f"{n + missing} rollouts for {n} requests"]


def test_a_rollout_in_another_s_slot_or_with_another_prompt_is_named_by_slot_and_request():
    requests = [request(2, "a"), request(2, "b"), request(2, "c")]
    swapped = [rollout([11, 12], "length", "b"), rollout([11, 12], "length", "a"),
               rollout([11, 12], "length", "c", prompt=(1, 3))]  # fmt: skip
    assert check_results(requests, swapped) == [
        "slot 0: rollout 'b' where request 'a' belongs",
        "slot 1: rollout 'a' where request 'b' belongs",
        "request 'c': rollout carries a different prompt",
    ]
