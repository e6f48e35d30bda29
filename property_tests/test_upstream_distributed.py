"""Multi-process GRPO (``cbverify.upstream.distributed``): TRL's trainer on 2 CPU processes under torchrun, every
single-process check on each rank and the checks across ranks; and faulty ranks caught by a named check.

Model: the bundled random-weight Qwen2 (flat distributions: completions differ between group members, so rewards,
advantages and gradients are not zero). Each launch costs 10-20 s on 2 cores; the default run makes six.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from cbverify.upstream.distributed import (
    DISTRIBUTED_SCENARIOS,
    RANK_CHECKS,
    check_ranks,
    launch,
    one_process_equivalent,
    run_distributed,
)
from cbverify.upstream.suite import judge

pytestmark = [pytest.mark.upstream, pytest.mark.distributed]
MODEL = "tiny-qwen2-random"
FAULTY = "property_tests.faulty_ranks"
# the scenarios on the bundled random Qwen2 itself (their random_weights would redraw it; run_distributed does that)
SCENARIOS = tuple(replace(s, random_weights=False) for s in DISTRIBUTED_SCENARIOS)
# one prompt per process (groups of 2, 2 rows each): a rank handed another rank's rows gets another prompt's
PER_RANK_PROMPTS = replace(SCENARIOS[0], num_generations=2)


def _statuses(results) -> dict[str, str]:
    return {r.check: r.status for r in results}


def _unexpected(scenario, results, model_type: str) -> list[str]:
    return [f"{label}: {r.check}: {r.reason}" for r in results
            for ok, label in [judge(r, scenario, model_type)] if not ok]  # fmt: skip


def test_two_processes_keep_every_invariant_and_train_as_one_process_would(qwen2):
    """Groups of 4 split over 2 processes, cb_impl-free oracle rollouts: the ranks together are the global batch,
    weights stay identical, and the step's gradient and every logged number equal one process's on the same batch."""
    scenario = SCENARIOS[0]
    results = [r for _, r in run_distributed([scenario], MODEL, qwen2.model, progress=False)[0]]
    assert not _unexpected(scenario, results, "qwen2"), _unexpected(scenario, results, "qwen2")
    statuses = _statuses(results)
    assert all(statuses[c] == "PASS" for c in RANK_CHECKS), statuses


@pytest.mark.parametrize(
    ("fault", "check"),
    [("swap", "completions_aligned"),
     pytest.param("unscaled", "ranks_match_one_process", marks=pytest.mark.slow)],  # two launches: ~25 s
)  # fmt: skip
def test_a_faulty_rank_is_caught_by_the_named_check(qwen2, monkeypatch, fault, check):
    """``swap``: a rollout_func answering with the next rank's rows; ``unscaled``: a loss normaliser that forgets
    that gradients are averaged over processes (the 2-process gradient is half the single process's)."""
    monkeypatch.setenv("CBVERIFY_RANK_FAULT", fault)
    scenario = PER_RANK_PROMPTS if fault == "swap" else SCENARIOS[0]
    run = launch(scenario, MODEL, module=FAULTY)
    one = launch(one_process_equivalent(scenario), MODEL) if check == "ranks_match_one_process" else None
    statuses = _statuses(check_ranks(scenario, run, qwen2.model, one))
    assert statuses[check] == "FAIL", statuses


@pytest.mark.slow  # ~16 s
def test_a_model_error_on_one_rank_stops_every_rank_and_is_reported(qwen2, monkeypatch):
    """The last rank's rollout_func raises: the launch ends well inside its timeout (no rank left waiting in a
    collective, none training on empty completions) and run_completes names the error."""
    monkeypatch.setenv("CBVERIFY_RANK_FAULT", "raise")
    start = time.perf_counter()
    run = launch(SCENARIOS[0], MODEL, module=FAULTY, timeout_s=300)
    assert run.returncode not in (0, None) and time.perf_counter() - start < 240, (run.returncode, run.log)
    results = check_ranks(SCENARIOS[0], run, qwen2.model)
    (completes,) = [r for r in results if r.check == "run_completes"]
    assert completes.status == "FAIL" and "injected model error" in completes.reason, completes.reason


@pytest.mark.slow  # ~11 s
def test_accelerate_launch_without_a_config_is_reported_as_one_process(qwen2, tmp_path, monkeypatch):
    """``accelerate launch --cpu --num_processes 2`` with no accelerate config runs one single-process job."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no user accelerate config
    run = launch(SCENARIOS[0], MODEL, launcher="accelerate")
    (really,) = [r for r in check_ranks(SCENARIOS[0], run, qwen2.model) if r.check ==
                 "ranks_really_distributed"]  # fmt: skip
    assert really.status == "FAIL" and "DistributedType.NO" in really.reason, really.reason


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS[1:], ids=lambda s: s.describe())
def test_every_multi_process_scenario_shows_no_unregistered_failure(qwen2, scenario):
    results = [r for _, r in run_distributed([scenario], MODEL, qwen2.model, progress=False)[0]]
    assert not _unexpected(scenario, results, "qwen2"), _unexpected(scenario, results, "qwen2")


@pytest.mark.slow
def test_a_rollout_func_that_drops_a_completion_is_caught(qwen2, monkeypatch):
    monkeypatch.setenv("CBVERIFY_RANK_FAULT", "drop")
    run = launch(PER_RANK_PROMPTS, MODEL, module=FAULTY)
    statuses = _statuses(check_ranks(PER_RANK_PROMPTS, run, qwen2.model))
    assert "FAIL" in {statuses["run_completes"], statuses["completions_aligned"]}, statuses
