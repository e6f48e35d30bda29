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
from cbverify.upstream.run import not_applicable

NO_CB = "transformers 4.57.6 has no ContinuousBatchingConfig (continuous batching with a configuration: 5.x)"


def _scripted():
    return [f for f in FINDINGS if f.script and f.path != "vllm"]


def test_on_the_pinned_stack_every_finding_can_run():
    """The baseline the stand-ins are measured against: nothing is missing here, so each stand-in's n/a is its own."""
    assert [f.id for f in FUZZ_FINDINGS if f.missing()] == []
    assert {f.id: not_applicable(f.repro) for f in _scripted() if not_applicable(f.repro)} == {}


def test_a_release_without_continuous_batching_makes_every_cb_finding_na(monkeypatch):
    monkeypatch.setattr(compat, "ABSENT", NO_CB)
    assert {f.id: f.missing() for f in FUZZ_FINDINGS} == {f.id: NO_CB for f in FUZZ_FINDINGS}
    cb = [f for f in _scripted() if f.repro.path == "cb"]
    assert cb, "no scripted finding on TRL's continuous-batching path: the stand-in judges nothing"
    assert {f.id: not_applicable(f.repro) for f in cb} == {f.id: NO_CB for f in cb}
    others = [f.id for f in _scripted() if f.repro.path != "cb" and not_applicable(f.repro)]
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
        why = not_applicable(finding.repro)
        if finding in luspo:
            assert why is not None and "no loss_type 'luspo'" in why, (finding.id, why)
        else:
            assert why is None, (finding.id, why)


def test_a_release_without_rollout_func_makes_its_repros_na(monkeypatch):
    real = trl_compat.require_path

    def no_rollout_func(trainer, path):
        if path == "rollout_func":
            raise trl_compat.MissingFeature(f"trl 0.24.0: {trainer} takes no rollout_func")
        real(trainer, path)

    monkeypatch.setattr(trl_compat, "require_path", no_rollout_func)
    users = [f for f in _scripted() if f.repro.path == "rollout_func"]
    assert users, "no scripted finding on the rollout_func path"
    assert all("takes no rollout_func" in (not_applicable(f.repro) or "") for f in users)


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
