"""bfloat16: clean engines pass in the tier of their dtype (bounds in units of each row's logit scale), and a sampled
token just outside the reference's top-p cut is a near-tie of that cut, not an infinite log-prob error; a token far
outside it still fails. The faulty engines are caught in bf16 too (``test_meta_power.py``, parametrized by dtype).
"""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbverify import compare, report
from cbverify.divergence import boundary_tokens, cut_allowance
from cbverify.engines.reference_engine import ReferenceEngine
from cbverify.tolerances import tier_for
from reference import logprobs as ref_logprobs
from reference.generate import process_logits
from reference.models import load
from reference.spec import Rollout, RolloutRequest, SamplingParams, gumbel_noise

VERIFY_SAMPLING = SamplingParams(temperature=1.0, top_k=10, top_p=0.95, max_new_tokens=64)
# Requests of the `cbverify verify` workload (seed 0) on which the reference failed against its own teacher forcing
# under the former flat bf16 bound of 5e-2: 0.0516 at |logit| ~ 13 (Llama), 0.084 at a top-p cut (Qwen2).
SELF_FAILURES = {
    "tiny-llama-arith": RolloutRequest(
        "q5-sampled",
        (1, 19, 17, 6, 5, 13, 9, 11, 13, 12, 3, 13, 10, 10, 22),
        VERIFY_SAMPLING,
        seed=5,
        eos_token_ids=(2,),
    ),
    "tiny-qwen2-random": RolloutRequest(
        "q2-sampled", (1, 19, 17, 9, 4, 13, 7, 8, 13, 10, 7, 22), VERIFY_SAMPLING, seed=2, eos_token_ids=(2,)
    ),
}
PROMPT = (1, 6, 5, 16, 7, 5, 3)


@pytest.mark.parametrize("name", sorted(SELF_FAILURES))
def test_the_reference_passes_against_its_own_teacher_forcing_in_bfloat16_on_each_bundled_model(name):
    model, _ = load(name, dtype="bfloat16")
    request = SELF_FAILURES[name]
    reference = ReferenceEngine(model).generate([request])
    row = report.evaluate_engine(ReferenceEngine(model), model, [request], reference, tier_for("bfloat16"))
    assert row.status == "PASS", row.problems


@pytest.fixture(scope="module")
def qwen2_bf16():
    return load("tiny-qwen2-random", dtype="bfloat16")[0]


def _engine_rollout(model, request: RolloutRequest, token: int) -> Rollout:
    """A one-token rollout of ``token`` with the log-prob an engine whose cut kept it would report."""
    logits = ref_logprobs.completion_logits(model, request.prompt_ids, [token])[0]  # (V,)
    keep = torch.isfinite(process_logits(logits, request.sampling))  # (V,)
    keep[token] = True
    logprob = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)[token]
    return Rollout(request.request_id, request.prompt_ids, (token,), (float(logprob),), "length")


def test_a_sampled_token_just_outside_the_top_p_cut_is_a_near_tie_of_the_cut_and_a_far_one_fails(qwen2_bf16):
    tier = tier_for("bfloat16")
    logits = ref_logprobs.completion_logits(qwen2_bf16, PROMPT, [0])[0]  # (V,)
    noise = tier.near_tie_gap / 2 * tier.unit(float(logits.abs().max()))
    for top_p in (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95):  # a cut with a removed token within bf16 noise of it
        sampling = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=1)
        kept = torch.isfinite(process_logits(logits, sampling))  # (V,)
        edge = boundary_tokens(logits, sampling, noise)  # (V,)
        if bool((edge & ~kept).any()):
            break
    else:
        pytest.fail("no top-p cut of this row has a removed token within bf16 noise")
    for seed in range(50):  # a seed whose Gumbel race, over the kept tokens and the cut, is won by a removed one
        noise = gumbel_noise(torch.tensor([seed]), torch.tensor([0]), logits.numel())[0]  # (V,)
        winner = int((logits.double() + noise).masked_fill(~(kept | edge), float("-inf")).argmax())
        if not kept[winner]:
            break
    else:
        pytest.fail("no seed in 50 samples the token outside the cut")
    request = RolloutRequest("cut", PROMPT, sampling, seed=seed, eos_token_ids=())
    reference = ReferenceEngine(qwen2_bf16).generate([request])[0]
    near = _engine_rollout(qwen2_bf16, request, winner)
    div = compare.compare_tokens(qwen2_bf16, request, reference, near, engine="near-cut", tier=tier)
    assert div is not None and div.accepted and div.engine_score == float("-inf"), div.describe()
    diff = compare.judge_logprobs(qwen2_bf16, [request], [near], "processed", tier)
    assert diff.skipped_at_cut == 1 and diff.within(tier), diff
    far = _engine_rollout(qwen2_bf16, request, int(logits.argmin()))
    assert not compare.compare_tokens(qwen2_bf16, request, reference, far, engine="far", tier=tier).accepted
    assert compare.judge_logprobs(qwen2_bf16, [request], [far], "processed", tier).max_abs == float("inf")


def test_the_divergence_report_gives_the_engine_token_rank_under_the_reference_not_a_copy_of_its_top5(qwen2_bf16):
    request = RolloutRequest("r", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=1), eos_token_ids=())
    reference = ReferenceEngine(qwen2_bf16).generate([request])[0]
    logits = ref_logprobs.completion_logits(qwen2_bf16, PROMPT, [0])[0]  # (V,)
    third = int(torch.topk(logits, 3).indices[2])
    other = Rollout("r", PROMPT, (third,), (0.0,), "length")
    div = compare.compare_tokens(qwen2_bf16, request, reference, other, engine="e", tier=tier_for("bfloat16"))
    assert div.engine_rank == 3 and div.engine_score == pytest.approx(float(logits[third]))
    assert "engine token under the reference: rank 3" in div.describe() and "engine    top-5" not in div.describe()


@settings(max_examples=1000)  # ~0.02 s an example; the corner cases are rare among random rows
@given(
    logits=hnp.arrays(np.float64, st.integers(2, 40), elements=st.floats(-4, 4)),
    temperature=st.sampled_from([0.6, 1.0, 1.4]),
    top_k=st.sampled_from([0, 1, 3, 10]),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5]),
    min_p=st.sampled_from([0.0, 0.05, 0.2]),
    noise=st.floats(1e-3, 1.0),
    seed=st.integers(0, 2**16),
)
def test_a_change_of_the_kept_set_within_the_noise_moves_the_kept_mass_by_at_most_the_cut_allowance(
    logits, temperature, top_k, top_p, min_p, noise, seed
):
    """The golden check's exemption at a processor cut is exact: however each logit moves within ``noise``, the kept
    set it leads to holds a mass (under the unmoved probabilities) within ``cut_allowance`` of the original's, in
    log space (the processed log-prob of a kept token moves by that, beyond its full-support change)."""
    row = torch.tensor(logits, dtype=torch.float32)  # (V,)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_new_tokens=1)
    # each logit at an end of its range (the worst cases lie on the corners): +-noise, signs drawn
    signs = torch.randint(0, 2, row.shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1  # (V,)
    moved = row + signs * noise  # (V,)
    probs = torch.softmax(row.double() / temperature, dim=-1)  # (V,)
    kept, kept_moved = (torch.isfinite(process_logits(r, sampling)) for r in (row, moved))  # (V,) each
    change = abs(math.log(float(probs[kept_moved].sum())) - math.log(float(probs[kept].sum())))
    assert change <= cut_allowance(row, sampling, noise) + 1e-9
