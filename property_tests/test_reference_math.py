"""Properties of the reference GRPO math: each follows from the definitions, not from TRL.

Expected values are computed independently: REINFORCE gradients and IS weights by plain Python loops over tokens,
the trust region from its definition.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from cbverify.tolerances import FLOAT64_ATOL, FLOAT64_CANCELLATION_ATOL, FLOAT64_RTOL
from property_tests.strategies import grpo_batches, loss_configs
from reference.advantages import combine_rewards, compute_advantages, rloo_advantages
from reference.loss import LossConfig, grpo_loss, k3_kl, rloo_loss


def _grad(batch: dict, advantages: torch.Tensor, config: LossConfig, *, old: torch.Tensor | None) -> torch.Tensor:
    per = batch["per_token_logps"].clone().requires_grad_(True)
    out = grpo_loss(per, old, batch["ref_per_token_logps"], batch["sampling_per_token_logps"], advantages,
                    batch["completion_mask"], config)  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, per)
    return grad


def _advantages(batch: dict) -> torch.Tensor:
    return compute_advantages(batch["rewards"], batch["num_generations"], "group")


@given(batch=grpo_batches(), config=loss_configs(is_correction=False))
def test_on_policy_ratio_is_exactly_one_and_the_gradient_is_reinforce(batch, config):
    config = dataclasses.replace(config, beta=0.0)
    per, mask = batch["per_token_logps"], batch["completion_mask"]
    advantages = _advantages(batch)
    out = grpo_loss(per, None, None, None, advantages, mask, config)
    assert torch.equal(out.ratio, torch.ones_like(out.ratio))
    grad = _grad(batch, advantages, config, old=None)

    num_seqs, width = mask.shape
    total = int(mask.sum())
    cap = min(1.0, config.epsilon_high) if config.loss_type == "cispo" else 1.0  # CISPO's stop-gradient weight
    for i in range(num_seqs):
        count = int(mask[i].sum())
        for t in range(width):
            # d/dlogp of the REINFORCE surrogate -A * logp under each documented normaliser
            normaliser = {"grpo": num_seqs * count, "bnpo": total, "dapo": total, "cispo": total, "luspo": num_seqs,
                          "dr_grpo": num_seqs * (config.max_completion_length or 0)}[config.loss_type]  # fmt: skip
            expected = -cap * float(advantages[i]) / normaliser if mask[i, t] else 0.0
            assert math.isclose(float(grad[i, t]), expected, rel_tol=FLOAT64_RTOL, abs_tol=FLOAT64_ATOL), (i, t)


@given(batch=grpo_batches(max_log_ratio=1.5), config=loss_configs(loss_types=("grpo", "bnpo", "dr_grpo", "dapo")))
def test_clipping_zeroes_the_gradient_exactly_outside_the_trust_region_on_the_advantage_side(batch, config):
    config = dataclasses.replace(config, beta=0.0, is_correction=None, importance_sampling_level="token")
    per, old, mask = batch["per_token_logps"], batch["old_per_token_logps"], batch["completion_mask"]
    advantages = _advantages(batch)
    grad = _grad(batch, advantages, config, old=old)
    for i, t in zip(*torch.nonzero(mask, as_tuple=True), strict=True):
        ratio, adv = math.exp(float(per[i, t] - old[i, t])), float(advantages[i])
        bounds = [1 - config.epsilon_low, 1 + config.epsilon_high] + ([config.delta] if config.delta else [])
        assume(
            all(abs(ratio - b) > FLOAT64_RTOL for b in bounds)
        )  # exactly on a boundary the subgradient is a convention
        outside = (
            adv == 0.0
            or (adv > 0 and ratio > 1 + config.epsilon_high)
            or (adv < 0 and ratio < 1 - config.epsilon_low)
            or (adv < 0 and config.delta is not None and ratio > config.delta)  # two-sided clipping
        )
        assert (float(grad[i, t]) == 0.0) == outside, (int(i), int(t), ratio, adv)


@given(
    policy=st.lists(st.floats(-30.0, 0.0), min_size=1, max_size=50),
    shift=st.lists(st.just(0.0) | st.floats(1e-6, 5.0) | st.floats(-5.0, -1e-6), min_size=50, max_size=50),
)
def test_k3_is_nonnegative_and_zero_exactly_where_the_log_probs_are_equal(policy, shift):
    # nonzero differences are drawn >= 1e-6 in size: below ~1e-8, float64 cannot resolve exp(d) - d - 1 from 0
    per = torch.tensor(policy, dtype=torch.float64)
    ref = per + torch.tensor(shift[: len(policy)], dtype=torch.float64)
    kl = k3_kl(per, ref)
    assert (kl >= 0).all()
    assert torch.equal(kl == 0, ref == per)


@given(batch=grpo_batches(), scale=st.sampled_from(["group", "batch", "none"]))
def test_advantages_have_zero_mean_over_each_groups_scorable_rewards(batch, scale):
    rewards, n = batch["rewards"], batch["num_generations"]
    advantages = compute_advantages(rewards, n, scale)
    for start in range(0, len(rewards), n):
        scorable = ~torch.isnan(rewards[start : start + n])
        assert (advantages[start : start + n][~scorable] == 0).all()  # unscorable completions are not pushed
        assert abs(float(advantages[start : start + n][scorable].sum())) < FLOAT64_RTOL


@given(batch=grpo_batches())
def test_rloo_advantages_are_the_scaled_group_deviation(batch):
    """Leave-one-out over the ``k`` scorable members of a group is ``k / (k - 1) * (r - mean)`` (a closed form, not
    the loop the reference runs); unscorable members and lone scorable ones get 0; normalising standardises the
    non-zero-by-rule advantages over the batch."""
    rewards, n = batch["rewards"], batch["num_generations"]
    got = rloo_advantages(rewards, n)
    for start in range(0, len(rewards), n):
        group = rewards[start : start + n]
        scorable = ~torch.isnan(group)
        k = int(scorable.sum())
        want = torch.zeros(n, dtype=torch.float64)
        if k >= 2 and n > 1:
            want[scorable] = k / (k - 1) * (group[scorable] - group[scorable].mean())
        torch.testing.assert_close(got[start : start + n], want, rtol=FLOAT64_RTOL, atol=FLOAT64_CANCELLATION_ATOL)
    defined = torch.tensor([not math.isnan(float(r)) for r in rewards])
    for start in range(0, len(rewards), n):  # a member is defined when it and a sibling are scorable
        if int(defined[start : start + n].sum()) < 2:
            defined[start : start + n] = False
    normalised = rloo_advantages(rewards, n, normalize=True)
    assert (normalised[~defined] == 0).all()
    if int(defined.sum()) >= 2:
        kept = got[defined]
        want = (kept - kept.mean()) / (kept.std() + 1e-4)
        torch.testing.assert_close(normalised[defined], want, rtol=FLOAT64_RTOL, atol=FLOAT64_CANCELLATION_ATOL)


@given(batch=grpo_batches(), scale=st.sampled_from(["group", "none"]), data=st.data())
def test_advantages_ignore_a_per_group_constant_and_batch_scaling_a_global_one(batch, scale, data):
    rewards, n = batch["rewards"], batch["num_generations"]
    num_groups = len(rewards) // n
    offsets = data.draw(st.lists(st.sampled_from([-2.0, -0.5, 0.25, 1.0, 3.0]), min_size=num_groups,
                                 max_size=num_groups))  # fmt: skip
    shifted = rewards + torch.tensor(offsets, dtype=torch.float64).repeat_interleave(n)
    torch.testing.assert_close(compute_advantages(shifted, n, scale), compute_advantages(rewards, n, scale),
                               rtol=0.0, atol=FLOAT64_CANCELLATION_ATOL)  # fmt: skip
    shifted_all = rewards + offsets[0]
    torch.testing.assert_close(compute_advantages(shifted_all, n, "batch"), compute_advantages(rewards, n, "batch"),
                               rtol=0.0, atol=FLOAT64_CANCELLATION_ATOL)  # fmt: skip


@given(batch=grpo_batches(nan_rewards=False), config=loss_configs(), data=st.data())
def test_constant_reward_groups_contribute_no_policy_gradient(batch, config, data):
    config = dataclasses.replace(config, beta=0.0)
    rewards, n = batch["rewards"].clone(), batch["num_generations"]
    group = data.draw(st.integers(0, len(rewards) // n - 1))
    rewards[group * n : (group + 1) * n] = data.draw(st.sampled_from([0.0, 1.0, 0.7]))
    advantages = compute_advantages(rewards, n, data.draw(st.sampled_from(["group", "batch", "none"])))
    grad = _grad(batch, advantages, config, old=batch["old_per_token_logps"])
    assert (grad[group * n : (group + 1) * n] == 0).all()


@given(batch=grpo_batches(), config=loss_configs(), junk=st.floats(-5.0, 0.0))
def test_normalisers_behave_as_documented(batch, config, junk):
    per, old, ref = batch["per_token_logps"], batch["old_per_token_logps"], batch["ref_per_token_logps"]
    sampling, mask, advantages = batch["sampling_per_token_logps"], batch["completion_mask"], _advantages(batch)
    base = grpo_loss(per, old, ref, sampling, advantages, mask, config).loss

    # 1. extra padding columns (junk values, mask 0) change nothing
    def pad(x: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, 2), value=value)

    padded = grpo_loss(pad(per, junk), pad(old, junk), pad(ref, junk), pad(sampling, junk), advantages,
                       pad(mask, 0), config).loss  # fmt: skip
    torch.testing.assert_close(padded, base, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)

    # 2. an extra empty sequence: per-sequence normalisers (grpo, dr_grpo, luspo) scale by B/(B+1), token ones do not
    def row(x: torch.Tensor, value: float) -> torch.Tensor:
        return torch.cat([x, torch.full_like(x[:1], value)])

    extended = grpo_loss(row(per, junk), row(old, junk), row(ref, junk), row(sampling, junk),
                         torch.cat([advantages, advantages[:1]]), row(mask, 0), config).loss  # fmt: skip
    num_seqs = mask.shape[0]
    factor = num_seqs / (num_seqs + 1) if config.loss_type in ("grpo", "dr_grpo", "luspo") else 1.0
    torch.testing.assert_close(extended, base * factor, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)

    # 3. when every sequence has the same length, grpo, bnpo and dapo agree
    if config.loss_type in ("grpo", "bnpo", "dapo"):
        full = torch.ones_like(mask)
        same = [grpo_loss(per, old, ref, sampling, advantages, full, dataclasses.replace(config, loss_type=kind)).loss
                for kind in ("grpo", "bnpo", "dapo")]  # fmt: skip
        torch.testing.assert_close(same[0], same[1], rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
        torch.testing.assert_close(same[1], same[2], rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)


@given(
    rows=st.lists(
        st.tuples(st.floats(-3, 3), st.floats(-3, 3), st.just(0.0) | st.floats(-2, 2)), min_size=1, max_size=8
    ),
    epsilon_low=st.floats(0.05, 0.5),
    epsilon_high=st.one_of(st.none(), st.floats(0.05, 0.5)),
)
@example(  # ratios exactly at 1 - eps and 1 + eps (not clipped), beyond them, and between 1 + eps and 2 + eps
    rows=[(math.log(r), 0.0, a) for r, a in ((1.25, 1.0), (0.75, -1.0), (1.5, 1.0), (0.5, -1.0), (1.0, 1.0))],
    epsilon_low=0.25, epsilon_high=0.25,
)  # fmt: skip
def test_rloo_loss_is_ppo_clipping_on_whole_sequences_by_definition(rows, epsilon_low, epsilon_high):
    """Value, clip fractions and gradient of ``rloo_loss`` against a loop over sequences: the loss of sequence i is
    ``-min(r A, clip(r) A)``; its gradient in ``logp_i`` is ``-r A / B`` where the unclipped term is the minimum,
    0 where the clipped one is (strictly)."""
    high = epsilon_low if epsilon_high is None else epsilon_high
    logps = torch.tensor([r[0] for r in rows], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    adv = torch.tensor([r[2] for r in rows], dtype=torch.float64)
    out = rloo_loss(logps, old, adv, epsilon_low, epsilon_high)
    (grad,) = torch.autograd.grad(out.loss, logps)
    n, value, low, up = len(rows), 0.0, 0, 0
    for i, (lp, o, a) in enumerate(rows):
        ratio = math.exp(lp - o)
        clipped = min(max(ratio, 1 - epsilon_low), 1 + high)
        value += -min(ratio * a, clipped * a) / n
        low += ratio < 1 - epsilon_low and a < 0
        up += ratio > 1 + high and a > 0
        want = -ratio * a / n if ratio * a < clipped * a else 0.0 if ratio * a > clipped * a else None
        if want is not None:  # at a tie (unclipped inside the range, or A = 0) either branch's gradient is right
            assert math.isclose(float(grad[i]), want, rel_tol=1e-9, abs_tol=1e-12), (i, float(grad[i]), want)
    assert math.isclose(float(out.loss), value, rel_tol=1e-9, abs_tol=1e-12)
    assert (out.clip_low_fraction, out.clip_high_fraction) == (low / n, up / n)
    assert out.clip_fraction == (low + up) / n
    ratios = [math.exp(lp - o) for lp, o, _ in rows]  # the per-sequence ratio, one column
    assert out.ratio.shape == (n, 1) and out.ratio[:, 0].tolist() == pytest.approx(ratios, rel=1e-12)


@given(
    columns=st.integers(1, 3).flatmap(
        lambda f: st.integers(1, 5).flatmap(
            lambda b: st.lists(
                st.lists(st.one_of(st.none(), st.floats(-3, 3)), min_size=b, max_size=b), min_size=f, max_size=f
            )  # fmt: skip
        )
    ),
    data=st.data(),
)
def test_combined_rewards_are_the_weighted_sum_of_the_functions_that_scored_each_row(columns, data):
    weights = data.draw(st.one_of(st.none(), st.lists(st.floats(-2, 2), min_size=len(columns), max_size=len(columns))))
    got = combine_rewards(columns, weights).tolist()
    w = weights or [1.0] * len(columns)
    for b, value in enumerate(got):
        scored = [(w[f], col[b]) for f, col in enumerate(columns) if col[b] is not None]
        if not scored:
            assert math.isnan(value)
        else:
            assert math.isclose(value, sum(x * r for x, r in scored), rel_tol=1e-12, abs_tol=1e-12)
    with pytest.raises(ValueError, match="weights for"):
        combine_rewards(columns, [1.0] * (len(columns) + 1))
    with pytest.raises(ValueError, match="different numbers of rows"):
        combine_rewards([*columns, [0.0] * (len(columns[0]) + 1)])
    with pytest.raises(ValueError, match="at least one"):
        combine_rewards([])


def test_rloo_advantages_refuse_what_makes_no_groups_with_a_value_error():
    for rewards, n in ((torch.ones(4), 0), (torch.ones(4), 2.0), (torch.ones(2, 2), 2), (torch.ones(5), 2)):
        with pytest.raises(ValueError):
            rloo_advantages(rewards, n)


def test_compute_advantages_defaults_to_group_scaling_scales_a_batch_of_two_and_refuses_what_makes_no_groups():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    assert torch.equal(compute_advantages(rewards, 2), compute_advantages(rewards, 2, "group"))
    pair = torch.tensor([1.0, 0.0], dtype=torch.float64)  # one group of two: the batch std is the group's, sqrt(1/2)
    want = torch.tensor([0.5, -0.5], dtype=torch.float64) / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(compute_advantages(pair, 2, "batch"), want, rtol=FLOAT64_RTOL, atol=0)
    for bad, n in ((torch.ones(4), 0), (torch.ones(4), 2.0), (torch.ones(2, 2), 2), (torch.ones(5), 2)):
        with pytest.raises(ValueError):
            compute_advantages(bad, n)


def test_masked_mean_averages_real_tokens_or_whole_sequences_as_trl_logs_them():
    from reference.loss import masked_mean

    mask = torch.tensor([[1.0, 1.0, 0.0]])  # one sequence of two real tokens
    assert masked_mean(torch.tensor([[2.0, 4.0, 100.0]]), mask) == 3.0  # per token: the real ones
    assert masked_mean(torch.tensor([[5.0]]), mask) == 5.0  # per sequence (B, 1): over sequences, here one
    two = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert masked_mean(torch.tensor([[3.0], [6.0]]), two) == 4.5  # per sequence with T = 2
    assert masked_mean(torch.tensor([[7.0]]), torch.tensor([[1.0]])) == 7.0  # T = 1: one token, by the mask
    assert masked_mean(torch.tensor([[7.0]]), torch.tensor([[0.0]])) == 0.0  # no real token
