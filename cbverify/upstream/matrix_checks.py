"""What ``cbverify matrix`` runs inside one version's venv, and the version x check table it makes of the results.

Each step is this repository's own command run by the venv's interpreter; each gives rows of
``{"check", "path", "label", "ok"}`` (the upstream payload's shape):

0. ``venv``: how the venv was made: ``pass``, ``pass(+requests)`` when modules TRL imports without declaring them
   were added (:func:`cbverify.upstream.matrix.ensure_venv`), or ``ERROR(<pip's reason>)`` when it could not be
   built (:func:`install_failed`; then nothing else runs in it);
1. ``upstream``: ``python -m cbverify upstream --run --json`` (the trainer scenarios, judged against the registry;
   a check NOT-APPLICABLE in every scenario of the release is a ``VACUOUS`` row, as bad as a failure);
2. ``pytest``: the compatibility-layer tests (``property_tests/test_transformers_compat.py``,
   ``test_trl_compat.py``), the reference-vs-TRL loss cross-check (``test_reference_vs_trl.py``), the trainer's
   configuration space checked optimizer step by step (``test_trl_config_space.py``), every upstream
   finding's standalone script (exit 1 exactly inside its version ranges) and every registered fuzz finding's
   repro, strict both ways (inside its ``transformers`` range it must reproduce, outside it must not), read from a
   JUnit XML file;
3. ``verify``: ``python -m cbverify verify --json`` on the bundled model: one row per engine;
4. ``fuzz`` (with ``--fuzz N``): ``python -m cbverify fuzz --engine transformers-cb --entry E --examples N --json``
   for each entry point (the manager's request API, ``generate_batch``): one row each, ``pass`` (nothing found),
   ``xfail(k)`` (only registered failure classes) or ``FAIL(k)`` (k unregistered).

Options in pairs (:mod:`cbverify.pairs`): the configuration space's test reports how many pairs of options acting on
one quantity its runs set together (the suite property ``pair_coverage`` in the JUnit file), each fuzz run in its
JSON; each becomes a row, ``pass(N/M)`` when every pair was reached, ``VACUOUS(N/M; not reached: ...)`` naming
the others, as bad as a FAIL: a run that never set a listed pair together could not have found what only that
pair shows.

``--steps`` runs a subset of 1-3 (the ``venv`` row is always there). A step that crashes or times out is an
``ERROR`` row with its last line, never a missing one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

from cbverify.upstream.matrix import REPO, added_modules

RANK = {"ERROR": 6, "FAIL": 5, "VACUOUS": 5, "FIXED?": 4, "XFAIL": 3, "PASS": 2, "NOT-APPLICABLE": 1, "N/A": 1}
SHORT = {"NOT-APPLICABLE": "n/a", "N/A": "n/a", "XFAIL": "xfail", "PASS": "pass"}
PYTEST_TARGETS = (
    "property_tests/test_transformers_compat.py",
    "property_tests/test_trl_compat.py",
    "property_tests/test_reference_vs_trl.py",
    "property_tests/test_trl_config_space.py",
    "property_tests/test_upstream_findings.py::test_every_repro_script_fails_exactly_inside_its_versions",
    "property_tests/test_fuzz.py::test_every_registered_fuzz_finding_still_reproduces",
)


def _row(check: str, path: str, label: str, ok: bool) -> dict:
    return {"check": check, "path": path, "label": label, "ok": ok}


def _run(cmd: list[str], log, timeout: int) -> tuple[int | None, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(cmd, cwd=REPO or Path.cwd(), env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log.write(f"$ {' '.join(cmd)}\ntimed out after {timeout} s\n")
        return None, f"timed out after {timeout} s"
    log.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
    return proc.returncode, tail[0][:200]


def _json_step(name: str, cmd: list[str], out: Path, log, timeout: int) -> dict | dict[str, str]:
    out.unlink(missing_ok=True)
    rc, last = _run([*cmd, "--json", str(out)], log, timeout)
    if not out.is_file():
        return {"error": f"{name} crashed (rc {rc}): {last}"}
    return json.loads(out.read_text())


PAIRS_TEST = "test_every_listed_pair_was_set_together_in_some_run"


def pair_row(check: str, path: str, line: str | None) -> dict | None:
    """The row of one coverage line (``cbverify.pairs.Coverage.line``), None where the run reported none."""
    if not line:
        return None
    got = re.search(r"pairs reached (\d+)/(\d+)", line)
    if got is None:
        return _row(check, path, f"ERROR(unreadable coverage line: {line[:80]})", False)
    missing = line.partition("NOT REACHED: ")[2].split("; not drawn here")[0]
    if missing:
        return _row(check, path, f"VACUOUS({got[1]}/{got[2]}; not reached: {missing})", False)
    return _row(check, path, f"PASS({got[1]}/{got[2]})", True)


def upstream_rows(python: str, args, out: Path, log) -> tuple[list[dict], dict]:
    cmd = [python, "-m", "cbverify", "upstream", "--run", "--quiet"]
    cmd += ["--random-model"] if args.random_model else ["--model", args.model]
    cmd += ["--path", args.path] if args.path else []
    payload = _json_step("upstream", cmd, out, log, args.timeout)
    if "error" in payload:
        return [_row("upstream checks", "-", "ERROR", False)], {"error": payload["error"]}
    # a check that judged no scenario on this release is as bad as a failure: nothing was verified there
    vacuous = [_row(check, "*", "VACUOUS", False) for check in payload.get("vacuous", []) if not args.path]
    # a check whose mechanism the release has on no path it runs is one N/A row naming what it lacks
    lacking = [_row(check, "*", f"N/A({why})", True) for check, why in payload.get("release_lacks", {}).items()]
    return payload["results"] + vacuous + lacking, payload["versions"]


def pytest_rows(python: str, args, out: Path, log) -> list[dict]:
    if REPO is None:  # the tests live in the repository, not in the installed package
        log.write("pytest step skipped: the compatibility tests need a checkout of cbverify (git clone)\n")
        return [_row("pytest (needs a checkout of cbverify)", "pytest", "NOT-APPLICABLE", True)]
    out.unlink(missing_ok=True)
    _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={out}",
                     *PYTEST_TARGETS], log, args.timeout)  # fmt: skip
    if not out.is_file():
        return [_row("pytest (compat, fuzz findings)", "pytest", "ERROR", False)]
    rows = []
    root = ET.parse(out).getroot()
    suite = {p.get("name"): p.get("value") for p in root.iter("property")}
    for case in root.iter("testcase"):
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            label = "FIXED?" if "FIXED?" in (failed.get("message") or "") + (failed.text or "") else "FAIL"
        elif skipped is not None:  # pytest writes an expected failure as a skip of type pytest.xfail
            label = "XFAIL" if "xfail" in (skipped.get("type") or "") else "NOT-APPLICABLE"
            why = re.search(r"n/a\((.*)\)", skipped.get("message") or "")  # what the release lacks, where named
            label += f"({why.group(1)})" if why and label == "NOT-APPLICABLE" else ""
        else:
            label = "PASS"
        rows.append(_row(case.get("name"), "pytest", label, failed is None))
        if case.get("name") == PAIRS_TEST:  # its coverage line is a property of the suite
            if (row := pair_row("config-space pairs", "pytest", suite.get("pair_coverage"))) is not None:
                rows.append(row)
    return rows or [_row("pytest (compat, fuzz findings)", "pytest", "ERROR", False)]


def verify_rows(python: str, args, out: Path, log) -> list[dict]:
    payload = _json_step("verify", [python, "-m", "cbverify", "verify", "--model", args.model, "--allow-na"], out,
                         log, args.timeout)  # fmt: skip
    if "error" in payload:
        return [_row("verify", "-", "ERROR", False)]
    return [_row("verify", e["engine"], e["status"], e["status"] != "FAIL") for e in payload["engines"]]


def fuzz_rows(python: str, args, out: Path, log) -> list[dict]:
    """One row per entry point the fuzzer drives (the manager's request API, ``model.generate_batch`` as TRL calls
    it): pass, xfail(k registered classes) or FAIL(k unregistered)."""
    rows = []
    for entry in ("manager", "generate_batch"):
        cmd = [python, "-m", "cbverify", "fuzz", "--engine", "transformers-cb", "--entry", entry, "--examples",
               str(args.fuzz), "--model", args.model]  # fmt: skip
        path = out if entry == "manager" else out.with_name(out.name.replace(".fuzz.json", f".fuzz-{entry}.json"))
        payload = _json_step(f"fuzz {entry}", cmd, path, log, args.timeout)
        check = f"fuzz {entry} ({args.fuzz} examples)"
        if "error" in payload:
            rows.append(_row(check, "transformers-cb", "ERROR", False))
            continue
        unregistered = [c for c in payload["classes"] if c["finding"] is None]
        registered = len(payload["classes"])
        label = f"FAIL({len(unregistered)} unregistered)" if unregistered else (
            f"XFAIL({registered} registered)" if registered else "PASS")  # fmt: skip
        rows.append(_row(check, "transformers-cb", label, not unregistered))
        if (row := pair_row(f"fuzz {entry} pairs", "transformers-cb", payload.get("pair_coverage"))) is not None:
            rows.append(row)
    return rows


def install_failed(error: str) -> dict:
    """The payload of a venv that could not be built: one ``venv`` row with pip's reason."""
    return {"versions": {"error": error}, "results": [_row("venv", "-", f"ERROR({error})", False)]}


