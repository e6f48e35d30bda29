"""The reference GRPO / RLOO optimizer step (``reference.grpo_step``) against closed forms of its definitions.

The trainer configuration space (``test_trl_config_space.py``) holds this module to TRL step by step; these hold it to
the policy-gradient theorem without TRL, in a second per example: on-policy (the generating parameters are the
current ones, ``beta = 0``), every ratio is 1, so each token's loss is ``-A`` (CISPO: ``-A log p``) and the gradient
is ``-sum_t w_t A_t grad log p_t``, with the normaliser ``w_t`` each loss type documents:

- ``grpo``: ``1 / (|o_i| B)`` within its micro-batch; ``bnpo``: ``1 / (its micro-batch's tokens)``; ``dr_grpo``:
  ``1 / (B * max_completion_length)``, each divided by the number of micro-batches in the window;
- ``dapo``, ``cispo``: ``1 / (the window's tokens)``;
- RLOO: ``1 / B`` per whole sequence, divided by the number of micro-batches.

Masked tokens (``mask_truncated_completions``) carry no weight and count in no normaliser.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reference.grpo_step import (
    Row,
    StepConfig,
    completion_mask,
    rloo_window_objective,
    sequence_kl,
    window_objective,
)
from reference.logprobs import per_token_entropies, per_token_logps
from reference.loss import LossConfig
from reference.models import load, perturb

EOS = 2
MAX_LEN = 6
NOISE = 0.002


@functools.cache
def _model():
    return load("tiny-llama-arith")[0].double()


@functools.cache
def _ref_model():
    """Another model: the trained one with every weight moved by seeded noise, near enough that ratios and KL terms
    stay moderate (a random model's are ``e^20``, where float64 cancellation swamps any comparison), far enough that
    sequence ratios fall on both sides of the clip bounds."""
    model = copy.deepcopy(_model())
    perturb(model, seed=1, scale=NOISE)
    return model


rows = st.builds(
    lambda prompt, completion, eos, advantage: Row(
        tuple(prompt), tuple(completion) + ((EOS,) if eos else ()), advantage, 0
    ),  # fmt: skip
    st.lists(st.integers(3, 20), min_size=1, max_size=4),
    st.lists(st.integers(3, 20), min_size=0, max_size=MAX_LEN - 1),
    st.booleans(),
    st.floats(-2, 2),
).filter(lambda r: len(r.completion_ids) > 0)
windows = st.lists(st.lists(rows, min_size=1, max_size=3), min_size=1, max_size=3)


def _weights(micro_batches, masks, loss_type: str) -> list[list[torch.Tensor]]:
    """Per micro-batch, per row, (L_i,) the weight of each token's ``-A log p`` in the window's objective."""
    window_tokens = sum(float(m.sum()) for ms in masks for m in ms)
    n_micro = len(micro_batches)
    out = []
    for batch, ms in zip(micro_batches, masks, strict=True):
        b, tokens = len(batch), sum(float(m.sum()) for m in ms)
        if loss_type == "grpo":
            out.append([m / (len(m) * b * n_micro) for m in ms])
            continue
        denominator = {"bnpo": max(tokens, 1.0) * n_micro, "dr_grpo": b * MAX_LEN * n_micro}.get(
            loss_type, max(window_tokens, 1.0)
        )
        out.append([m / denominator for m in ms])
    return out


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
@settings(max_examples=min(25, settings().max_examples))  # per loss type: 125 windows in all under the ci profile
@given(
    window=windows,
    temperature=st.sampled_from([0.7, 1.0, 1.3]),
    mask_truncated=st.booleans(),
    epsilon_high=st.sampled_from([0.5, 5.0]),
    beta=st.sampled_from([0.0, 0.1]),
    bias_correction=st.booleans(),
    rho=st.sampled_from([1.0, 0.5]),
)
def test_on_policy_the_step_is_the_policy_gradient_with_each_loss_types_normaliser(
    loss_type, window, temperature, mask_truncated, epsilon_high, beta, bias_correction, rho
):
    """With ``beta > 0`` each token also carries ``beta * k3`` against a reference model (another model here), with
    the same normaliser: ``k3 = exp(ref - logp) - (ref - logp) - 1``, times the ratio with the bias correction (1 in
    value on-policy, ``grad logp`` in gradient); the logged KL is each micro-batch's masked mean of k3 (times the
    ratio), averaged over the micro-batches. With ``top_entropy_quantile = rho < 1`` the policy term counts only on
    tokens whose entropy is at least the ``1 - rho`` quantile of the micro-batch's unmasked entropies. Each
    micro-batch's loss is its share of the objective; the logged entropy is its masked mean entropy."""
    model, ref_model = _model(), _ref_model()
    loss = LossConfig(loss_type=loss_type, epsilon_high=epsilon_high, max_completion_length=MAX_LEN, beta=beta,
                      use_bias_correction_kl=bias_correction)  # fmt: skip
    config = StepConfig(loss, temperature, (EOS,), mask_truncated_completions=mask_truncated, top_entropy_quantile=rho)
    # CISPO weighs each token by the ratio capped at epsilon_high (a bound on the ratio itself): min(1, eps) here
    cap = min(1.0, epsilon_high) if loss_type == "cispo" else 1.0
    model.zero_grad()
    out = window_objective(window, model, {0: model}, config, ref_model=ref_model if beta else None)
    out.objective.backward()
    got = [p.grad.clone() for p in model.parameters()]

    masks = [completion_mask(batch, config) for batch in window]
    model.zero_grad()
    surrogate, value, kls, shares, entropy = torch.zeros((), dtype=torch.float64), 0.0, [], [], 0.0
    for batch, ws, ms in zip(window, _weights(window, masks, loss_type), masks, strict=True):
        prompts, completions = [r.prompt_ids for r in batch], [r.completion_ids for r in batch]
        logps = per_token_logps(model, prompts, completions, temperature, grad=True)
        refs = per_token_logps(ref_model, prompts, completions, temperature)
        es = per_token_entropies(model, prompts, completions, temperature)
        kept = [float(x) for e, m in zip(es, ms, strict=True) for x, k in zip(e, m, strict=True) if k]
        entropy += (math.fsum(kept) / len(kept) if kept else 0.0) / len(window)
        cut = float(torch.quantile(torch.tensor(kept, dtype=torch.float64), 1 - rho)) if kept and rho < 1 else None
        start, kl_sum = value, 0.0
        for row, lp, ref, w, e, m in zip(batch, logps, refs, ws, es, ms, strict=True):
            pw = w if cut is None else w * (e.double() >= cut)  # the policy term's weight
            surrogate = surrogate - row.advantage * (cap * pw * lp).sum()
            value -= row.advantage * float((cap * pw * (lp.detach() if loss_type == "cispo" else 1.0)).sum())
            k3 = torch.exp(ref.double() - lp.double()) - (ref.double() - lp.double()) - 1
            if bias_correction:
                k3 = k3 * torch.exp(lp.double() - lp.double().detach())
            surrogate = surrogate + beta * (w * k3).sum()
            value += beta * float((w * k3.detach()).sum())
            kl_sum += float((k3.detach() * m).sum())
        shares.append(value - start)
        kls.append(kl_sum / max(sum(float(m.sum()) for m in ms), 1.0))
    surrogate.backward()
    if beta:
        assert out.metrics["kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-7, abs=1e-12)
    else:
        assert "kl" not in out.metrics
    assert set(out.metrics) - {"kl"} == {
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
    }
    assert out.metrics["entropy"] == pytest.approx(entropy, rel=1e-9, abs=1e-12)
    if loss_type != "cispo":  # on-policy every ratio is 1: nothing clips (CISPO's bound is on the ratio itself)
        assert out.metrics["clip_ratio/region_mean"] == 0.0
    assert out.micro_losses == pytest.approx(shares, rel=1e-9, abs=1e-12)
    want = [p.grad.clone() for p in model.parameters()]
    assert abs(float(out.objective) - value) <= 1e-9 * max(1.0, abs(value))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-10)


