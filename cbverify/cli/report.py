"""``cbverify report FINDING``: the upstream issue for one registered finding, as Markdown
(:mod:`cbverify.upstream.issue_report`).

FINDING is an upstream finding (``cbverify upstream``'s list), an environment finding (run with that environment's
python, e.g. ``.engine-envs/vllm``) or a fuzz finding (its script from ``cbverify.fuzz.repro.standalone_script``).
The repro runs once and its output is pasted into the report; ``--no-run`` writes the report without running it and
says so. ``--out FILE.md`` writes the report there (else stdout). ``--from-fail MATRIX_JSON CHECK`` drafts the issue
for an unregistered FAIL of a ``cbverify matrix`` result instead (``cbverify.upstream.draft``).

Exit code: 0 when the report was written (whatever the repro said: the report states it), 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cbverify.cli import number, refuse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("finding", nargs="?", help="a finding id: `cbverify upstream` lists the upstream ones")
    parser.add_argument("--out", type=Path, metavar="FILE.md", help="write the report here (default: stdout)")
    parser.add_argument("--no-run", action="store_true", help="do not run the repro (the report says it was not run)")
    parser.add_argument("--python", metavar="PATH",
                        help="the interpreter to run the repro with (default: this one; for an environment finding, "
                        "that environment's)")  # fmt: skip
    parser.add_argument("--timeout", type=number(0, low_open=True), default=900.0, metavar="SECONDS",
                        help="stop the repro after this long (default 900)")  # fmt: skip
    parser.add_argument("--from-fail", nargs=2, metavar=("MATRIX_JSON", "CHECK"),
                        help="draft the issue for an unregistered FAIL of CHECK in a `cbverify matrix` "
                        "result")  # fmt: skip


def _fuzz_subject(finding_id: str):
    """The report subject of a fuzz finding, or ``None`` when ``finding_id`` is none; a ``ValueError`` when it is one
    but no standalone script can be written for it."""
    from cbverify.fuzz.findings import BATCH_FINDINGS, FUZZ_FINDINGS
    from cbverify.upstream import issue_report

    finding = next((f for f in (*FUZZ_FINDINGS, *BATCH_FINDINGS) if f.id == finding_id), None)
    if finding is None:
        return None
    try:
        from cbverify.fuzz.repro import standalone_script
    except ImportError:
        raise ValueError(f"no standalone repro for fuzz finding {finding_id} yet "
                         "(cbverify.fuzz.repro.standalone_script is missing)") from None  # fmt: skip
    try:
        script = standalone_script(finding)
    except (KeyError, ValueError, NotImplementedError) as err:
        raise ValueError(f"no standalone repro for fuzz finding {finding_id} yet: {err}") from None
    return issue_report.fuzz_subject(finding, script)


def _write(text: str, out: Path | None) -> None:
    if out is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text if text.endswith("\n") else text + "\n")
    print(f"cbverify report: wrote {out}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from cbverify.upstream import issue_report

    if args.from_fail:
        if args.finding:
            return refuse("report", "give a FINDING or --from-fail MATRIX_JSON CHECK, not both")
        matrix_json, check = Path(args.from_fail[0]), args.from_fail[1]
        if not matrix_json.is_file():
            return refuse("report", f"--from-fail: no file {matrix_json}")
        try:
            from cbverify.upstream.draft import draft_from_fail
        except ImportError as err:
            return refuse("report", f"--from-fail needs cbverify.upstream.draft.draft_from_fail, which is missing "
                          f"({err})")  # fmt: skip
        try:
            _write(draft_from_fail(matrix_json, check), args.out)
        except (KeyError, ValueError) as err:
            return refuse("report", err)
        return 0
    if not args.finding:
        return refuse("report", "name a FINDING (see `cbverify upstream`) or --from-fail MATRIX_JSON CHECK")
    try:
        item = issue_report.subject(args.finding)
    except KeyError as err:
        try:
            item = _fuzz_subject(args.finding)
        except ValueError as fuzz_err:
            return refuse("report", fuzz_err)
        if item is None:
            return refuse("report", err.args[0] + "; or a fuzz finding of cbverify/fuzz/findings.py")
    python = args.python
    if python is not None and not Path(python).is_file():
        return refuse("report", f"--python: no interpreter at {python}")
    if args.no_run:
        result = None
    else:
        print(f"cbverify report: running {item.script_name} ...", file=sys.stderr)
        result = issue_report.run_repro(item, python, timeout=args.timeout)
        print(f"cbverify report: {result.verdict} ({result.seconds:.1f} s)", file=sys.stderr)
    _write(issue_report.render(item, result, python=python), args.out)
    return 0
