"""Drafting a finding from an unexplained FAIL (``cbverify.upstream.draft``, ``cbverify report --from-fail``).

The matrix's files are built here as ``cbverify matrix`` writes them (``matrix.json``, ``<venv>.pytest.xml``,
``<venv>.upstream.json``), with failure texts in the form the trainer property tests and the upstream step print.
"""

from __future__ import annotations

import json
import re
from xml.sax.saxutils import escape

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbverify.upstream.draft import DraftError, _pattern, draft_from_fail, failures, scenario_in
from cbverify.upstream.findings import FINDINGS
from property_tests.strategies import trainer_configs

CHECK = "test_every_optimizer_step_matches_the_reference"
BAD, GOOD = "transformers-5.24.0_trl-1.9.0", "transformers-5.24.0_trl-1.16.0"
FINDING = next(f for f in FINDINGS if f.id == "dapo-normaliser-is-not-the-accumulated-batch")


def _pytest_failure(lines: list[str], scenario) -> str:
    """An ``AssertionError`` as ``_assert_every_step_matches`` raises it, in pytest's ``E``-prefixed rendering."""
    body = "\n".join(lines + [repr(scenario)])
    return f"AssertionError: {body}\n" + "\n".join(f"E       {ln}" for ln in body.splitlines())


def _matrix(tmp_path, cells: dict[str, str], texts: dict[str, str], check: str = CHECK):
    versions = {v: {"torch": "2.13.0", "transformers": "5.24.0", "trl": v.rsplit("-", 1)[1]} for v in cells}
    table = {"versions": versions, "seconds": {v: 1.0 for v in cells}, "header": ["check", "path", *cells],
             "rows": [["venv", "-", *("pass" for _ in cells)], [check, "pytest", *cells.values()]]}  # fmt: skip
    (tmp_path / "matrix.json").write_text(json.dumps(table))
    for venv, text in texts.items():
        message, _, rest = text.partition("\n")
        (tmp_path / f"{venv}.pytest.xml").write_text(
            f'<testsuites><testsuite><testcase classname="property_tests.test_trl_config_space" name="{check}">'
            f'<failure message="{escape(message, {chr(34): "&quot;"})}">{escape(rest)}</failure></testcase>'
            "</testsuite></testsuites>"
        )
    return tmp_path / "matrix.json"


@settings(max_examples=15, deadline=None)
@given(scenario=trainer_configs(loss_types=("grpo", "dapo", "bnpo")))
def test_the_failing_scenario_is_read_back_as_the_test_printed_it(scenario):
    """The draft's repro is the scenario the test failed on: read back from pytest's rendering, field for field."""
    text = _pytest_failure(
        ["FAIL: micro_losses_match_reference: step 0: a loss call returned 1, reference 2"], scenario
    )
    assert scenario_in(text) == scenario


@given(
    words=st.lists(
        st.sampled_from(["loss", "call", "|grad", "-", "reference|", "(x", "=", "y)", "+"]), min_size=1, max_size=6
    ),
    numbers=st.lists(st.floats(-1e6, 1e6, allow_nan=False).map(lambda x: f"{x:.6g}"), min_size=1, max_size=4),
)
def test_a_predicted_pattern_matches_the_observed_line_with_any_numbers_and_no_other_text(words, numbers):
    """The prediction the draft writes matches the observed line, and the same line with other numbers (another
    run, another seed), but not the line with its words changed."""
    line = " ".join(w for pair in zip(words, numbers + words[len(numbers) :], strict=False) for w in pair)
    pattern = _pattern(line)
    assert re.search(pattern, line)
    assert re.search(pattern, re.sub(r"\d", "7", line))
    assert not re.search(pattern, line.replace(words[0], words[0] + "Q", 1))


def test_a_release_specific_form_of_a_registered_finding_is_drafted_from_the_matrix(tmp_path):
    """One venv FAILs with the judge's ``FAIL(not <finding>: ...)``, another passes: the draft names the finding it
    is not and why, where it fails and passes, the observed lines verbatim, an entry whose repro is the failing
    scenario and whose prediction matches the observed line, and the bisection between the two releases."""
    why = "a loss call is 0.491803 x the reference's, the release's normaliser gives 0.983607 x"
    reason = "step 0: a loss call returned 0.08, reference 0.16"
    lines = [f"FAIL(not {FINDING.id}: {why}): micro_losses_match_reference: {reason}"]
    path = _matrix(tmp_path, {BAD: "FAIL", GOOD: "PASS"}, {BAD: _pytest_failure(lines, FINDING.repro)})
    draft = draft_from_fail(path, CHECK, index=False)
    assert f"**FAIL** in `{BAD}`" in draft and f"PASS in `{GOOD}`" in draft
    assert f"`{FINDING.id}` covers this check" in draft and why in draft
    assert lines[0] in draft
    assert f"repro={FINDING.repro!r}" in draft
    predicted = re.search(r'Prediction\(r"(.*)"\)', draft).group(1)
    assert re.search(predicted, reason)
    assert "--trl 1.9.0..1.16.0" in draft
    assert f"start from `{FINDING.id}`'s standalone script".lower() in draft.lower()


def test_the_draft_refuses_what_it_cannot_draft_from_by_name(tmp_path):
    """No such check (with the near names), a check that failed nowhere, a failing venv whose log is missing."""
    path = _matrix(tmp_path, {BAD: "PASS"}, {})
    with pytest.raises(DraftError, match="no check 'test_every_optimizer' .*did you mean"):
        draft_from_fail(path, "test_every_optimizer")
    with pytest.raises(DraftError, match="failed in no venv"):
        failures(path, CHECK)
    path = _matrix(tmp_path, {BAD: "FAIL"}, {})
    with pytest.raises(DraftError, match=r"pytest\.xml is missing"):
        draft_from_fail(path, CHECK)
    with pytest.raises(DraftError, match="no such file"):
        draft_from_fail(tmp_path / "none.json", CHECK)
