"""A release that lacks a feature can neither show nor fix a finding about it: n/a, by name, never FIXED? or FAIL.

Release stand-ins (the pinned stack with one feature taken away by monkeypatching the probes that
:mod:`cbverify.engines.transformers_compat` and :mod:`cbverify.upstream.trl_compat` answer from) must turn exactly the
findings that need the feature into n/a naming it, and leave the others as they are. And the repro protocol is judged
by exit code alone: 1 the behaviour is there, 0 it is not, 2 the script could not run; stderr text never decides."""

from __future__ import annotations

import sys

import pytest

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz.findings import FUZZ_FINDINGS
from cbverify.upstream import trl_compat
from cbverify.upstream.bisect import BAD, ERROR, GOOD, run_script
from cbverify.upstream.findings import FINDINGS
from cbverify.upstream.run import repro_not_applicable
from cbverify.upstream.suite import PATHS_NEEDED, release_lacks

NO_CB = "transformers 4.57.6 has no ContinuousBatchingConfig (continuous batching with a configuration: 5.x)"


def _scripted():
    return [f for f in FINDINGS if f.script and f.path != "vllm"]


def test_on_the_pinned_stack_every_finding_can_run():
    """The baseline the stand-ins are measured against: nothing is missing here, so each stand-in's n/a is its own."""
    assert [f.id for f in FUZZ_FINDINGS if f.missing()] == []
    assert {f.id: repro_not_applicable(f) for f in _scripted() if repro_not_applicable(f)} == {}


def test_a_release_without_continuous_batching_makes_every_cb_finding_na(monkeypatch):
    monkeypatch.setattr(compat, "ABSENT", NO_CB)
    assert {f.id: f.missing() for f in FUZZ_FINDINGS} == {f.id: NO_CB for f in FUZZ_FINDINGS}
    cb = [f for f in _scripted() if f.repro.path == "cb"]
    assert cb, "no scripted finding on TRL's continuous-batching path: the stand-in judges nothing"
    assert {f.id: repro_not_applicable(f) for f in cb} == {f.id: NO_CB for f in cb}
    others = [f.id for f in _scripted() if f.repro.path != "cb" and repro_not_applicable(f)]
    assert others == [], f"findings that do not use continuous batching made n/a: {others}"


def test_a_release_without_a_config_field_makes_the_findings_that_set_it_na(monkeypatch):
    field = "per_request_processors"  # two findings set it
    users = {f.id for f in FUZZ_FINDINGS if f.repro.config.get(field) is not None}
    assert users and len(users) < len(FUZZ_FINDINGS), "the stand-in must split the registry to be decisive"
    monkeypatch.setattr(compat, "FIELDS", compat.FIELDS - {field})
    missing = {f.id: f.missing() for f in FUZZ_FINDINGS if f.missing()}
    assert set(missing) == users
    assert all(f"has no {field!r}" in why for why in missing.values()), missing


def test_a_release_without_a_loss_type_makes_its_repro_na(monkeypatch):
    luspo = [f for f in _scripted() if f.repro.loss_type == "luspo"]
    assert luspo, "no scripted finding needs loss_type='luspo'"
    installed = trl_compat.loss_types()
    monkeypatch.setattr(trl_compat, "loss_types", lambda: tuple(t for t in installed if t != "luspo"))
    for finding in _scripted():
        why = repro_not_applicable(finding)
        if finding in luspo:
            assert why is not None and "no loss_type 'luspo'" in why, (finding.id, why)
        else:
            assert why is None, (finding.id, why)


def test_a_release_without_rollout_func_makes_its_repros_na(monkeypatch):
    _without_rollout_func(monkeypatch)
    users = [f for f in _scripted() if f.repro.path == "rollout_func"]
    own = [f for f in users if not f.step_checks and f.repro.nproc == 1]
    assert own and len(own) < len(users), "the stand-in must split the rollout_func repros to be decisive"
    assert all("takes no rollout_func" in (repro_not_applicable(f) or "") for f in own)
    # the step checks hand the oracle's rollouts to the trainer's own generation, and a multi-process repro runs on
    # generate() where its path is missing: neither needs rollout_func
    assert {f.id: repro_not_applicable(f) for f in users if f not in own} == {
        f.id: None for f in users if f not in own
    }


def _without_rollout_func(monkeypatch):
    real = trl_compat.require_path

    def no_rollout_func(trainer, path):
        if path == "rollout_func":
            raise trl_compat.MissingFeature(f"trl 0.24.0: {trainer} takes no rollout_func")
        real(trainer, path)

    monkeypatch.setattr(trl_compat, "require_path", no_rollout_func)


def test_a_check_is_na_for_a_release_only_where_none_of_the_paths_with_its_mechanism_runs(monkeypatch):
    """A release without continuous batching still reaches the sampler checks through rollout_func (and greedy
    agreement through generate and rollout_func); one without both has no path with their mechanism:
    N/A naming both."""
    assert {c: release_lacks(c) for c in PATHS_NEEDED} == dict.fromkeys(PATHS_NEEDED)  # the pinned baseline
    monkeypatch.setattr(compat, "ABSENT", NO_CB)
    assert {c: release_lacks(c) for c in PATHS_NEEDED} == dict.fromkeys(PATHS_NEEDED)
    _without_rollout_func(monkeypatch)
    lacks = {c: release_lacks(c) for c in PATHS_NEEDED}
    assert all(why and NO_CB in why and "takes no rollout_func" in why for why in lacks.values()), lacks
    assert release_lacks("loss_matches_reference") is None  # a check every path has is never excused


@pytest.mark.parametrize(
    "body, verdict",
    [
        # transformers logs its generation thread's traceback on stderr; the script still reports what it saw
        ("import sys; print('Traceback (most recent call last):', file=sys.stderr); sys.exit(1)", BAD),
        ("import sys; print('Traceback (most recent call last):', file=sys.stderr); sys.exit(0)", GOOD),
        ("raise ValueError('Unknown loss type: luspo')", ERROR),  # uncaught, with no excepthook of its own
        ("import sys; sys.exit(2)", ERROR),
        ("import sys; sys.exit(3)", ERROR),
    ],
)
def test_the_repro_protocol_is_judged_by_exit_code_alone(tmp_path, body, verdict):
    script = tmp_path / "repro.py"
    script.write_text(body + "\n")
    assert run_script(sys.executable, script)[0] == verdict
