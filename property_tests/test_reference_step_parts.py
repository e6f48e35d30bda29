"""The parts of the reference step that need no model: the quantile, the entropy mask and the completion mask,
against torch's quantile and their definitions written out in the tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference.grpo_step import Row, StepConfig, completion_mask, entropy_mask, quantile
from reference.loss import LossConfig

EOS = 2


@given(values=st.lists(st.floats(-5, 5), min_size=1, max_size=30), q=st.floats(0, 1))
def test_quantile_interpolates_linearly_as_torch_does(values, q):
    t = torch.tensor(values, dtype=torch.float64)
    assert quantile(t, q) == pytest.approx(float(torch.quantile(t, q)), abs=1e-12)


@given(
    entropies=st.lists(st.lists(st.floats(0, 3), min_size=1, max_size=5), min_size=1, max_size=4),
    drop=st.lists(st.booleans(), min_size=20, max_size=20),
    rho=st.floats(0.05, 0.95),
)
def test_the_entropy_mask_keeps_the_unmasked_tokens_at_or_above_the_quantile_of_the_unmasked(entropies, drop, rho):
    es = [torch.tensor(e, dtype=torch.float64) for e in entropies]
    masks = [torch.tensor([0.0 if drop[(i * 5 + j) % 20] else 1.0 for j in range(len(e))], dtype=torch.float64)
             for i, e in enumerate(es)]  # fmt: skip
    unmasked = [float(x) for e, m in zip(es, masks, strict=True) for x, k in zip(e, m, strict=True) if k]
    got = entropy_mask(es, masks, rho)
    if not unmasked:
        assert all(float(g.sum()) == 0 for g in got)
        return
    threshold = float(torch.quantile(torch.tensor(unmasked, dtype=torch.float64), 1 - rho))
    for e, m, g in zip(es, masks, got, strict=True):
        assert g.dtype == torch.float64
        assert g.tolist() == [1.0 if k and float(x) >= threshold else 0.0 for x, k in zip(e, m, strict=True)]
    with pytest.raises(ValueError):  # a mask per row: one missing is an error, not a shorter answer
        entropy_mask(es, masks[:-1] if len(masks) > 1 else [*masks, masks[0]], rho)


def test_a_truncated_completion_is_masked_only_when_asked():
    batch = [Row((5,), (7, EOS), 1.0, 0), Row((5,), (7, 8), 1.0, 0), Row((5,), (EOS, 9), 1.0, 0)]
    for flag, want in ((False, [[1, 1], [1, 1], [1, 1]]), (True, [[1, 1], [0, 0], [0, 0]])):
        config = StepConfig(LossConfig(), 1.0, (EOS,), mask_truncated_completions=flag)
        assert [m.tolist() for m in completion_mask(batch, config)] == want
