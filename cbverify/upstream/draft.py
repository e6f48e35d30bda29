"""From an unexplained FAIL to a draft finding: ``cbverify report --from-fail MATRIX_JSON CHECK``.

A matrix run (``cbverify matrix``) writes one table (``matrix.json``: a row per check, a column per venv) and, beside
it, what each venv's steps printed (``<venv>.pytest.xml``, ``<venv>.upstream.json``). When a check FAILs in some venv
and no registered finding predicts it, :func:`draft_from_fail` reads those files and drafts what registering it takes:

- where it fails and where it passes (the venvs' versions), and what it observed, verbatim;
- the registered finding that covers the check but does not predict this value, and why (the judge's ``FAIL(not
  <finding>: <how it differs>)``), so a new form of a known bug is told from a new bug;
- a :class:`~cbverify.upstream.findings.Finding` to paste: the failing scenario as its repro (parsed back from the
  ``TrainerScenario(...)`` the test printed), ``applies`` over the options the scenario sets, a prediction whose
  pattern is the observed line with its numbers left free, the version range as seen;
- a repro skeleton (the closest finding's standalone script, to edit) and the bisection command that bounds the range.

It drafts; a person decides the mechanism, the model of the wrong value and the name.
"""

from __future__ import annotations

import ast
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, fields
from datetime import date
from pathlib import Path

FAILING = ("FAIL", "ERROR", "VACUOUS")
# "<label>: <check>: <reason>" as the trainer property tests print each failing check (property_tests.
# test_trl_config_space), the label "FAIL" or "FAIL(not <finding>: <how the observed value differs>)"
_LINE = re.compile(r"^(?P<label>FAIL(?:\(not (?P<finding>[\w.-]+): (?P<why>.*)\))?): (?P<check>\w+): (?P<reason>.*)$")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?")


class DraftError(ValueError):
    """The matrix table cannot be drafted from (no such check, it failed nowhere, its logs are missing)."""


@dataclass(frozen=True)
class Failure:
    """One venv where the check failed: its versions, the failing lines, the scenario it failed on."""

    venv: str
    versions: dict
    label: str
    lines: tuple[dict, ...]  # _LINE's groups, one per failing check line
    text: str  # the failure's message as the step printed it
    scenario: object | None  # a TrainerScenario, where the failure printed one


def _rows(table: dict, check: str) -> list[list[str]]:
    rows = [r for r in table["rows"] if r[0] == check or r[0].split("[")[0] == check]
    if not rows:
        near = sorted({r[0] for r in table["rows"] if check.lower() in r[0].lower()})[:10]
        raise DraftError(f"no check {check!r} in the table" + (f"; did you mean one of {near}?" if near else ""))
    return rows


def _pytest_text(folder: Path, venv: str, name: str) -> str:
    xml = folder / f"{venv}.pytest.xml"
    if not xml.is_file():
        raise DraftError(f"{xml} is missing: the pytest step's log of {venv} (rerun cbverify matrix with --out here)")
    for case in ET.parse(xml).getroot().iter("testcase"):
        if case.get("name") == name:
            failed = case.find("failure") if case.find("failure") is not None else case.find("error")
            if failed is not None:
                return f"{failed.get('message') or ''}\n{failed.text or ''}"
    raise DraftError(f"{xml} has no failure of {name}")


def _upstream_text(folder: Path, venv: str, check: str, path: str) -> str:
    log = folder / f"{venv}.upstream.json"
    if not log.is_file():
        raise DraftError(f"{log} is missing: the upstream step's log of {venv}")
    results = [r for r in json.loads(log.read_text()).get("results", [])
               if r.get("check") == check and r.get("path") in (path, "*") and r.get("status") == "FAIL"]  # fmt: skip
    if not results:
        raise DraftError(f"{log} has no FAIL of {check} on {path}")
    return "\n".join(
        f"{r.get('label', 'FAIL')}: {r['check']}: {r['reason']}\n{r.get('scenario', '')}" for r in results
    )


def scenario_in(text: str):
    """The last ``TrainerScenario(...)`` printed in ``text`` (pytest's ``E`` prefixes removed), rebuilt from its
    literal fields; ``None`` where there is none or it does not parse."""
    from cbverify.upstream.scenario import TrainerScenario

    plain = "\n".join(re.sub(r"^E\s{0,12}", "", ln) for ln in text.splitlines())
    start = plain.rfind("TrainerScenario(")
    if start < 0:
        return None
    depth = 0
    for end in range(start + len("TrainerScenario"), len(plain)):
        depth += {"(": 1, ")": -1}.get(plain[end], 0)
        if depth == 0:
            break
    try:
        call = ast.parse(plain[start : end + 1], mode="eval").body
        known = {f.name for f in fields(TrainerScenario)}
        return TrainerScenario(**{k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in known})
    except (SyntaxError, ValueError, TypeError):
        return None


