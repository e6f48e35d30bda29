"""How decisive a run's checks were: per check, how many scenarios (or examples) it judged and how many it could not.

A check that returns PASS or FAIL (an expected FAIL included) has *judged* its scenario: it could have failed there.
NOT-APPLICABLE means it judged nothing; a PASS of the run then says nothing about that check. :func:`tally` counts
both per check, with the reasons for NOT-APPLICABLE; :func:`vacuous` names the checks that judged nothing in the whole
run, which every command that runs checks over scenarios reports as a failure of the run (exit 1, check named):
a check that could not have failed anywhere must not be read as verified.

Every runner speaks the same triple ``(check, status, reason)``; statuses are ``PASS``, ``FAIL`` and
``NOT-APPLICABLE`` (``N/A`` is accepted as its short form), and ``BLOCKED`` with a registered finding's id as the
reason: NOT-APPLICABLE because a known upstream failure stopped the run before the check had anything to judge (a
crash, a value never computed). A check that judged nothing and was blocked somewhere is reported as blocked, not as
vacuous: the registered finding is the failure, and it is already reported.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

JUDGED = ("PASS", "FAIL")
NOT_APPLICABLE = ("NOT-APPLICABLE", "N/A")


@dataclass(slots=True)
class Tally:
    """One check over a run: ``passed`` / ``failed`` scenarios and the NOT-APPLICABLE ones by reason."""

    check: str
    passed: int = 0
    failed: int = 0
    not_applicable: Counter = field(default_factory=Counter)
    blocked: Counter = field(default_factory=Counter)  # finding id -> scenarios

    @property
    def judged(self) -> int:
        return self.passed + self.failed

    @property
    def vacuous(self) -> bool:
        return self.judged == 0 and not self.blocked

    def to_json(self) -> dict:
        return {"check": self.check, "judged": self.judged, "passed": self.passed, "failed": self.failed,
                "not_applicable": sum(self.not_applicable.values()), "blocked_by": dict(self.blocked),
                "not_applicable_reasons": dict(self.not_applicable.most_common())}  # fmt: skip


def reason_key(reason: str) -> str:
    """A reason with its numbers and bracketed prefixes dropped, so that the same cause counts once."""
    reason = re.sub(r"^\[[^\]]*\]\s*", "", reason)
    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", reason)[:100]


def tally(results: Iterable[tuple[str, str, str]]) -> list[Tally]:
    """``(check, status, reason)`` triples -> one :class:`Tally` per check, in order of first appearance."""
    out: dict[str, Tally] = {}
    for check, status, reason in results:
        t = out.setdefault(check, Tally(check))
        if status == "PASS":
            t.passed += 1
        elif status == "FAIL":
            t.failed += 1
        elif status in NOT_APPLICABLE:
            t.not_applicable[reason_key(reason)] += 1
        elif status == "BLOCKED":
            t.blocked[reason] += 1
        else:
            raise ValueError(f"unknown status {status!r} for check {check!r}")
    return list(out.values())


def vacuous(tallies: Iterable[Tally]) -> list[str]:
    """The checks that judged nothing in the whole run."""
    return [t.check for t in tallies if t.vacuous]


def render(tallies: Iterable[Tally], *, title: str = "decisiveness") -> str:
    """A text table: per check, judged (pass / fail), NOT-APPLICABLE, and its most common reason."""
    tallies = list(tallies)
    if not tallies:
        return f"{title}: no checks ran"
    width = max(len(t.check) for t in tallies)
    lines = [f"{title}: scenarios each check judged (PASS/FAIL) and could not judge (NOT-APPLICABLE)",
             f"  {'check':<{width}}  judged (pass/fail)  n/a  most common reason for n/a"]  # fmt: skip
    for t in tallies:
        na = sum(t.not_applicable.values()) + sum(t.blocked.values())
        why = t.not_applicable.most_common(1)[0][0] if t.not_applicable else ""
        if t.blocked:
            why = f"blocked by {', '.join(t.blocked)}" + (f"; {why}" if why else "")
        mark = "!!" if t.vacuous else "  "
        counts = f"{t.judged} ({t.passed}/{t.failed})"
        lines.append(f"{mark}{t.check:<{width}}  {counts:<18}  {na:>4}  {why}")
    empty = vacuous(tallies)
    only_blocked = [t.check for t in tallies if t.judged == 0 and t.blocked]
    if empty:
        lines.append(f"VACUOUS (judged nothing, a failure of the run): {', '.join(empty)}")
    elif only_blocked:  # not vacuous (the findings that blocked them are reported), but not judged either: say so
        lines.append(
            f"{len(tallies) - len(only_blocked)} of the {len(tallies)} checks judged at least once; "
            f"{', '.join(only_blocked)} judged nothing here, every scenario blocked by a registered finding"
        )
    else:
        lines.append(f"every one of the {len(tallies)} checks judged at least once")
    return "\n".join(lines)
