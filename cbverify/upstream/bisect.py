"""Where a finding came in (or went out): a binary search over releases, or ``git bisect run`` over a checkout.

A *probe* runs a finding's standalone repro (an upstream finding's ``Finding.script``, in
``cbverify/upstream/repros/``, or the script ``cbverify fuzz`` writes for a fuzz finding's shrunk case: exit 1 while
the behaviour is there, 0 once it is gone, anything else an error) against one version of one package. It runs under
:data:`RUNNER`, so an uncaught exception (a release without an API the script uses) is an error, exit 2, and never
reads as the behaviour (Python's own exit code for it is 1): a repro says "bad" only by exiting 1 itself.

- a release: in the cached venv the matrix builds for it (:func:`cbverify.upstream.matrix.ensure_venv`; the other
  package at the pinned version, or the one it is paired with), one venv per probed release, kept for the next run;
- a commit of a local checkout: ``git bisect run`` checks it out and the repro runs in this interpreter with the
  checkout's sources first on ``PYTHONPATH`` (``src/`` for transformers' layout, the root for TRL's).

:func:`search` is the release bisection: the range's oldest and newest releases are probed first; when they agree
there is nothing to bisect (the behaviour is everywhere or nowhere in the range, and that is the answer); when they
differ, a binary search finds the adjacent pair where the verdict changes, in ``ceil(log2(n))`` more probes. A
release whose probe errs (a venv that cannot be built, a repro that crashes) is skipped, as ``git bisect skip``
does: its nearest unprobed neighbour inside the bracket is probed instead, and a bracket left with only errored
releases is reported as such. Verdicts are assumed monotone in the version (one change inside the range); every
probe is kept in the result, so a reader can see the search.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

GOOD, BAD, ERROR = "good", "bad", "error"
BISECTIONS = Path(__file__).with_name("bisections.json")  # the last recorded bisection of each finding and package


@dataclass(frozen=True, slots=True)
class Probe:
    """One probed version: its verdict (good / bad / error), the seconds it took, and the output's last lines."""

    version: str
    verdict: str
    seconds: float
    detail: str = ""


@dataclass(slots=True)
class Bisection:
    """A release bisection's result. ``change`` is ``"introduced"`` (good, then bad), ``"fixed"`` (bad, then good),
    ``"everywhere"`` / ``"nowhere"`` (one verdict over the whole range) or ``"unknown"`` (the probes that decide it
    erred). ``last_good`` / ``first_bad`` name the adjacent releases where the verdict changes (for ``"fixed"``:
    ``last_bad`` / ``first_good``)."""

    finding: str
    package: str
    searched: tuple[str, ...]  # oldest first
    probes: list[Probe] = field(default_factory=list)
    change: str = "unknown"
    before: str | None = None  # the last release with the oldest's verdict
    after: str | None = None  # the first release with the newest's verdict
    measured: str = ""  # ISO date

    @property
    def affected(self) -> str:
        """The affected releases as a PEP 440 specifier over the searched range ("" when nowhere)."""
        if self.change == "introduced":
            return f">={self.after}"
        if self.change == "fixed":
            return f"<{self.after}"
        return {"everywhere": f">={self.searched[0]}", "nowhere": ""}.get(self.change, "?")

    def describe(self) -> str:
        span = f"{self.searched[0]}..{self.searched[-1]} ({len(self.searched)} releases, {len(self.probes)} probed)"
        return {
            "introduced": f"{self.package}: last good {self.before}, first bad {self.after} in {span}",
            "fixed": f"{self.package}: last bad {self.before}, first good {self.after} in {span}",
            "everywhere": f"{self.package}: bad on every release probed in {span} (the ends agree: a behaviour that "
            "went and came back inside the range needs narrower ranges)",
            "nowhere": f"{self.package}: good on every release probed in {span} (the ends agree: a behaviour that "
            "came and went inside the range, e.g. one release's, needs narrower ranges)",
        }.get(self.change, f"{self.package}: undecided in {span} (the probes that would decide it erred)")

    def to_json(self) -> dict:
        return asdict(self) | {"affected": self.affected}