def versions_of(table: dict, venv: str) -> dict:
    """The venv's versions as its steps recorded them, else as its name gives them (``transformers-X_trl-Y``; a
    step that records none, e.g. pytest alone, leaves the name); ``pinned`` is the installed release."""
    recorded = table["versions"].get(venv) or {}
    if recorded:
        return recorded
    import transformers
    import trl

    pinned = {"transformers": transformers.__version__, "trl": trl.__version__}
    named = dict(part.split("-", 1) for part in venv.split("_") if "-" in part)
    return {k: pinned[k] if named.get(k, "pinned") == "pinned" else named[k] for k in ("transformers", "trl")}


def failures(matrix_json: Path, check: str) -> tuple[list[Failure], list[str]]:
    """The venvs where ``check`` failed (with what they printed) and those where it passed."""
    matrix_json = Path(matrix_json)
    if not matrix_json.is_file():
        raise DraftError(f"{matrix_json}: no such file (cbverify matrix writes matrix.json in its --out folder)")
    table = json.loads(matrix_json.read_text())
    venvs = table["header"][2:]
    failed, passed = [], []
    for row in _rows(table, check):
        name, path = row[0], row[1]
        for venv, cell in zip(venvs, row[2:], strict=True):
            if not cell.startswith(FAILING):
                passed += [venv] if cell.upper().startswith(("PASS", "XFAIL")) else []
                continue
            if path == "pytest":
                text = _pytest_text(matrix_json.parent, venv, name)
            else:
                text = _upstream_text(matrix_json.parent, venv, name, path)
            stripped = (re.sub(r"^(?:E\s+)?(?:AssertionError: )?", "", ln.strip()) for ln in text.splitlines())
            lines = tuple({m.group(0): m.groupdict() for m in map(_LINE.match, stripped) if m}.values())
            failed.append(Failure(venv, versions_of(table, venv), cell, lines, text, scenario_in(text)))
    if not failed:
        raise DraftError(f"{check} failed in no venv of {matrix_json} (cells: PASS in {passed or 'none'})")
    return failed, sorted(set(passed) - {f.venv for f in failed})


def _pattern(reason: str) -> str:
    """The observed line as a prediction's pattern: its text literal, its numbers free (``\\S+``)."""
    parts = _NUMBER.split(reason)
    return r"\S+".join(re.escape(p) for p in parts).replace("\\ ", " ")


def _set_options(scenario) -> dict:
    """The scenario's fields that differ from a default ``TrainerScenario``."""
    from cbverify.upstream.scenario import TrainerScenario

    default = TrainerScenario()
    return {f.name: getattr(scenario, f.name) for f in fields(scenario)
            if getattr(scenario, f.name) != getattr(default, f.name)}  # fmt: skip


def _varied(fails: list[Failure], passes: list[str], table: dict) -> tuple[str, list[str], list[str]]:
    """The package whose releases differ (trl, else transformers) and its releases that fail and pass."""
    import transformers
    import trl

    pinned = {"trl": trl.__version__, "transformers": transformers.__version__}
    for package in ("trl", "transformers"):
        bad = sorted({f.versions.get(package, "?") for f in fails})
        good = sorted({versions_of(table, v).get(package, "?") for v in passes})
        if len(set(bad) | set(good)) > 1 or bad != [pinned[package]]:
            return package, bad, good or [f"{pinned[package]} (pinned; the default run passes there)"]
    return "trl", sorted({f.versions.get("trl", "?") for f in fails}), []


