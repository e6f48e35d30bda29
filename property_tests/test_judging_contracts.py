"""The judging functions' own contracts, on a stand-in model whose logits are a fixed table: the teacher-forced
log-prob semantics, the tier's per-position units and processor cuts (``compare.noise_positions``), the log-prob
differences and their verdict (``compare.logprob_diffs``, ``LogprobDiff.within``) and the mismatch metrics' inputs
(the tolerances' own contracts are in ``test_tolerance_contracts.py``).

Expected values are computed independently: from the table with torch directly (``reference.generate.process_logits``
for processed log-probs, the oracle's own rule), then by plain Python arithmetic in float64 (``math``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cbverify import compare
from cbverify.compare import LogprobDiff, NoisePositions
from cbverify.tolerances import BF16, FP16, FP32, Tier
from property_tests.helpers import TableModel
from reference.generate import process_logits
from reference.spec import Rollout, RolloutRequest, SamplingParams

PROMPT = (1, 2)  # completion token i is predicted by table row len(PROMPT) - 1 + i
VOCAB = 8


def _table(seed: int, magnitude: float, rows: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=generator) * magnitude).to(torch.float32)  # (T, V)


def _rollout(rid: str, tokens, logprobs=None) -> Rollout:
    logprobs = [0.0] * len(tokens) if logprobs is None else logprobs
    return Rollout(rid, PROMPT, tuple(tokens), tuple(logprobs), "length")


def _request(rid: str, sampling: SamplingParams) -> RolloutRequest:
    return RolloutRequest(rid, PROMPT, sampling)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SAMPLINGS = [
    GREEDY,
    SamplingParams(temperature=0.5, top_k=2, max_new_tokens=8),
    SamplingParams(temperature=1.7, top_p=0.8, max_new_tokens=8),
    SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8),  # the kept token has p = 1
]
SAMPLING_IDS = ["greedy", "t0.5-topk2", "t1.7-topp0.8", "topk1"]


@given(seed=st.integers(0, 2**16), tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5))
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_raw_teacher_forced_log_probs_are_the_full_softmax_at_temperature_one_whatever_the_sampling(
    sampling, seed, tokens
):
    table = _table(seed, 3.0)
    got = compare.teacher_forced_logprobs(TableModel(table), [_request("r", sampling)], [_rollout("r", tokens)], "raw")
    rows = table[len(PROMPT) - 1 : len(PROMPT) - 1 + len(tokens)]  # (L, V)
    want = torch.log_softmax(rows, dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)]  # (L,)
    assert len(got) == 1
    torch.testing.assert_close(got[0], want, rtol=0.0, atol=1e-6)


def test_teacher_forced_log_probs_refuse_a_semantics_they_do_not_know():
    model = TableModel(_table(0, 1.0))
    with pytest.raises(ValueError):
        compare.teacher_forced_logprobs(model, [_request("r", GREEDY)], [_rollout("r", [3])], "none")


def _unit_by_hand(tier: Tier, row: torch.Tensor, token: int, sampling: SamplingParams, semantics: str) -> float:
    """One log-prob unit: the dtype's spacing at the row's largest |logit| (floored at 1/4) times the first-order
    sensitivity of log p to a logit move of K = near_tie_gap / 2 units in score units, plus one ulp of log p itself."""
    scale = tier.ulp * max(0.25, float(row.abs().max()))
    logps = process_logits(row, sampling) if semantics == "processed" else torch.log_softmax(row, dim=-1)
    logp = float(logps[token])
    t = sampling.temperature if semantics == "processed" and not sampling.greedy else 1.0
    d = tier.near_tie_gap / 2 * scale / t
    p = math.exp(logp)  # 0.0 for a token outside the processed support
    first_order = scale * math.log(p + (1 - p) * math.exp(2 * d)) / (2 * d)
    own = tier.ulp * abs(logp) if math.isfinite(logp) else 0.0
    return max(first_order + own, scale * tier.ulp)


@given(
    seed=st.integers(0, 2**16),
    magnitude=st.sampled_from([0.1, 0.8, 6.0]),  # rows below the 1/4 floor, between it and 1, well above
    tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
)
@pytest.mark.parametrize("semantics", ["processed", "raw"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
@pytest.mark.parametrize("tier", [BF16, FP16], ids=["bf16", "fp16"])
def test_the_units_of_a_low_precision_tier_are_the_documented_sensitivity_per_position(
    tier, sampling, semantics, seed, magnitude, tokens
):
    table = _table(seed, magnitude)
    rows = table[len(PROMPT) - 1 :]  # (T - P + 1, V)
    tokens = [*tokens, int(rows[len(tokens)].argmin())]  # last: a token top-k / top-p remove
    positions = compare.noise_positions(
        TableModel(table), [_request("r", sampling)], [_rollout("r", tokens)], semantics, tier
    )
    want = [_unit_by_hand(tier, rows[i], token, sampling, semantics) for i, token in enumerate(tokens)]
    (units,) = positions.units
    assert units.dtype == torch.float64 and units.shape == (len(tokens),)
    for i, (got, expected) in enumerate(zip(units.tolist(), want, strict=True)):
        assert got == pytest.approx(expected, rel=1e-12), (i, tokens[i])
    assert positions.bound == tier.logprob_max_abs


def test_in_float32_every_unit_is_one_and_no_position_is_at_a_cut():
    table = _table(3, 4.0)
    requests = [_request("a", SAMPLINGS[1]), _request("b", GREEDY)]
    positions = compare.noise_positions(
        TableModel(table), requests, [_rollout("a", [0, 1, 2]), _rollout("b", [5])], "processed", FP32
    )
    assert [u.tolist() for u in positions.units] == [[1.0, 1.0, 1.0], [1.0]]
    assert [c.tolist() for c in positions.at_cut] == [[False, False, False], [False]]


# bf16 rows of largest |logit| 4: a unit is 2^-7 * 4 = 1/32 and each logit may move by 4 units = 1/8, so a top-k cut
# is within the noise when the k-th and (k+1)-th logits are within 2 * 1/8 = 0.25 of each other.
ROW_NEAR_CUT = [4.0, 3.0, 2.8, 0.0, 0.0, 0.0, -1.0, -2.0]  # top-2 cut between 3.0 and 2.8: 0.2 apart
ROW_FAR_FROM_CUT = [4.0, 3.0, 2.5, 0.0, 0.0, 0.0, -1.0, -2.0]  # 0.5 apart
TOP2 = SamplingParams(temperature=1.0, top_k=2, max_new_tokens=8)


def _cut_model() -> TableModel:
    table = torch.zeros(6, VOCAB)
    table[1:4], table[4] = torch.tensor(ROW_NEAR_CUT), torch.tensor(ROW_FAR_FROM_CUT)
    return TableModel(table)


# the top token (kept), the 3rd (removed, on the cut), the 6th (removed, far below it), the top token of the far row
CUT_TOKENS = (0, 2, 5, 0)


def test_a_position_is_at_a_cut_exactly_when_a_token_lies_within_the_tiers_logit_noise_of_it():
    model, request, rollout = _cut_model(), _request("r", TOP2), _rollout("r", CUT_TOKENS)
    processed = compare.noise_positions(model, [request], [rollout], "processed", BF16)
    assert processed.at_cut[0].tolist() == [True, True, False, False]
    raw = compare.noise_positions(model, [request], [rollout], "raw", BF16)
    assert raw.at_cut[0].tolist() == [False, False, False, False]


def test_judged_in_bf16_a_kept_token_the_reference_cut_within_the_noise_is_skipped_not_an_infinite_error():
    model, request = _cut_model(), _request("r", TOP2)
    near = torch.tensor(ROW_NEAR_CUT)
    top = float(torch.log_softmax(near[:2], dim=-1)[0])  # the reference keeps tokens 0 and 1
    far = torch.tensor(ROW_FAR_FROM_CUT)
    rollout = _rollout("r", CUT_TOKENS, [top, -1.0, -math.inf, float(torch.log_softmax(far[:2], dim=-1)[0])])
    diff = compare.judge_logprobs(model, [request], [rollout], "processed", BF16)
    assert (diff.skipped_at_cut, diff.num_tokens, diff.max_abs) == (1, 3, pytest.approx(0.0, abs=1e-6))
    assert diff.within(BF16)


def test_judged_log_prob_differences_are_scaled_by_the_requests_temperature_below_one():
    model = TableModel(_table(7, 2.0))
    request, tokens = _request("r", SamplingParams(temperature=0.5, max_new_tokens=8)), [1, 4]
    exact = compare.teacher_forced_logprobs(model, [request], [_rollout("r", tokens)], "processed")[0]
    shifted = _rollout("r", tokens, [float(exact[0]), float(exact[1]) + 1e-3])
    diff = compare.judge_logprobs(model, [request], [shifted], "processed", FP32)
    assert diff.max_abs == pytest.approx(0.5 * 1e-3, rel=1e-6) and diff.worst_position == 1


# (got, want) pairs: finite values, and -inf / NaN on either side
values = st.one_of(st.floats(-8, 0, width=32), st.sampled_from([-math.inf, math.nan]))
rollout_pairs = st.lists(st.tuples(values, values), min_size=1, max_size=4)


def _diff_by_hand(got: float, want: float) -> float:
    if got == want == -math.inf:
        return 0.0  # both sides agree the token is impossible
    return abs(got - want) if math.isfinite(got) and math.isfinite(want) else math.inf


@given(
    batch=st.lists(st.tuples(rollout_pairs, st.sampled_from([0.0, 0.3, 1.0, 2.0])), min_size=1, max_size=3),
    with_requests=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    offset=st.floats(1e-9, 1e-3),
)
def test_the_log_prob_differences_are_their_definitions_over_every_token(batch, with_requests, dtype, offset):
    """max / mean |got - want| in float64 (inf if a side is not finite, 0 if both are -inf), times min(1, T)."""
    rollouts, expected, requests, by_hand = [], [], [], []
    for k, (pairs, temperature) in enumerate(batch):
        got = [g + offset if math.isfinite(g) else g for g, _ in pairs]  # engine values float32 cannot hold
        rollouts.append(_rollout(f"r{k}", [0] * len(pairs), got))
        expected.append(torch.tensor([w for _, w in pairs], dtype=dtype))  # (L,)
        requests.append(_request(f"r{k}", SamplingParams(temperature=temperature, max_new_tokens=8)))
        scale = min(1.0, temperature) if with_requests and temperature > 0 else 1.0
        wants = [w for _, w in pairs]
        by_hand += [(f"r{k}", j, _diff_by_hand(g, w) * scale) for j, (g, w) in enumerate(zip(got, wants, strict=True))]
    diff = compare.logprob_diffs(rollouts, expected, requests if with_requests else None)
    worst = max(d for *_, d in by_hand)
    mean = math.fsum(d for *_, d in by_hand) / len(by_hand)
    rid, position, _ = next(x for x in by_hand if x[2] == worst)
    assert diff.num_tokens == len(by_hand) and diff.skipped_at_cut == 0
    assert (diff.worst_request, diff.worst_position) == (rid, position)
    assert diff.max_abs == pytest.approx(worst, rel=1e-12) and diff.max_units == pytest.approx(worst, rel=1e-12)
    assert diff.mean_abs == pytest.approx(mean, rel=1e-12) and diff.mean_units == pytest.approx(mean, rel=1e-12)


def test_the_worst_log_prob_difference_is_the_first_maximum_in_request_order():
    expected = [torch.zeros(2), torch.zeros(3), torch.zeros(1)]
    zeros = [_rollout("a", [0, 0]), _rollout("b", [0, 0, 0]), _rollout("c", [0])]
    diff = compare.logprob_diffs(zeros, expected)
    assert (diff.max_abs, diff.worst_request, diff.worst_position) == (0.0, "a", 0)
    later = [
        _rollout("a", [0, 0], [-0.25, -0.5]),
        _rollout("b", [0, 0, 0], [-0.5, -1.0, -1.0]),
        _rollout("c", [0], [-1.0]),
    ]
    diff = compare.logprob_diffs(later, expected)
    assert (diff.max_abs, diff.worst_request, diff.worst_position) == (1.0, "b", 1)
    assert diff.mean_abs == (0.25 + 0.5 + 0.5 + 1.0 + 1.0 + 1.0) / 6 and diff.num_tokens == 6


def test_log_prob_differences_of_no_token_are_zero_with_no_worst_position():
    empty = LogprobDiff(0.0, 0.0, 0, None, None, 0.0, 0.0, 0)
    assert compare.logprob_diffs([], []) == empty
    cut = NoisePositions([torch.ones(1, dtype=torch.float64)], [torch.tensor([True])], bound=8.0)
    all_skipped = compare.logprob_diffs([_rollout("r", [0], [-9.0])], [torch.zeros(1)], positions=cut)
    assert all_skipped == LogprobDiff(0.0, 0.0, 0, None, None, 0.0, 0.0, 1)


def test_a_difference_is_skipped_only_at_a_cut_and_only_strictly_above_the_bound_in_units():
    positions = NoisePositions(
        units=[torch.ones(4, dtype=torch.float64), torch.full((2,), 2.0, dtype=torch.float64)],
        at_cut=[torch.tensor([True, True, False, True]), torch.tensor([True, False])],
        bound=8.0,
    )
    rollouts = [_rollout("a", [0] * 4, [-8.0, -9.0, -9.0, -1.0]), _rollout("b", [0, 0], [-20.0, -2.0])]
    diff = compare.logprob_diffs(rollouts, [torch.zeros(4), torch.zeros(2)], positions=positions)
    # a: 8 units at a cut is judged (not above 8), 9 at a cut skipped, 9 off a cut judged; b: 10 units at a cut skipped
    assert diff.skipped_at_cut == 2 and diff.num_tokens == 4
    assert (diff.max_abs, diff.max_units, diff.worst_request, diff.worst_position) == (9.0, 9.0, "a", 2)
    assert diff.mean_abs == (8.0 + 9.0 + 1.0 + 2.0) / 4 and diff.mean_units == (8.0 + 9.0 + 1.0 + 1.0) / 4


def test_the_judging_functions_refuse_rollouts_and_requests_or_expectations_of_unequal_lengths():
    model = TableModel(_table(1, 1.0))
    requests, rollouts = [_request("a", GREEDY), _request("b", GREEDY)], [_rollout("a", [1])]
    with pytest.raises(ValueError):
        compare.logprob_diffs([_rollout("a", [1]), _rollout("b", [1])], [torch.zeros(1)])
    with pytest.raises(ValueError):
        compare.mismatch(model, requests, rollouts)
    for tier in (FP32, BF16):
        with pytest.raises(ValueError):
            compare.noise_positions(model, requests, rollouts, "processed", tier)


@pytest.mark.parametrize("tier", [FP32, BF16], ids=["fp32", "bf16"])
def test_log_probs_are_within_a_tier_up_to_and_including_both_bounds(tier):
    at = LogprobDiff(0.0, 0.0, 1, "r", 0, tier.logprob_max_abs, tier.logprob_mean_abs)
    assert at.within(tier)
    above_max = LogprobDiff(0.0, 0.0, 1, "r", 0, math.nextafter(tier.logprob_max_abs, math.inf), 0.0)
    above_mean = LogprobDiff(0.0, 0.0, 1, "r", 0, 0.0, math.nextafter(tier.logprob_mean_abs, math.inf))
    assert not above_max.within(tier) and not above_mean.within(tier)


def test_the_mismatch_metrics_compare_the_engine_log_probs_with_the_trainers_at_each_requests_temperature():
    table = _table(11, 2.0)
    model = TableModel(table)
    temperatures, tokens = [0.0, 0.5, 1.5], [[3, 1, 6], [0, 2], [5, 5, 1]]
    requests = [_request(f"r{k}", SamplingParams(temperature=t, max_new_tokens=8)) for k, t in enumerate(temperatures)]
    pairs, rollouts = [], []
    for k, (t, ids) in enumerate(zip(temperatures, tokens, strict=True)):
        rows = table[len(PROMPT) - 1 : len(PROMPT) - 1 + len(ids)]  # (L, V)
        trainer = torch.log_softmax(rows / (t if t > 0 else 1.0), dim=-1)[torch.arange(len(ids)), torch.tensor(ids)]
        sampler = [float(x) - 0.0123456789 * (j + 1) for j, x in enumerate(trainer)]  # float64, not float32 values
        pairs += [(float(x), s) for x, s in zip(trainer, sampler, strict=True)]
        rollouts.append(_rollout(f"r{k}", ids, sampler))
    metrics = compare.mismatch(model, requests, rollouts)
    r = [t - s for t, s in pairs]
    assert metrics["logprob_abs_diff_max"] == pytest.approx(max(abs(x) for x in r), rel=1e-12)
    assert metrics["logprob_abs_diff_mean"] == pytest.approx(math.fsum(abs(x) for x in r) / len(r), rel=1e-12)
    assert metrics["mismatch_kl"] == pytest.approx(math.fsum(math.exp(x) - x - 1 for x in r) / len(r), rel=1e-9)
