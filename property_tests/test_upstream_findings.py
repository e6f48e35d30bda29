"""The findings policy: default scenarios show no unregistered failure, and every registered
upstream finding is an expected failure that turns red (strict xfail) the day it stops reproducing.

Model: the bundled ``tiny-qwen2-random`` (random weights, fixed seed). Flat distributions make a dropped sampling
option (e.g. the repetition penalty) visible within a few tokens, where a trained, peaked model could hide it.
Trainer runs are cached per scenario for the module: the findings' repro scenarios are default scenarios.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cbverify.upstream.findings import FAIL, FINDINGS, NA, SCRIPTS, CheckResult, Finding, by_id, explaining
from cbverify.upstream.recording import record_run
from cbverify.upstream.run import repro_not_applicable
from cbverify.upstream.steps import check_steps
from cbverify.upstream.suite import DEFAULT_SCENARIOS, check_scenario, greedy_agreement, judge

pytestmark = pytest.mark.upstream


class FindingReproduces(AssertionError):
    """Raised only when every check a finding names still FAILs on its repro scenario (the strict-xfail trigger)."""


_RESULTS: dict = {}


@pytest.fixture(scope="module")
def models(qwen2, llama) -> dict:
    """Bundled name -> (model, tokenizer), for the findings' ``repro_model``."""
    return {"tiny-qwen2-random": qwen2, "tiny-llama-arith": llama}


def _results(scenario, model_and_tokenizer, step_checks: bool = False):
    """The upstream suite's checks on ``scenario``, or (``step_checks``) the optimizer-step checks of
    ``cbverify.upstream.steps``."""
    key = (scenario, model_and_tokenizer[0].config.model_type, step_checks)
    if key not in _RESULTS:
        if step_checks:
            record = record_run(scenario, *model_and_tokenizer)
            _RESULTS[key] = check_steps(scenario, record, model_and_tokenizer[0])
        else:
            _RESULTS[key] = check_scenario(scenario, *model_and_tokenizer)
    return _RESULTS[key]


def _finding_results(finding: Finding, models: dict):
    if finding.repro.nproc > 1:  # its processes launched as `cbverify upstream --run --nproc N` launches them
        from cbverify.upstream.distributed import run_distributed

        key = (finding.repro, finding.repro_model, "distributed")
        if key not in _RESULTS:
            model = models[finding.repro_model][0]
            _RESULTS[key] = [r for _, r in run_distributed([finding.repro], finding.repro_model, model,
                                                           progress=False)[0]]  # fmt: skip
        return _RESULTS[key]
    return _results(finding.repro, models[finding.repro_model], step_checks=finding.step_checks)


@pytest.mark.parametrize("scenario", DEFAULT_SCENARIOS, ids=[s.describe() for s in DEFAULT_SCENARIOS])
def test_default_upstream_scenarios_show_no_unregistered_failure(scenario, qwen2):
    results = _results(scenario, qwen2)
    judged = [(r, *judge(r, scenario, "qwen2")) for r in results]
    bad = [(r, label) for r, ok, label in judged if not ok]
    assert not bad, "\n".join(f"{label}: {r.check} on {r.path}: {r.reason} [{r.scenario}]" for r, label in bad)


@pytest.mark.parametrize(
    "finding",
    [pytest.param(f, id=f.id, marks=pytest.mark.xfail(strict=True, raises=FindingReproduces, reason=f.id))
     for f in FINDINGS],
)  # fmt: skip
def test_the_invariant_behind_each_registered_finding_holds(finding: Finding, models):
    """Expected to fail (strict xfail) while the upstream behaviour stands; an XPASS means it was fixed upstream:
    delete the registry entry. A *partial* reproduction is a plain failure: the entry needs editing."""
    if not finding.on_installed_version():  # reported as a skip with its reason, never silently
        from cbverify.upstream.run import versions

        installed = versions()
        pytest.skip(f"{finding.id} concerns {finding.versions()}; installed transformers {installed['transformers']}, "
                    f"trl {installed['trl']}")  # fmt: skip
    if finding.path == "vllm":  # TRL's colocated vLLM runs in the vllm environment only
        pytest.skip(f"{finding.id} is on the vllm path: held by test_upstream_vllm.py under make test-vllm")
    if missing := repro_not_applicable(finding):  # the release lacks what the repro needs: n/a, by name
        pytest.skip(f"n/a({missing})")
    arch = models[finding.repro_model][0].config.model_type
    results = _finding_results(finding, models)
    covered = [r for r in results if finding.covers(r, finding.repro, arch) and r.status != NA]
    assert covered, f"{finding.id}: its repro scenario runs none of {finding.checks} (registry out of date)"
    failing = [r for r in covered if r.status == FAIL]
    unlike = [f"{r.check}: {why}" for r in failing if (why := finding.predicts[r.check].mismatch(r, finding.repro))]
    assert not unlike, f"{finding.id} fails otherwise than it predicts: {unlike}; update the registry"
    if failing and len(failing) == len(covered):
        raise FindingReproduces(f"{finding.id}: {failing[0].check}: {failing[0].reason}")
    passing = sorted({r.check for r in covered if r.status != FAIL})
    assert not failing, f"{finding.id} reproduces only partly: {passing} pass now; update the registry"