def search(
    versions: Sequence[str], probe: Callable[[str], Probe], *, finding: str = "", package: str = ""
) -> Bisection:
    """Bisect ``versions`` (oldest first) with ``probe`` (see the module docstring)."""
    if not versions:
        raise ValueError("nothing to bisect: the range holds no release")
    result = Bisection(finding, package, tuple(versions), measured=datetime.date.today().isoformat())
    seen: dict[int, str] = {}

    def verdict(i: int) -> str:
        if i not in seen:
            p = probe(versions[i])
            if p.verdict not in (GOOD, BAD, ERROR):
                raise ValueError(f"probe of {versions[i]} returned verdict {p.verdict!r}")
            result.probes.append(p)
            seen[i] = p.verdict
        return seen[i]

    def decided(indices: Sequence[int]) -> int | None:
        """The first of ``indices`` whose probe does not err."""
        return next((i for i in indices if verdict(i) != ERROR), None)

    n = len(versions)
    lo = decided(range(n))  # the oldest release that probes cleanly
    hi = decided(range(n - 1, lo, -1)) if lo is not None else None
    if lo is None:
        return result  # unknown: every probe erred
    if hi is None or seen[lo] == seen[hi]:
        result.change = "everywhere" if seen[lo] == BAD else "nowhere"
        return result
    while True:
        inside = [i for i in range(lo + 1, hi) if seen.get(i) != ERROR]
        if not inside:
            break
        mid = (lo + hi) // 2
        order = sorted(inside, key=lambda i: (abs(i - mid), i))  # the middle, else its nearest clean neighbour
        i = decided(order)
        if i is None:
            break  # only errored releases left between lo and hi: the change is somewhere among them
        if seen[i] == seen[lo]:
            lo = i
        else:
            hi = i
    if any(seen.get(i) == ERROR for i in range(lo + 1, hi)):
        return result  # unknown: the change hides among releases whose probes erred
    result.change = "introduced" if seen[lo] == GOOD else "fixed"
    result.before, result.after = versions[lo], versions[hi]
    return result


def releases_between(package: str, first: str, last: str, listed: Sequence[str] | None = None) -> list[str]:
    """Every final release of ``package`` from ``first`` to ``last`` (inclusive, PEP 440 order, oldest first), from
    the package index (or ``listed``); ``first`` / ``last`` may be a minor prefix (``5.8`` = from 5.8.0, to the last
    5.8.x)."""
    from packaging.version import InvalidVersion, Version

    from cbverify.upstream.matrix import index_versions

    def parse(text: str) -> Version:
        try:
            return Version(text)
        except InvalidVersion as err:
            raise ValueError(f"{text!r} is not a version") from err

    low, high = parse(first), parse(last)
    high_is_prefix = len(last.split(".")) < 3

    def within(v: Version) -> bool:
        top = v.release[: len(high.release)] <= high.release if high_is_prefix else v <= high
        return v >= low and top

    found = []
    for text in listed if listed is not None else index_versions(package):
        try:
            v = Version(text)
        except InvalidVersion:
            continue
        if not v.is_prerelease and not v.is_devrelease and within(v):
            found.append(v)
    if not found:
        raise ValueError(f"no {package} release between {first} and {last}")
    return [str(v) for v in sorted(set(found))]


def parse_range(text: str) -> tuple[str, str]:
    """``A..B`` -> ``(A, B)``."""
    parts = text.split("..")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"a range is FIRST..LAST, e.g. 5.8..5.24, got {text!r}")
    return parts[0], parts[1]


RUNNER = """import runpy, sys, traceback
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
    raise
except BaseException:
    traceback.print_exc()
    sys.exit(2)
"""  # ``python -c RUNNER script``: the script, with an uncaught exception as exit 2


def verdict_of(returncode: int) -> str:
    """A repro's exit code as a verdict: 1 bad (the behaviour is there), 0 good, anything else an error."""
    return {0: GOOD, 1: BAD}.get(returncode, ERROR)


