"""``cbverify bisect FINDING``: where a registered finding came in, over releases or over a checkout's commits.

``--transformers 5.8..5.24`` / ``--trl 1.0..1.16``: every final release in the range, binary-searched with the
finding's standalone repro, one cached venv per probed release (:mod:`cbverify.upstream.bisect`); prints each probe,
the last good and first bad release, and whether the finding's typed range agrees with the probes (exit 1 when it
does not, or when the search could not decide). ``--record`` keeps the result in
``cbverify/upstream/bisections.json``, which the registry's tests hold the typed ranges to, and ``cbverify report``
shows.

``--transformers-src PATH`` / ``--trl-src PATH`` with ``--good REF --bad REF``: ``git bisect run`` with the repro over
the checkout's commits (the checkout must be clean; it is reset afterwards), naming the first bad commit, or, when
``--bad`` is the older ref, the first commit with the fix; ``--record`` keeps that commit beside the release
bisection.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cbverify import data
from cbverify.cli import refuse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("finding", help="a finding id of `cbverify upstream`'s list that has a standalone repro")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--transformers", metavar="FIRST..LAST", help="bisect transformers releases, e.g. 5.8..5.24")
    where.add_argument("--trl", metavar="FIRST..LAST", help="bisect trl releases, e.g. 1.0..1.16")
    where.add_argument("--transformers-src", type=Path, metavar="PATH", help="bisect a transformers git checkout")
    where.add_argument("--trl-src", type=Path, metavar="PATH", help="bisect a trl git checkout")
    parser.add_argument("--good", metavar="REF", help="with --*-src: a commit where the repro passes")
    parser.add_argument("--bad", metavar="REF", help="with --*-src: a commit where the repro fails")
    parser.add_argument("--record", action="store_true",
                        help="keep the bisection as the finding's last (cbverify/upstream/bisections.json): a "
                        "release range, or with --*-src the commit")  # fmt: skip


def _script(finding_id: str, log_dir: Path):
    """``(finding, its repro script)``: an upstream finding's standalone script, or the one ``cbverify fuzz`` writes
    for a fuzz finding's shrunk case (into ``log_dir``). A ``ValueError`` naming the findings that can be bisected."""
    from cbverify.fuzz import repro
    from cbverify.fuzz.findings import BATCH_FINDINGS, FUZZ_FINDINGS
    from cbverify.upstream import bisect
    from cbverify.upstream.findings import FINDINGS

    upstream = {f.id: f for f in FINDINGS}
    fuzz = {f.id: f for f in (*FUZZ_FINDINGS, *BATCH_FINDINGS) if (f.repro.engine, f.repro.entry) in repro.TEMPLATES}
    if finding_id in upstream:
        return upstream[finding_id], bisect.script_of(upstream[finding_id])
    if finding_id in fuzz:
        finding = fuzz[finding_id]
        path = log_dir / f"bisect-{finding_id}.py"
        path.write_text(repro.standalone_script(finding))
        return finding, path
    scripted = sorted([f.id for f in FINDINGS if f.script] + list(fuzz))
    raise ValueError(f"unknown finding {finding_id!r}; findings with a standalone repro: {', '.join(scripted)}")


def run(args: argparse.Namespace) -> int:
    from cbverify.upstream import bisect

    log_dir = data.workdir("matrix-venvs")
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        finding, script = _script(args.finding, log_dir)
    except ValueError as err:
        return refuse("bisect", err)
    if not hasattr(finding, "trl") and (args.trl or args.trl_src):
        return refuse("bisect", f"{finding.id} is a transformers finding (of `cbverify fuzz`): bisect transformers")
    source = args.transformers_src or args.trl_src
    if source is not None:
        return _git(args, bisect, finding, script, source, "transformers" if args.transformers_src else "trl")
    if args.good or args.bad:
        return refuse("bisect", "--good / --bad go with --transformers-src or --trl-src")
    package = "transformers" if args.transformers else "trl"
    try:
        first, last = bisect.parse_range(args.transformers or args.trl)
        versions = bisect.releases_between(package, first, last)
    except (ValueError, RuntimeError) as err:
        return refuse("bisect", err)
    print(f"bisect {finding.id}: {len(versions)} {package} releases {versions[0]}..{versions[-1]}, repro "
          f"{script.name}", flush=True)  # fmt: skip
    with (log_dir / f"bisect-{finding.id}-{package}.log").open("w") as log:
        try:
            probe = bisect.release_probe(script, package, log)
        except RuntimeError as err:
            return refuse("bisect", err)

        def shown(version: str) -> bisect.Probe:
            result = probe(version)
            print(f"  probe {package} {version}: {result.verdict} ({result.seconds:.0f}s)"
                  + (f": {result.detail.splitlines()[-1]}" if result.verdict == bisect.ERROR and result.detail
                     else ""), flush=True)  # fmt: skip
            return result

        result = bisect.search(versions, shown, finding=finding.id, package=package)
    print(result.describe())
    typed = getattr(finding, package)
    wrong = bisect.disagreements(typed, result.probes)
    print(f"affected (bisected): {result.affected or 'none'}; the registry says {typed or 'every version'!r}: "
          + ("agrees" if not wrong else "DISAGREES: " + "; ".join(wrong)))  # fmt: skip
    if args.record and result.change != "unknown":
        bisect.record(result)
        print(f"recorded in {bisect.BISECTIONS}")
    return 0 if result.change != "unknown" and not wrong else 1


def _git(args, bisect, finding, script: Path, source: Path, package: str) -> int:
    if not (args.good and args.bad):
        return refuse("bisect", f"--{package}-src needs --good REF and --bad REF")
    if not (source / ".git").exists():
        return refuse("bisect", f"{source} is not a git checkout")
    try:
        command, env = bisect.checkout_command(script, source, package)
        found = bisect.git_bisect(source, args.good, args.bad, command, env=env)
    except (ValueError, RuntimeError) as err:
        return refuse("bisect", err)
    what = "first bad commit" if found.change == "introduced" else "first commit with the fix"
    if found.first_bad is None:
        print(found.log[-2000:], file=sys.stderr)
        print(f"bisect {finding.id}: git bisect could not name the {what} between {args.good} and {args.bad}")
        return 1
    print(f"bisect {finding.id}: {what} {found.first_bad} ({found.subject})")
    if args.record:
        refs = (args.good, args.bad) if found.change == "introduced" else (args.bad, args.good)
        bisect.record_commit(finding.id, package, found, refs, source)
        print(f"recorded in {bisect.BISECTIONS}")
    return 0