@given(window=windows, mask_truncated=st.booleans(), temperature=st.sampled_from([0.7, 1.0, 1.3]))
@example(window=[[Row((5,), (EOS,), 1.0, 0)]], mask_truncated=False, temperature=0.7)  # one token: its entropy
def test_on_policy_the_rloo_step_is_the_sequence_policy_gradient(window, mask_truncated, temperature):
    """Also its logged metrics: on-policy nothing is clipped, and the entropy is each micro-batch's mean over its
    masked tokens (of the entropies at the sampling temperature), averaged over the micro-batches."""
    model = _model()
    config = StepConfig(LossConfig(), temperature, (EOS,), mask_truncated_completions=mask_truncated)
    model.zero_grad()
    out = rloo_window_objective(window, model, {0: model}, config)
    out.objective.backward()
    got = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    surrogate, value = torch.zeros((), dtype=torch.float64), 0.0
    for batch in window:
        logps = per_token_logps(model, [r.prompt_ids for r in batch], [r.completion_ids for r in batch], temperature,
                                grad=True)  # fmt: skip
        for row, lp, m in zip(batch, logps, completion_mask(batch, config), strict=True):
            surrogate = surrogate - row.advantage * (m * lp).sum() / (len(batch) * len(window))
            value -= row.advantage / (len(batch) * len(window))
    surrogate.backward()
    entropy = 0.0
    for batch in window:
        masks = completion_mask(batch, config)
        es = per_token_entropies(model, [r.prompt_ids for r in batch], [r.completion_ids for r in batch], temperature)
        kept = [float(x) for e, m in zip(es, masks, strict=True) for x, k in zip(e, m, strict=True) if k]
        entropy += (math.fsum(kept) / len(kept) if kept else 0.0) / len(window)
    assert out.metrics["entropy"] == pytest.approx(entropy, rel=1e-9, abs=1e-12)
    assert out.metrics["clip_ratio/region_mean"] == 0.0
    assert abs(float(out.objective) - value) <= 1e-9 * max(1.0, abs(value))
    assert out.micro_losses == pytest.approx([-sum(r.advantage for r in b) / len(b) for b in window], abs=1e-9)
    for g, w in zip(got, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-10)


