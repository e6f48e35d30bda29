"""The decisiveness tally every run reports (``cbverify.decisive``): counts, reasons, vacuous and blocked checks, and
the rule that turns NOT-APPLICABLE into BLOCKED in ``cbverify upstream``'s report."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from cbverify.cli.upstream import decisiveness
from cbverify.decisive import render, tally, vacuous

STATUSES = ("PASS", "FAIL", "NOT-APPLICABLE", "N/A", "BLOCKED")


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from(STATUSES), st.sampled_from(["x 1", "x 2", "y"]))))
def test_the_tally_counts_every_result_once_and_a_check_is_vacuous_exactly_when_it_judged_nothing(results):
    tallies = {t.check: t for t in tally(results)}
    assert list(tallies) == list(dict.fromkeys(c for c, _, _ in results))
    for check, t in tallies.items():
        mine = Counter(s for c, s, _ in results if c == check)
        assert (t.passed, t.failed) == (mine["PASS"], mine["FAIL"])
        assert sum(t.not_applicable.values()) == mine["NOT-APPLICABLE"] + mine["N/A"]
        assert sum(t.blocked.values()) == mine["BLOCKED"]
        assert t.vacuous == (mine["PASS"] + mine["FAIL"] + mine["BLOCKED"] == 0)
    assert vacuous(tallies.values()) == [c for c, t in tallies.items() if t.vacuous]
    text = render(tallies.values())
    assert ("VACUOUS" in text) == bool(vacuous(tallies.values()))
    # the last line claims every check judged only when every one did: a check only blocked is named, never hidden
    every = bool(tallies) and all(t.judged for t in tallies.values())
    assert text.splitlines()[-1].startswith("every one of") == every, text


def test_reasons_that_differ_only_in_numbers_count_as_one():
    (t,) = tally([("c", "NOT-APPLICABLE", "[cb_impl] 3 rows"), ("c", "NOT-APPLICABLE", "12 rows")])
    assert t.not_applicable == Counter({"# rows": 2})


def test_a_not_applicable_behind_a_registered_failure_of_the_check_it_names_is_blocked():
    """ "(see run_completes)" with run_completes an XFAIL of the same scenario: blocked by that finding; the same
    reason beside a run_completes that passed, or in another scenario, stays NOT-APPLICABLE."""
    seen = "the run crashed before reaching this (see run_completes)"
    rows = [
        {"scenario": "s1", "check": "run_completes", "status": "FAIL", "label": "XFAIL(crash-x)", "reason": "boom"},
        {"scenario": "s1", "check": "loss", "status": "NOT-APPLICABLE", "label": "NOT-APPLICABLE", "reason": seen},
        {"scenario": "s2", "check": "run_completes", "status": "PASS", "label": "PASS", "reason": "ok"},
        {"scenario": "s2", "check": "loss", "status": "NOT-APPLICABLE", "label": "NOT-APPLICABLE", "reason": seen},
    ]
    (_, loss) = decisiveness(rows)
    assert loss.blocked == Counter({"crash-x": 1}) and sum(loss.not_applicable.values()) == 1
    assert not loss.vacuous
    (_, alone) = decisiveness(rows[2:])
    assert alone.vacuous
