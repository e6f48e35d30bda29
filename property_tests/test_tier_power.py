"""The fp32 and bf16 tiers' power, pinned in absolute terms, independently of the constants in
``cbverify.tolerances``.

A meta-test that reads a threshold and checks behaviour "at the threshold" passes whatever the threshold is. Here the
numbers come from what was measured, stated once below, and the tier *as configured* must accept the clean noise and
catch the smallest fault: loosening or tightening a constant past these bounds fails a test.

Measured clean noise (float32, CPU, bundled Llama; the reasons in ``cbverify.tolerances`` give the runs):
- a returned log-prob differs from teacher forcing by up to 1.66e-5 at one position (hf-generate's KV-cached decode);
- over a whole workload the mean |difference| stays below 6e-8 (every engine, ``cbverify verify``);
- two engines' float32 logits differ by up to 8e-6, so a greedy flip where the top-2 logits are within 1e-5 is noise.

Smallest faults that must be caught:
- one log-prob off by 1e-4 (a stale or mis-gathered row: shifted log-probs differ by >= 1e-3 on the bundled models);
- every log-prob off by 2e-5 (a systematic error, e.g. a lower-precision log-softmax);
- a greedy token that is not the argmax where the top-2 logits differ by 1e-3 (a real decision, not noise).

bfloat16 (the bundled Llama loaded in bf16; its near-certain greedy tokens, p >= 0.999 at |logit| ~ 12.5):
- clean: a log-prob moves by up to 5.4e-3 nats at such a position (the reference against its own teacher forcing on
  the worst request of ``cbverify verify``'s workload, 7x the dtype's spacing there), and by 1.3e-5 on average over a
  workload (cb_impl, ``cbverify verify --dtype bfloat16``); two logits within 0.02 at |logit| ~ 1 may swap (the
  measured logit noise is 1.36 ulps of the logit's magnitude);
- faults: one near-certain token's log-prob off by 0.01 nats; every log-prob off by 2e-3 nats; a greedy token that is
  not the argmax where the top-2 logits differ by 0.2 at |logit| ~ 1.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from cbverify import report
from cbverify.compare import compare_tokens
from cbverify.engines.reference_engine import ReferenceEngine
from cbverify.tolerances import BF16, FP32
from reference import generate as ref_gen
from reference import tasks
from reference.models import load
from reference.spec import Rollout, RolloutRequest, SamplingParams

CLEAN_POINT_NOISE = 1.66e-5
CLEAN_MEAN_NOISE = 6e-8
CLEAN_LOGIT_GAP = 1e-5
FAULT_POINT_SHIFT = 1e-4
FAULT_SYSTEMATIC_SHIFT = 2e-5
FAULT_DECISION_GAP = 1e-3
BF16_CLEAN_SURE_SHIFT = 5.4e-3
BF16_CLEAN_MEAN = 1.3e-5
BF16_CLEAN_LOGIT_GAP = 0.02
BF16_FAULT_SURE_SHIFT = 1e-2
BF16_FAULT_SYSTEMATIC_SHIFT = 2e-3
BF16_FAULT_DECISION_GAP = 0.2


class Perturbed:
    """The oracle's own rollouts with ``shift(request index, position)`` added to the returned log-probs."""

    name = "perturbed"
    capabilities = ReferenceEngine.capabilities

    def __init__(self, rollouts: list[Rollout], shift) -> None:
        self.rollouts, self.shift = rollouts, shift

    def generate(self, requests):
        return [replace(r, logprobs=tuple(lp + self.shift(i, p) for p, lp in enumerate(r.logprobs)))
                for i, r in enumerate(self.rollouts)]  # fmt: skip


@pytest.fixture(scope="module")
def workload(llama):
    greedy, sampled = SamplingParams(temperature=0.0, max_new_tokens=12), SamplingParams(max_new_tokens=12)
    problems = tasks.make_problems(3, seed=5)
    requests = [RolloutRequest(f"r{i}-{k}", tasks.prompt_ids(p), s, seed=i, eos_token_ids=(tasks.EOS_ID,))
                for i, p in enumerate(problems) for k, s in enumerate((greedy, sampled))]  # fmt: skip
    return requests, ref_gen.generate(llama.model, requests)


def _verdict(llama, workload, shift) -> str:
    requests, reference = workload
    return report.evaluate_engine(Perturbed(reference, shift), llama.model, requests, reference, FP32).status