@given(batch=st.lists(rows, min_size=1, max_size=4), temperature=st.sampled_from([0.7, 1.3]), mask=st.booleans())
def test_rloos_sequence_kl_is_each_rows_masked_log_prob_sum_under_the_generating_model_minus_the_references(
    batch, temperature, mask
):
    generating, ref = _model(), _ref_model()
    config = StepConfig(LossConfig(), temperature, (EOS,), mask_truncated_completions=mask)
    got = sequence_kl(generating, ref, batch, config)
    want = []
    for row, m in zip(batch, completion_mask(batch, config), strict=True):
        (gen,) = per_token_logps(generating, [row.prompt_ids], [row.completion_ids], temperature)
        (base,) = per_token_logps(ref, [row.prompt_ids], [row.completion_ids], temperature)
        want.append(sum(float(a - b) for a, b, k in zip(gen, base, m, strict=True) if k))
    assert got.shape == (len(batch),) and not got.requires_grad
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


@given(window=windows, epsilons=st.sampled_from([(0.2, 0.28), (0.05, 0.5)]))
def test_off_policy_the_rloo_step_clips_each_sequence_with_its_own_bounds_and_logs_the_window_means(window, epsilons):
    """Rows generated by another model (ratios far from 1, advantages of both signs): the objective is the mean over
    micro-batches of ``mean_i -min(r_i A_i, clip(r_i, 1 - eps_low, 1 + eps_high) A_i)`` (``r_i`` the ratio of
    whole-sequence probabilities), and the logged metrics are exactly these five, each the mean over micro-batches."""
    low_eps, high_eps = epsilons
    config = StepConfig(LossConfig(epsilon_low=low_eps, epsilon_high=high_eps), 1.0, (EOS,))
    model, generating = _model(), _ref_model()
    out = rloo_window_objective(window, model, {0: generating}, config)
    value, per_batch = 0.0, {"low": [], "high": [], "region": []}
    for batch in window:
        prompts, completions = [r.prompt_ids for r in batch], [r.completion_ids for r in batch]
        current = per_token_logps(model, prompts, completions, 1.0)
        old = per_token_logps(generating, prompts, completions, 1.0)
        low = high = 0
        for row, c, o in zip(batch, current, old, strict=True):
            ratio, a = math.exp(float(c.double().sum() - o.double().sum())), row.advantage
            clipped = min(max(ratio, 1 - low_eps), 1 + high_eps)
            value += -min(ratio * a, clipped * a) / (len(batch) * len(window))
            low += ratio < 1 - low_eps and a < 0
            high += ratio > 1 + high_eps and a > 0
        for name, count in (("low", low), ("high", high), ("region", low + high)):
            per_batch[name].append(count / len(batch))
    assert float(out.objective) == pytest.approx(value, rel=1e-7, abs=1e-10)
    assert set(out.metrics) == {"entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    for name in ("low", "high", "region"):
        mean = sum(per_batch[name]) / len(window)
        assert out.metrics[f"clip_ratio/{name}_mean"] == pytest.approx(mean, abs=1e-12), name


def test_a_loss_type_without_window_semantics_is_refused_with_a_value_error():
    config = StepConfig(LossConfig(loss_type="luspo"), 1.0, (EOS,))
    with pytest.raises(ValueError, match="luspo"):
        window_objective([[Row((5,), (7, EOS), 1.0, 0)]], _model(), {0: _model()}, config)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@given(window=windows)
def test_off_policy_each_token_is_clipped_against_its_generating_models_log_prob(loss_type, window):
    """Rows generated by another model: token ``t`` carries ``-min(r_t A, clip(r_t, 0.8, 1.2) A)`` with ``r_t =
    exp(logp_t - old_t)``, ``old_t`` under the generating model, with the loss type's normaliser."""
    model, generating = _model(), _ref_model()
    config = StepConfig(LossConfig(loss_type=loss_type, max_completion_length=MAX_LEN), 1.0, (EOS,))
    out = window_objective(window, model, {0: generating}, config)
    masks = [completion_mask(batch, config) for batch in window]
    value = 0.0
    for batch, ws in zip(window, _weights(window, masks, loss_type), strict=True):
        prompts, completions = [r.prompt_ids for r in batch], [r.completion_ids for r in batch]
        current = per_token_logps(model, prompts, completions, 1.0)
        old = per_token_logps(generating, prompts, completions, 1.0)
        for row, c, o, w in zip(batch, current, old, ws, strict=True):
            for lp, lo, wt in zip(c.tolist(), o.tolist(), w.tolist(), strict=True):
                r = math.exp(lp - lo)
                value += -min(r * row.advantage, min(max(r, 0.8), 1.2) * row.advantage) * wt
    assert float(out.objective) == pytest.approx(value, rel=1e-7, abs=1e-10)