def run_combo(venv: Path, args, out_dir: Path, name: str, log) -> dict:
    """The steps of ``args.steps`` (and fuzz with ``args.fuzz``) in ``venv``: ``{"versions": ..., "results": [...]}``
    (``versions`` holds an error if upstream could not run, and is empty when upstream is not among the steps)."""
    python = str(venv / "bin" / "python")
    added = added_modules(venv)
    results = [_row("venv", "-", f"PASS(+{', '.join(added)})" if added else "PASS", True)]
    versions: dict = {}
    if "upstream" in args.steps:
        upstream, versions = upstream_rows(python, args, out_dir / f"{name}.upstream.json", log)
        results += upstream
    if "pytest" in args.steps:
        results += pytest_rows(python, args, out_dir / f"{name}.pytest.xml", log)
    if "verify" in args.steps:
        results += verify_rows(python, args, out_dir / f"{name}.verify.json", log)
    if args.fuzz:
        results += fuzz_rows(python, args, out_dir / f"{name}.fuzz.json", log)
    return {"versions": versions, "results": results}


def write_report(out: Path, columns: dict[str, dict], timings: dict[str, float], **extra: dict) -> tuple[str, bool]:
    """``matrix.json`` (versions, seconds, header, rows, then ``extra``: e.g. the node and attempts of each combo)
    and ``matrix.md`` in ``out``; returns the text table and whether every row is as expected."""
    header, rows = table(columns)
    versions = {n: p["versions"] for n, p in columns.items()}
    payload = {"versions": versions, "seconds": timings, "header": header, "rows": rows, **extra}
    (out / "matrix.json").write_text(json.dumps(payload, indent=2))
    md = render_markdown(header, rows) + "\n\n" + "\n".join(f"- `{n}`: {s} s" for n, s in timings.items())
    (out / "matrix.md").write_text(md + "\n")
    text = render_text(header, rows) + "\n\n" + "\n".join(f"{n}: {v}  ({timings[n]} s)" for n, v in versions.items())
    text += "\n\n" + "\n".join(column_changes(header, rows))
    return text, all(r["ok"] for p in columns.values() for r in p["results"])


