"""``reference.loss`` at the edges of its domain: ``LossConfig``'s accepted and refused values, the clip fractions at
exactly a bound, and the importance weights ``grpo_loss`` reports.

Expected values are computed by hand (exact float64 log-ratios, ``math``).
"""

from __future__ import annotations

import math

import pytest
import torch

from cbverify.tolerances import FLOAT64_RTOL
from reference.loss import LossConfig, grpo_loss


@pytest.mark.parametrize(("loss_type", "epsilon_high", "want"), [("grpo", 0.0, (1, 1)), ("cispo", 1.0, (0, 1))])
def test_the_clip_fractions_count_ratios_strictly_beyond_a_bound_and_advantages_of_the_bounds_sign(
    loss_type, epsilon_high, want
):
    """One token per sequence. With both bounds at a ratio of exactly 1 (grpo with epsilon 0; cispo with its cap
    at 1), rows on a bound are not clipped, nor is a row beyond a bound whose advantage is 0 (TRL's
    ``is_low_clipped`` / ``is_high_clipped``); one row beyond each bound with an advantage of that bound's sign is."""
    d = torch.tensor([[0.0], [0.0], [0.5], [0.5], [-0.5], [-0.5]], dtype=torch.float64)  # log-ratios, exact
    advantages = torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0, 0.0], dtype=torch.float64)
    old = torch.full_like(d, -1.0)
    config = LossConfig(loss_type=loss_type, epsilon_low=0.0, epsilon_high=epsilon_high)
    out = grpo_loss(old + d, old, None, None, advantages, torch.ones_like(d), config)
    low, high = want  # rows clipped at the low bound (row 4) and at the high one (row 3)
    assert (out.clip_low_fraction, out.clip_high_fraction, out.clip_fraction) == (low / 6, high / 6, (low + high) / 6)
    assert out.is_weights is None, "no importance-sampling correction configured"


def test_loss_configs_accept_the_edges_of_their_domain_and_refuse_each_value_outside_it_by_name():
    for ok in (dict(epsilon_low=0.0, epsilon_high=0.0, beta=0.0), dict(delta=1e-9), dict(delta=0.5),
               dict(loss_type="dr_grpo", max_completion_length=1), dict(is_clip_min=0.5, is_clip_max=0.6),
               dict(is_correction="token_truncate", is_clip_min=0.5, is_clip_max=None)):  # fmt: skip
        LossConfig(**ok)
    bad = {"epsilon_low must be a finite number >= 0": [dict(epsilon_low=-0.1), dict(epsilon_low=math.inf),
                                                        dict(epsilon_low="0.2")],
           "beta must be a finite number >= 0": [dict(beta=-1e-9), dict(beta=math.nan)],
           "delta must be a finite number > 0": [dict(delta=0.0), dict(delta=-1.0), dict(delta=math.inf)],
           "loss_type='dr_grpo' needs max_completion_length": [
               dict(loss_type="dr_grpo", max_completion_length=n) for n in (None, 0, 2.5)],
           r"is_clip_min \(0.5\) must be < is_clip_max \(0.5\)": [dict(is_clip_min=0.5, is_clip_max=0.5)],
           "is_correction='sequence_truncate' needs is_clip_min or is_clip_max": [
               dict(is_correction="sequence_truncate", is_clip_min=None, is_clip_max=None)],
           "importance_sampling_level must be one of": [dict(importance_sampling_level="batch")],
           "is_correction must be None or one of": [dict(is_correction="clip")]}  # fmt: skip
    for message, cases in bad.items():
        for changes in cases:
            with pytest.raises(ValueError, match=message):
                LossConfig(**changes)


def test_grpo_loss_reports_the_importance_weights_it_applied():
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    sampling = torch.tensor([[-1.5, -0.5]], dtype=torch.float64)  # raw weights e^0.5 and e^-1.5
    config = LossConfig(is_correction="token_truncate", is_clip_min=0.5, is_clip_max=1.5)
    out = grpo_loss(old.clone(), old, None, sampling, torch.tensor([1.0], dtype=torch.float64), torch.ones_like(old),
                    config)  # fmt: skip
    want = torch.tensor([[min(math.exp(0.5), 1.5), max(math.exp(-1.5), 0.5)]], dtype=torch.float64)
    torch.testing.assert_close(out.is_weights, want, rtol=FLOAT64_RTOL, atol=0.0)