def test_every_failure_on_a_findings_repro_scenario_is_registered(models):
    for finding in FINDINGS:
        if finding.repro.nproc > 1 and not finding.on_installed_version():
            continue  # two launches (~25 s): test_upstream_distributed's slow test runs every multi-process scenario
        model_type = models[finding.repro_model][0].config.model_type
        for result in _finding_results(finding, models):
            if result.status == FAIL:
                explained, why = explaining(result, finding.repro, model_type)
                assert explained is not None, (f"unexplained: {result.check}: {result.reason} [{result.scenario}] "
                                                f"{why}")  # fmt: skip


def test_greedy_decoding_gives_identical_completions_on_generate_cb_and_rollout_func(qwen2):
    result = greedy_agreement(*qwen2)
    assert result.status == "PASS", result.reason


# slow (~10 s a script): `make test-slow` and every venv of `cbverify matrix` run it (the matrix's pytest step clears
# the marker filter), which is where the ranges are bounded; on the pinned stack the strict xfails above hold the same
@pytest.mark.slow
# (a finding on TRL's vLLM path needs vLLM: its script runs in the vllm environment, test_issue_report's slow test)
@pytest.mark.parametrize("finding", [f for f in FINDINGS if f.script and f.path != "vllm"], ids=lambda f: f.id)
def test_every_repro_script_fails_exactly_inside_its_versions(finding: Finding):
    """Strict both ways: inside the finding's version ranges its standalone script exits 1, outside it exits 0
    (``cbverify matrix`` runs this in every venv, which is how each range was bounded). Judged by the repro protocol's
    exit code alone (:func:`cbverify.upstream.bisect.run_script`): 2, the script could not run, is a failure of the
    script; what upstream logs on stderr (a generation thread's traceback) never decides. A release that lacks what the
    finding's scenario needs (a generation path, a config field, a loss type, continuous batching) is n/a, by name."""
    from cbverify.upstream.bisect import BAD, ERROR, GOOD, run_script
    from cbverify.upstream.run import versions

    if missing := repro_not_applicable(finding):
        pytest.skip(f"n/a({missing})")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    verdict, last = run_script(sys.executable, SCRIPTS / finding.script, env=env)
    assert verdict != ERROR, f"{finding.id}: the script could not run on {versions()} (exit 2 or a timeout): {last}"
    expected = BAD if finding.on_installed_version() else GOOD
    assert verdict == expected, (
        f"{finding.id} ({finding.versions()}) on {versions()}: {verdict}, not {expected}: {last}"
    )


FLOAT32_MEAN = "float32-group-mean-gives-zero-variance-groups-an-advantage"


def test_a_second_fault_under_a_findings_configuration_is_reported_not_absorbed(qwen2, monkeypatch):
    """The float32-group-mean finding covers every failure of ``zero_variance_groups_get_zero_advantage``. A trainer
    whose equal-reward groups get an advantage of a different size (here 1e-3 added after scoring: a second bug) fails
    the same check under the same configuration; it must be reported as a FAIL naming the finding it does not match,
    while the clean trainer's failure stays that finding's XFAIL."""
    from cbverify.upstream import run as run_module

    finding = by_id(FLOAT32_MEAN)
    check = "zero_variance_groups_get_zero_advantage"
    (clean,) = [r for r in _results(finding.repro, qwen2) if r.check == check]
    assert judge(clean, finding.repro, "qwen2") == (True, f"XFAIL({FLOAT32_MEAN})"), clean.reason

    original_install = run_module.install

    def faulty_install(trainer, capture):
        score = trainer._generate_and_score_completions

        def shifted(*args, **kwargs):
            out = score(*args, **kwargs)
            out["advantages"] = out["advantages"] + 1e-3
            return out

        trainer._generate_and_score_completions = shifted
        original_install(trainer, capture)

    monkeypatch.setattr(run_module, "install", faulty_install)
    (faulted,) = [r for r in check_scenario(finding.repro, *qwen2) if r.check == check]
    ok, label = judge(faulted, finding.repro, "qwen2")
    assert faulted.status == FAIL and not ok and label.startswith(f"FAIL(not {FLOAT32_MEAN}: "), (
        label,
        faulted.reason,
    )