def draft_from_fail(matrix_json: Path, check: str, *, index: bool = True) -> str:
    """The Markdown draft of a new finding for ``check``'s FAIL in ``matrix_json`` (see the module docstring);
    ``index``: list the releases the bisection will search, from the package index."""
    from cbverify.upstream.bisect import releases_between
    from cbverify.upstream.findings import by_id

    matrix_json = Path(matrix_json)
    fails, passes = failures(matrix_json, check)
    table = json.loads(matrix_json.read_text())
    package, bad, good = _varied(fails, passes, table)
    first = fails[0]
    lines = [ln for f in fails for ln in f.lines] or [{"label": f.label, "check": check, "reason": f.text.strip()
                                                        .splitlines()[0], "finding": None, "why": None}
                                                       for f in fails]  # fmt: skip
    checks = tuple(dict.fromkeys(ln["check"] for ln in lines))
    closest = next((ln["finding"] for ln in lines if ln.get("finding")), None)
    closest_finding = by_id(closest) if closest else None
    scenario = first.scenario
    options = _set_options(scenario) if scenario is not None else {}
    release = bad[0].split()[0]
    slug = (f"{closest}-{package}-{release}-form" if closest else f"{checks[0]}-{package}-{release}").replace(
        ".", "-").replace("_", "-")  # fmt: skip
    low = bad[0].split()[0]
    high = next((g.split()[0] for g in good if g.split()[0] != low), None)
    try:
        between = releases_between(package, *sorted((low, high), key=_key)) if high and index else []
    except Exception:  # noqa: BLE001 -- the index may be out of reach; the command is still right
        between = []

    out = [f"# Draft finding: `{slug}`", ""]
    out += [f"Drafted {date.today().isoformat()} by `cbverify report --from-fail {matrix_json} {check}`. "
            "Edit every TODO, then paste the entry into `cbverify/upstream/findings.py`.", ""]  # fmt: skip
    out += ["## Where", ""]
    for f in fails:
        shown = ", ".join(f"{k} {v}" for k, v in f.versions.items() if k != "cbverify")
        out += [f"- **{f.label}** in `{f.venv}` ({shown})"]
    out += [f"- PASS in `{v}`" for v in passes] or ["- PASS in no venv of this table"]
    out += ["", "## Observed (verbatim)", "", "```"]
    out += [f"{ln['label']}: {ln['check']}: {ln['reason']}" for ln in lines]
    out += ["```", ""]
    if closest_finding is not None:
        out += ["## The registered finding it is not", "",
                f"`{closest}` covers this check and scenario but predicts another value: {lines[0].get('why') or ''}.",
                f"Its evidence: {closest_finding.evidence}", "",
                "A release-specific form of the same bug: either give that finding a prediction per form (its model "
                "reads the installed release), or register the form on its own with its own range.", ""]  # fmt: skip
    else:
        out += ["## No registered finding covers it", "", "A new behaviour: name the mechanism from the release's "
                "source before registering.", ""]  # fmt: skip
    out += ["## Registry entry (draft)", "", "```python", "Finding(", f'    id="{slug}",', f"    checks={checks!r},",
            '    path="*",  # TODO: one generation path, where only one shows it',
            '    when="TODO: the scenario condition, in words",',
            "    applies=lambda s: " + (" and ".join(f"s.{k} == {v!r}" for k, v in options.items()) or "True")
            + ",  # TODO: keep only the options the mechanism needs",
            f'    affected="{_affected(fails)} (cbverify matrix, {date.today().isoformat()})",',
            f'    evidence="TODO: the mechanism. Observed: {lines[0]["reason"]}",',
            f"    repro={scenario!r}," if scenario is not None else "    repro=TrainerScenario(),  # TODO",
            f'    {package}="=={release}",  # TODO: the bisected range (below)',
            "    predicts={"]  # fmt: skip
    out += [f'        "{c}": Prediction(r"{_pattern(next(ln["reason"] for ln in lines if ln["check"] == c))}"),'
            for c in checks]  # fmt: skip
    out += ["    },", ")", "```", ""]
    out += ["## Repro skeleton", ""]
    if closest_finding is not None and closest_finding.script:
        out += [f"Start from `{closest}`'s standalone script, `cbverify/upstream/repros/{closest_finding.script}`; "
                "set the options below and make it exit 1 on the value observed here:", ""]  # fmt: skip
    else:
        out += ["Write a standalone script (torch, transformers, trl, datasets; its tiny model built in the script) "
                "that runs this scenario and exits 1 while the behaviour is there, 0 once fixed:", ""]  # fmt: skip
    out += ["```python", *(f"{k} = {v!r}" for k, v in options.items()), "```", ""]
    out += ["## Bisection", "", "With the script in place (the finding's `script=`):", "", "```",
            f"cbverify bisect {slug} --{package} {low}..{high or 'NEWEST'} --record", "```", ""]  # fmt: skip
    if between:
        out += [f"{len(between)} {package} releases between them: {', '.join(between)}.", ""]
    return "\n".join(out)


def _key(version: str):
    from packaging.version import Version

    return Version(version)


def _affected(fails: list[Failure]) -> str:
    return "; ".join(" + ".join(f"{k} {v}" for k, v in f.versions.items() if k in ("transformers", "trl"))
                     for f in fails)  # fmt: skip