def test_the_tier_accepts_the_largest_clean_noise_measured(llama, workload):
    assert _verdict(llama, workload, lambda i, p: CLEAN_POINT_NOISE if (i, p) == (1, 3) else 0.0) == "PASS"
    assert _verdict(llama, workload, lambda i, p: CLEAN_MEAN_NOISE * (-1) ** p) == "PASS"


def test_the_tier_catches_one_log_prob_off_by_the_smallest_fault(llama, workload):
    assert _verdict(llama, workload, lambda i, p: FAULT_POINT_SHIFT if (i, p) == (1, 3) else 0.0) == "FAIL"


def test_the_tier_catches_a_systematic_shift_too_small_to_fail_any_single_position(llama, workload):
    assert _verdict(llama, workload, lambda i, p: FAULT_SYSTEMATIC_SHIFT) == "FAIL"


class TwoWayLogits(torch.nn.Module):
    """A stand-in model: every position's logits are 0 except token 3 (1.0) and token 4 (1.0 - gap)."""

    def __init__(self, gap: float, vocab: int = 8) -> None:
        super().__init__()
        self.gap, self.vocab = gap, vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the model a device
        self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(vocab_size=vocab))

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits[..., 3], logits[..., 4] = 1.0, 1.0 - self.gap
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize(
    ("tier", "gap", "accepted"),
    [(FP32, CLEAN_LOGIT_GAP, True), (FP32, FAULT_DECISION_GAP, False),
     (BF16, BF16_CLEAN_LOGIT_GAP, True), (BF16, BF16_FAULT_DECISION_GAP, False)],
    ids=["fp32-noise", "fp32-fault", "bf16-noise", "bf16-fault"],
)  # fmt: skip
def test_a_greedy_flip_is_noise_only_where_the_top_two_logits_are_within_the_dtypes_noise(tier, gap, accepted):
    request = RolloutRequest("r", (1, 2), SamplingParams(temperature=0.0, max_new_tokens=2))
    ours = Rollout("r", (1, 2), (3, 3), (0.0, 0.0), "length")
    flipped = Rollout("r", (1, 2), (4, 3), (0.0, 0.0), "length")
    divergence = compare_tokens(TwoWayLogits(gap), request, ours, flipped, engine="e", tier=tier)
    assert divergence is not None and divergence.position == 0
    assert divergence.accepted is accepted, divergence.describe()


@pytest.fixture(scope="module")
def bf16_greedy():
    """The bf16 Llama, greedy arithmetic rollouts, and one near-certain position (p >= 0.999) of them."""
    model = load("tiny-llama-arith", dtype="bfloat16")[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    requests = [RolloutRequest(f"r{i}", tasks.prompt_ids(p), greedy, seed=i, eos_token_ids=(tasks.EOS_ID,))
                for i, p in enumerate(tasks.make_problems(3, seed=5))]  # fmt: skip
    reference = ref_gen.generate(model, requests)
    sure = next((i, p) for i, r in enumerate(reference) for p, lp in enumerate(r.logprobs) if lp > -1e-3)
    return model, requests, reference, sure


def _bf16_verdict(bf16_greedy, shift) -> str:
    model, requests, reference, _ = bf16_greedy
    return report.evaluate_engine(Perturbed(reference, shift), model, requests, reference, BF16).status


def test_the_bf16_tier_accepts_the_largest_clean_noise_measured(bf16_greedy):
    sure = bf16_greedy[3]
    assert _bf16_verdict(bf16_greedy, lambda i, p: -BF16_CLEAN_SURE_SHIFT if (i, p) == sure else 0.0) == "PASS"
    assert _bf16_verdict(bf16_greedy, lambda i, p: BF16_CLEAN_MEAN * (-1) ** p) == "PASS"


def test_the_bf16_tier_catches_a_near_certain_log_prob_off_by_the_smallest_fault(bf16_greedy):
    sure = bf16_greedy[3]
    assert _bf16_verdict(bf16_greedy, lambda i, p: -BF16_FAULT_SURE_SHIFT if (i, p) == sure else 0.0) == "FAIL"


def test_the_bf16_tier_catches_a_systematic_shift(bf16_greedy):
    assert _bf16_verdict(bf16_greedy, lambda i, p: -BF16_FAULT_SYSTEMATIC_SHIFT) == "FAIL"