def run_script(python: str, script: Path, *, env: dict | None = None, timeout: float = 600.0) -> tuple[str, str]:
    """``(verdict, the output's last lines)`` of ``python script``."""
    try:
        proc = subprocess.run([python, "-c", RUNNER, str(script)], capture_output=True, text=True, env=env,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return ERROR, f"timed out after {timeout:.0f}s"
    lines = (proc.stdout + proc.stderr).replace("\r", "\n").splitlines()
    tail = "\n".join([ln for ln in lines if ln.strip() and "it/s]" not in ln][-3:])  # no progress bars
    return verdict_of(proc.returncode), tail


def release_probe(script: Path, package: str, log) -> Callable[[str], Probe]:
    """A probe of the repro ``script`` on one release of ``package`` (``transformers`` or ``trl``) in the matrix's
    cached venv for it; the other package is the installed one (the matrix pairs a TRL release that cannot import
    beside transformers 5 with the transformers 4.x it allows). ``log`` (a text file) gets the installers' output.
    A ``RuntimeError`` when the venvs' shared torch cannot be built."""
    from cbverify import data
    from cbverify.upstream import matrix

    folder = data.workdir("matrix-venvs")
    folder.mkdir(parents=True, exist_ok=True)
    base = matrix.ensure_base(folder, log)
    if isinstance(base, str):
        raise RuntimeError(f"cannot build the shared torch venv: {base}")

    def probe(version: str) -> Probe:
        import transformers as installed

        start = time.perf_counter()
        transformers = version if package == "transformers" else installed.__version__
        trl = version if package == "trl" else None  # None: the pinned trl
        venv = folder / matrix.combo_name(transformers, trl)
        error = matrix.ensure_venv(venv, transformers, trl, log)
        if error:
            return Probe(version, ERROR, time.perf_counter() - start, f"venv: {error}")
        verdict, tail = run_script(str(venv / "bin" / "python"), script)
        return Probe(version, verdict, time.perf_counter() - start, tail)

    return probe


def script_of(finding) -> Path:
    """The finding's standalone repro script; a ``ValueError`` naming the finding when it has none."""
    if not finding.script:
        raise ValueError(f"finding {finding.id!r} has no standalone repro script: it cannot be bisected")
    path = Path(__file__).with_name("repros") / finding.script
    if not path.is_file():
        raise ValueError(f"finding {finding.id!r}: its repro script {path} is missing")
    return path


@dataclass(frozen=True, slots=True)
class GitBisection:
    """``git bisect run``'s answer: the commit where the behaviour changed (``None`` when it could not say), its
    subject, the log, and the change: ``introduced`` (the first commit where the repro fails) or ``fixed`` (the first
    where it passes again)."""

    first_bad: str | None
    subject: str
    log: str
    change: str = "introduced"


def source_root(checkout: Path, package: str) -> Path:
    """The folder to put first on ``PYTHONPATH`` so that ``import package`` reads ``checkout``: ``src/`` in
    transformers' layout, the checkout itself in TRL's."""
    for root in (checkout / "src", checkout):
        if (root / package / "__init__.py").is_file():
            return root
    raise ValueError(f"{checkout} holds no {package} package (looked in src/{package} and {package}/)")


def git_bisect(
    checkout: Path, good: str, bad: str, command: Sequence[str], *, env: dict | None = None
) -> GitBisection:
    """``git bisect run`` in ``checkout`` between ``good`` and ``bad`` with ``command`` (exit 0 good, 1 bad, anything
    else skipped: git's 125), always reset afterwards (the checkout is left at the commit it was on).

    ``good`` older than ``bad`` (its ancestor) finds the commit that introduced the behaviour; ``bad`` older than
    ``good`` finds the one that fixed it (git's terms ``broken`` / ``fixed``, the repro's verdict read the other way).
    Refs on two lines of history (a release branch's patch tag and main) are refused: give their merge base."""
    git = ["git", "-C", str(checkout)]

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([*git, *args], capture_output=True, text=True, env=env)
        if check and proc.returncode:
            raise RuntimeError(f"git {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
        return proc

    if run("status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise ValueError(f"{checkout} has uncommitted changes: git bisect would check out over them")
    for ref in (good, bad):
        run("rev-parse", "--verify", f"{ref}^{{commit}}")

    def older(a: str, b: str) -> bool:
        return run("merge-base", "--is-ancestor", a, b, check=False).returncode == 0

    if older(good, bad):  # the repro fails from some commit on: exit 0 is git's "good", 1 its "bad"
        change, start, verdict = "introduced", ["start", bad, good], "if [ $rc -le 1 ]; then exit $rc; fi"
    elif older(bad, good):  # it passes from some commit on: exit 1 is git's old term ("broken"), 0 its new ("fixed")
        change, start = "fixed", ["start", "--term-old=broken", "--term-new=fixed", good, bad]
        verdict = "if [ $rc -eq 1 ]; then exit 0; fi; if [ $rc -eq 0 ]; then exit 1; fi"
    else:
        raise ValueError(f"{good} and {bad} are on two lines of history (neither is an ancestor of the other): give "
                         f"refs on one, e.g. `git merge-base {good} {bad}` for the older")  # fmt: skip
    wrapped = f"{shlex.join(command)}; rc=$?; {verdict}; exit 125"
    run("bisect", *start)
    try:
        out = run("bisect", "run", "sh", "-c", wrapped, check=False)
        log = out.stdout + out.stderr
    finally:
        run("bisect", "reset", check=False)
    term = "bad" if change == "introduced" else "fixed"
    found = re.search(rf"^([0-9a-f]{{40}}) is the first {term} commit", log, re.M)
    if found is None:
        return GitBisection(None, "", log, change)
    subject = run("log", "-1", "--format=%s", found.group(1)).stdout.strip()
    return GitBisection(found.group(1), subject, log, change)


def checkout_command(script: Path, checkout: Path, package: str) -> tuple[list[str], dict]:
    """The command and environment ``git bisect run`` runs at each commit: the repro, this interpreter, the
    checkout's sources first on ``PYTHONPATH``."""
    root = source_root(checkout, package)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-c", RUNNER, str(script)], env


def disagreements(typed: str, probes: Sequence[Probe | dict]) -> list[str]:
    """Where a finding's typed range (a PEP 440 specifier; "" = every version) contradicts a bisection's probes: a
    release probed bad outside it, or good inside it. Errored probes say nothing."""
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(typed)
    out = []
    for p in probes:
        version, verdict = (p["version"], p["verdict"]) if isinstance(p, dict) else (p.version, p.verdict)
        inside = spec.contains(version, prereleases=True)
        if verdict == BAD and not inside:
            out.append(f"{version} probed bad, outside {typed!r}")
        elif verdict == GOOD and inside:
            out.append(f"{version} probed good, inside {typed or 'every version'!r}")
    return out


def recorded() -> dict:
    """The last recorded bisections: ``{finding id: {package: Bisection.to_json()}}``."""
    import json

    return json.loads(BISECTIONS.read_text()) if BISECTIONS.is_file() else {}


def record(bisection: Bisection, path: Path | None = None) -> None:
    """Keep ``bisection`` as its finding's last for its package (the registry test reads it)."""
    import json

    path = path or BISECTIONS
    records = json.loads(path.read_text()) if path.is_file() else {}
    kept = records.setdefault(bisection.finding, {}).get(bisection.package, {})
    commit = {"commit": kept["commit"]} if "commit" in kept else {}  # a commit bisection of the same package stays
    records[bisection.finding][bisection.package] = bisection.to_json() | commit
    path.write_text(json.dumps(records, indent=2, sort_keys=True) + "\n")


def record_commit(finding: str, package: str, found: GitBisection, refs: tuple[str, str], checkout: Path,
                  path: Path | None = None) -> None:  # fmt: skip
    """Keep a checkout bisection's commit beside ``package``'s release bisection of ``finding`` (``refs``: the older
    and the newer ref searched, kept with the commits they named then)."""
    import json

    def sha(ref: str) -> str:
        out = subprocess.run(["git", "-C", str(checkout), "rev-parse", f"{ref}^{{commit}}"], capture_output=True,
                             text=True, check=True)  # fmt: skip
        return out.stdout.strip()

    path = path or BISECTIONS
    records = json.loads(path.read_text()) if path.is_file() else {}
    records.setdefault(finding, {}).setdefault(package, {})["commit"] = {
        "sha": found.first_bad, "subject": found.subject, "change": found.change,
        "searched": [f"{ref} ({sha(ref)[:12]})" for ref in refs], "measured": datetime.date.today().isoformat(),
    }  # fmt: skip
    path.write_text(json.dumps(records, indent=2, sort_keys=True) + "\n")
