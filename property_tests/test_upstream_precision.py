"""The trainer's precision is its own config's: ``trainer_precision_follows_its_config`` catches a trainer that
inherits bf16 from one built before it in the process (transformers 4.x, planted here on the installed release), and
the upstream harness keeps one scenario's precision out of the next."""

from __future__ import annotations

import os

import pytest

from cbverify.upstream import checks
from cbverify.upstream.capture import Capture
from cbverify.upstream.findings import FAIL, PASS, by_id
from cbverify.upstream.scenario import TrainerScenario
from cbverify.upstream.suite import check_scenario

pytestmark = pytest.mark.upstream
LEAK = by_id("bf16-config-leaks-into-later-trainers")
CHECK = "trainer_precision_follows_its_config"


@pytest.fixture
def writes_its_precision_to_the_environment(monkeypatch):
    """transformers 4.x's ``TrainingArguments.__post_init__``: its bf16 choice written to
    ``ACCELERATE_MIXED_PRECISION``, which every later ``TrainingArguments`` reads as its default (the installed release
    reads it too)."""
    from transformers import TrainingArguments

    original = TrainingArguments.__post_init__

    def post_init(self):
        original(self)
        if self.bf16:
            os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(TrainingArguments, "__post_init__", post_init)


def test_a_trainer_built_after_a_bf16_one_is_caught_and_the_next_scenario_starts_clean(
    llama, writes_its_precision_to_the_environment
):
    bf16_run = {r.check: r for r in check_scenario(TrainerScenario(bf16=True, greedy=True), *llama)}
    assert bf16_run[CHECK].status == PASS, bf16_run[CHECK].reason
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ, "a scenario's precision outlived its run"
    clean = {r.check: r for r in check_scenario(TrainerScenario(greedy=True), *llama)}
    assert clean[CHECK].status == PASS, clean[CHECK].reason
    leaked = {r.check: r for r in check_scenario(LEAK.repro, *llama)}
    assert leaked[CHECK].status == FAIL, leaked[CHECK].reason
    assert LEAK.predicts[CHECK].mismatch(leaked[CHECK], LEAK.repro) is None, leaked[CHECK].reason
    # the log-probs are judged at the precision the trainer really ran in, and still hold there
    assert leaked["trainer_logprobs_match_reference"].status == PASS, leaked["trainer_logprobs_match_reference"].reason
    assert "bf16 tier" in leaked["trainer_logprobs_match_reference"].reason


@pytest.mark.parametrize(
    ("bf16", "launched", "ran", "status"),
    [(False, "no", "no", PASS), (False, "no", "bf16", FAIL), (False, "bf16", "bf16", PASS), (True, "no", "no", FAIL),
     (True, "no", "bf16", PASS), (False, "bf16", "no", FAIL)],
)  # fmt: skip
def test_the_expected_precision_is_the_config_s_else_the_launcher_s(bf16, launched, ran, status):
    capture = Capture(trainer_info={"mixed_precision": ran, "launch_mixed_precision": launched})
    (result,) = checks.trainer_precision_follows_its_config(TrainerScenario(bf16=bf16), capture)
    assert result.status == status, result.reason