@pytest.mark.slow
def test_a_second_fault_in_the_loss_under_the_dapo_findings_configuration_is_reported(llama):
    """The dapo-normaliser finding covers the step checks for every dapo run with steps_per_generation !=
    gradient_accumulation_steps. Its model predicts each loss call as the reference's times window tokens / (TRL's
    count); a loss scaled by a further 0.9 (a second normaliser bug) is FAIL naming the finding, while the clean
    run is its XFAIL."""
    finding = by_id("dapo-normaliser-is-not-the-accumulated-batch")

    def scaled(trainer):
        compute = trainer._compute_loss
        trainer._compute_loss = lambda *args, **kwargs: compute(*args, **kwargs) * 0.9

    for prepare, expected in ((None, f"XFAIL({finding.id})"), (scaled, f"FAIL(not {finding.id}: ")):
        record = record_run(finding.repro, *llama, prepare=prepare)
        results = {r.check: r for r in check_steps(finding.repro, record, llama.model)}
        for check in finding.checks:
            ok, label = judge(results[check], finding.repro, "llama")
            assert label.startswith(expected) and ok == (prepare is None), (check, label, results[check].reason)


def test_the_logged_reward_check_fails_on_unweighted_statistics_and_its_finding_predicts_only_those(llama):
    """The logged-reward check PASSes on a trainer outside the finding's range; the logged reward and reward_std
    replaced by the unweighted sums' statistics (what trl before 1.0 logs) FAIL it and match the finding's model, and
    any other wrong value FAILs it outside the model."""
    from dataclasses import replace

    finding = by_id("logged-reward-ignores-reward-weights")
    record = record_run(finding.repro, *llama)
    check = finding.checks[0]

    def result(logs: dict):
        steps = [replace(record.steps[0], logs={**record.steps[0].logs, **logs}), *record.steps[1:]]
        (out,) = [r for r in check_steps(finding.repro, replace(record, steps=steps), llama.model) if r.check == check]
        return out

    clean = result({})
    if finding.on_installed_version():  # the release logs the unweighted statistics itself
        assert clean.status == FAIL and finding.predicts[check].mismatch(clean, finding.repro) is None, clean.reason
    else:
        assert clean.status == "PASS", clean.reason
    unweighted = result(dict(zip(("reward", "reward_std"), _unweighted_stats(finding, record), strict=True)))
    assert unweighted.status == FAIL and finding.predicts[check].mismatch(unweighted, finding.repro) is None
    off = result({"reward": record.steps[0].logs["reward"] * 1.01})
    assert off.status == FAIL and finding.predicts[check].mismatch(off, finding.repro), off.reason


def _unweighted_stats(finding, record) -> tuple[float, float]:
    """Mean and std of each row's plain sum of the functions' rewards: an independent recomputation from TRL's own
    recorded per-function rewards (not from the reference's)."""
    totals = record.generations[0].rewards_per_func.double().sum(dim=1)
    return float(totals.mean()), float(totals.std())


@given(
    means=st.lists(st.floats(0.1, 5.0), min_size=2, max_size=4),
    tokens=st.lists(st.integers(1, 40), min_size=2, max_size=4),
)
def test_the_logged_entropy_finding_predicts_the_mean_of_rank_means_and_nothing_else(means, tokens):
    """What trl before 1.9 logs on N processes, the plain mean of the ranks' token means, is excused where the ranks
    hold unequal token counts; the global batch's token mean (what one process logs), or the same mean where the
    counts are equal, is not this failure."""
    n = min(len(means), len(tokens))
    means, tokens = means[:n], tokens[:n]
    finding = by_id("logged-entropy-is-a-mean-of-rank-means")
    prediction = finding.predicts["ranks_log_what_one_process_logs"]
    plain, weighted = sum(means) / n, sum(m * t for m, t in zip(means, tokens, strict=True)) / sum(tokens)

    def failed(logged: float) -> CheckResult:
        seen = (("logged", (logged,)), ("single_process", (weighted,)), ("rank_means", tuple(means)),
                ("rank_tokens", tuple(float(t) for t in tokens)))  # fmt: skip
        reason = f"log 0: entropy = {logged:.6g} on {n} processes, {weighted:.6g} on one"
        return CheckResult("ranks_log_what_one_process_logs", "rollout_func", FAIL, reason, "", seen)

    unequal = len(set(tokens)) > 1
    assert (prediction.mismatch(failed(plain), finding.repro) is None) == unequal
    if abs(plain - weighted) > 1e-3 * abs(weighted) + 1e-6:
        assert prediction.mismatch(failed(weighted), finding.repro) is not None
    other = CheckResult("ranks_log_what_one_process_logs", "rollout_func", FAIL, "log 0: kl = 1 on 2 processes, 2")
    assert prediction.mismatch(other, finding.repro) is not None