BAD = ("ERROR", "FAIL", "VACUOUS", "FIXED?")  # the labels of a row that is not as expected


def _kind(cell: str) -> str:
    return cell.split("(")[0].upper()


def column_changes(header: list[str], rows: list[list[str]]) -> list[str]:
    """Per column: the count of each label, and against the column before it (the previous release, in the order
    given) the rows newly not as expected and the rows fixed (not as expected, or an expected failure, before; a pass
    now)."""
    lines = []
    for c in range(2, len(header)):
        counts: dict[str, int] = {}
        for row in rows:
            counts[_kind(row[c])] = counts.get(_kind(row[c]), 0) + 1
        lines.append(f"{header[c]}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        if c == 2:
            continue
        before = [(r, _kind(r[c - 1]), _kind(r[c])) for r in rows]
        worse = [f"{r[0]} ({r[c - 1]} -> {r[c]})" for r, a, b in before if b in BAD and a not in BAD]
        fixed = [f"{r[0]} ({r[c - 1]} -> {r[c]})" for r, a, b in before if b == "PASS" and (a in BAD or a == "XFAIL")]
        lines.append(f"  against {header[c - 1]}: newly failing {len(worse)}"
                     + (f": {'; '.join(worse)}" if worse else "") + f"; fixed {len(fixed)}"
                     + (f": {'; '.join(fixed)}" if fixed else ""))  # fmt: skip
    return lines


def _cell(labels: list[str]) -> str:
    if not labels:
        return "-"
    worst = max(labels, key=lambda lab: RANK.get(lab.split("(")[0], 0))
    head, _, rest = worst.partition("(")
    return SHORT.get(head, head) + (f"({rest}" if rest else "")


def table(columns: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """``columns``: combo -> payload. Rows: (check, path); cells: the worst label, ``-`` where a combo has none."""
    keys: list[tuple[str, str]] = []
    for payload in columns.values():
        for r in payload["results"]:
            if (r["check"], r["path"]) not in keys:
                keys.append((r["check"], r["path"]))
    rows = []
    for check, path in keys:
        row = [check, path]
        for payload in columns.values():
            row.append(_cell([r["label"] for r in payload["results"] if (r["check"], r["path"]) == (check, path)]))
        rows.append(row)
    return ["check", "path", *columns], rows


def render_text(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*["-" * w for w in widths]), *(fmt.format(*r) for r in rows)])


def render_markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
