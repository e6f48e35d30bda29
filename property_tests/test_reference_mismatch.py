"""The sampler-trainer mismatch in the reference: ``reference.metrics`` (what ``cbverify`` and the training loop report
about an engine's log-probs) and ``reference.loss.importance_weights`` (the correction TRL applies for it).

Expected values are computed independently, by plain Python loops over tokens in float64 (``math``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cbverify.tolerances import FLOAT64_RTOL
from property_tests.strategies import grpo_batches, loss_configs
from reference.loss import LossConfig, importance_weights
from reference.metrics import METRIC_KEYS, mismatch_metrics, pad_rows

# per sequence, (trainer, sampler) log-prob pairs; a NaN sampler log-prob is a token the engine could not score
pairs = st.tuples(st.floats(-6, 0), st.one_of(st.floats(-6, 0), st.just(math.nan)))
batches = st.lists(st.lists(pairs, max_size=5), min_size=1, max_size=4).filter(
    lambda rows: any(not math.isnan(s) for row in rows for _, s in row)
)


def _by_hand(rows) -> dict[str, float]:
    counted = [[(t, s) for t, s in row if not math.isnan(s)] for row in rows]
    flat = [pair for row in counted for pair in row]
    r = [t - s for t, s in flat]
    w = [math.exp(x) for x in r]
    mean_w = math.fsum(w) / len(w)
    per_seq = [math.exp(math.fsum(s for _, s in row) / len(row) - math.fsum(t for t, _ in row) / len(row))
               for row in counted if row]  # fmt: skip
    return {
        "logprob_abs_diff_mean": math.fsum(abs(x) for x in r) / len(r),
        "logprob_abs_diff_max": max(abs(x) for x in r),
        "prob_abs_diff_mean": math.fsum(abs(math.exp(t) - math.exp(s)) for t, s in flat) / len(flat),
        "mismatch_kl": math.fsum(math.exp(x) - x - 1 for x in r) / len(r),
        "is_weight_min": min(w), "is_weight_mean": mean_w, "is_weight_max": max(w),
        "ess": 1.0 / (math.fsum((x / mean_w) ** 2 for x in w) / len(w)),
        "ppl_ratio": math.fsum(per_seq) / len(per_seq),
    }  # fmt: skip


@given(rows=batches)
def test_the_mismatch_metrics_are_their_definitions_over_the_scored_tokens_in_either_layout(rows):
    """Per-sequence 1-D tensors, or (B, T) float32 tensors with a mask: the same numbers, each its definition over
    the real tokens whose sampler log-prob is not NaN, computed in float64 whatever the inputs' dtype."""
    want = _by_hand(rows)
    trainer = [torch.tensor([t for t, _ in row], dtype=torch.float64) for row in rows]
    sampler = [torch.tensor([s for _, s in row], dtype=torch.float64) for row in rows]
    listed = mismatch_metrics(trainer, sampler)
    assert tuple(listed) == METRIC_KEYS
    width = max(len(row) for row in rows)
    padded = torch.zeros(len(rows), width + 1), torch.full((len(rows), width + 1), -1.0)  # one junk column
    mask = torch.zeros(len(rows), width + 1, dtype=torch.int64)
    for i, row in enumerate(rows):
        for j, (t, s) in enumerate(row):
            padded[0][i, j], padded[1][i, j], mask[i, j] = t, s, 1
    float32 = [
        [(float(padded[0][i, j]), float(padded[1][i, j])) for j in range(len(row))] for i, row in enumerate(rows)
    ]
    want32 = _by_hand(float32)  # the float32 inputs' own values, in float64
    tabled = mismatch_metrics(*padded, mask)
    for key in METRIC_KEYS:
        assert listed[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key
        assert tabled[key] == pytest.approx(want32[key], rel=1e-12, abs=1e-15), key


def test_the_mismatch_metrics_refuse_mixed_layouts_unequal_lengths_other_shapes_and_nothing_to_compare():
    one = torch.zeros(1, 2)
    refused = [
        ((one, [torch.zeros(2)]), "mask"), ((one, one), "mask"),  # a (B, T) tensor without its mask
        (([torch.zeros(2)], [torch.zeros(3)]), "lengths"),
        ((one, one, torch.ones(1, 3, dtype=torch.int64)), "shapes"),  # trainer and sampler agree, the mask does not
        ((one, torch.zeros(1, 3), torch.ones(1, 2, dtype=torch.int64)), "shapes"),
        ((one, one, torch.zeros(1, 2, dtype=torch.int64)), "no token"),
        ((one, torch.full((1, 2), math.nan), torch.ones(1, 2, dtype=torch.int64)), "no token"),
    ]  # fmt: skip
    for args, message in refused:
        with pytest.raises(ValueError, match=message):
            mismatch_metrics(*args)


def test_pad_rows_pads_right_in_float64_with_an_int64_mask():
    values, mask = pad_rows([[0.1, 0.2], [], torch.tensor([0.3])])
    assert values.dtype == torch.float64 and mask.dtype == torch.int64
    assert values.tolist() == [[0.1, 0.2], [0.0, 0.0], [float(torch.tensor(0.3)), 0.0]]  # a list keeps its float64
    assert mask.tolist() == [[1, 1], [0, 0], [1, 0]]
    empty, empty_mask = pad_rows([])
    assert empty.shape == empty_mask.shape == (0, 0)


@given(batch=grpo_batches(), config=loss_configs(is_correction=True))
def test_truncate_modes_bound_the_weights_and_mask_modes_zero_them(batch, config):
    old, sampling, mask = batch["old_per_token_logps"], batch["sampling_per_token_logps"], batch["completion_mask"]
    weights = importance_weights(old, sampling, mask, config)
    lo = -math.inf if config.is_clip_min is None else config.is_clip_min
    hi = math.inf if config.is_clip_max is None else config.is_clip_max
    sequence = config.is_correction.startswith("sequence")
    for i in range(mask.shape[0]):
        # the raw weight by hand: real tokens with a sampler log-prob count; the product for sequence modes
        diffs = [float(old[i, t] - sampling[i, t]) for t in range(mask.shape[1]) if mask[i, t]]
        diffs = [0.0 if math.isnan(d) else d for d in diffs]
        raws = [math.exp(math.fsum(diffs))] if sequence else [math.exp(d) for d in diffs]
        got = weights[i].tolist() if sequence else [float(weights[i, t]) for t in range(len(diffs))]
        for raw, w in zip(raws, got, strict=True):
            if config.is_correction.endswith("truncate"):
                assert lo <= w <= hi
                assert math.isclose(w, min(max(raw, lo), hi), rel_tol=FLOAT64_RTOL)
            elif lo <= raw <= hi:
                assert math.isclose(w, raw, rel_tol=FLOAT64_RTOL)
            else:
                assert w == 0.0


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate", "token_mask", "sequence_mask"])
def test_the_importance_weights_meet_both_bounds_on_weights_below_between_and_above_them(mode):
    """Every mode on log-ratios from -3 to 3, so that some raw weights fall below, between and above the bounds
    (drawn batches rarely reach both sides at once)."""
    diffs = torch.linspace(-3, 3, 7, dtype=torch.float64)  # raw token weights e^-3 .. e^3
    old, sampling = diffs[:, None].expand(7, 2).clone(), torch.zeros(7, 2, dtype=torch.float64)
    old[:, 1] = 0.0  # the second token agrees: a sequence's weight is its first token's
    mask = torch.ones(7, 2, dtype=torch.float64)
    lo, hi = 0.5, 2.0
    weights = importance_weights(old, sampling, mask, LossConfig(is_correction=mode, is_clip_min=lo, is_clip_max=hi))
    raw = [math.exp(float(d)) for d in diffs]
    keep = [min(max(w, lo), hi) if mode.endswith("truncate") else (w if lo <= w <= hi else 0.0) for w in raw]
    torch.testing.assert_close(weights[:, 0], torch.tensor(keep, dtype=torch.float64), rtol=FLOAT64_RTOL, atol=0)
    assert raw[0] < lo and raw[-1] > hi  # both bounds were met
    # a weight exactly at a bound is inside it (kept as it is by every mode)
    at = torch.tensor([[0.0], [math.log(2.0)]], dtype=torch.float64)
    exact = float(torch.exp(at[1, 0]))
    weights = importance_weights(at, torch.zeros(2, 1, dtype=torch.float64), torch.ones(2, 1, dtype=torch.float64),
                                 LossConfig(is_correction=mode, is_clip_min=1.0, is_clip_max=exact))  # fmt: skip
    assert weights.flatten().tolist() == [1.0, exact]
    # no upper bound (is_clip_max=None): every weight above the lower bound is kept as it is, however large
    weights = importance_weights(old, sampling, mask, LossConfig(is_correction=mode, is_clip_min=lo, is_clip_max=None))
    keep = [max(w, lo) if mode.endswith("truncate") else (w if w >= lo else 0.0) for w in raw]
    torch.testing.assert_close(weights[:, 0], torch.tensor(keep, dtype=torch.float64), rtol=FLOAT64_RTOL, atol=0)
