"""``cbverify validate``: did a change to transformers or TRL fix a finding, and did it break anything?

A *checkout* is a local source tree of one package (a git repository, or a plain tree such as an unpacked wheel or
sdist with a patch applied). It is judged against a *release* of the same package, in the release's cached venv of
the matrix (:func:`release_python`, built on demand as ``cbverify bisect`` builds them): the release side runs in that
venv as installed, the checkout side in the same venv with the checkout's sources first on ``PYTHONPATH``
(:func:`checkout_env`), so the two sides differ by the checkout's sources only.

What runs on both sides:

- every registered finding's standalone repro whose script imports the package (:func:`targets`: the upstream
  findings' ``Finding.script`` through :func:`cbverify.upstream.bisect.script_of`, the fuzz findings' scripts written
  from their shrunk cases; exit 1 while the behaviour is there, 0 once it is gone, anything else an error, run under
  :data:`cbverify.upstream.bisect.RUNNER`); a finding without a repro, or whose repro needs another environment, is
  listed as not run;
- unless ``--no-checks``, the upstream checks the matrix runs in each venv (``python -m cbverify upstream --run``,
  time-boxed), each (check, path, scenario) row judged against the registry as ``cbverify upstream`` judges it.

Each item gets one verdict per side (:data:`VERDICTS`) and :func:`classify` turns the pair into a category: FIXED by
the change (failing on the release, passing on the checkout), STILL PRESENT (failing on both), NEWLY FAILING (passing
or absent on the release, failing or erring on the checkout: a repro exit 1, a check FAIL that no finding explains,
or an error), NOT APPLICABLE (nothing to judge: passing on both for a finding, e.g. one outside its version range;
either side not applicable, or the release erring), UNCHANGED (a check passing or not applicable on both).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cbverify.upstream.bisect import BAD, ERROR, GOOD, run_script, source_root

PACKAGES = ("transformers", "trl")
KNOWN = "known"  # a check failing as a registered finding predicts (XFAIL): bad, and explained
ABSENT = "absent"  # not applicable on that side (a check NOT-APPLICABLE, a step that did not run)
VERDICTS = (GOOD, BAD, KNOWN, ERROR, ABSENT)
FIXED, STILL, NEW, NA, UNCHANGED = "fixed", "still-present", "newly-failing", "not-applicable", "unchanged"
CATEGORIES = (FIXED, STILL, NEW, NA, UNCHANGED)
TITLES = {FIXED: "FIXED by the change", STILL: "STILL PRESENT", NEW: "NEWLY FAILING",
          NA: "NOT APPLICABLE (nothing to compare)", UNCHANGED: "UNCHANGED"}  # fmt: skip
# what the matrix runs in each venv (its upstream step); ``--json FILE`` is appended
CHECKS_COMMAND = ["-m", "cbverify", "upstream", "--run", "--quiet", "--model", "tiny-llama-arith"]


def classify(release: str, checkout: str) -> str:
    """The category of an item whose release side has verdict ``release`` and checkout side ``checkout`` (each one of
    :data:`VERDICTS`). Failing on the release means ``bad`` or ``known``; on the checkout only ``bad`` (a repro exit
    1, an unexplained check FAIL) and ``error`` count as newly failing: a check failing there as a registered finding
    predicts is that finding's, whose repro decides it."""
    if release not in VERDICTS or checkout not in VERDICTS:
        raise ValueError(f"verdicts are {VERDICTS}, got {release!r} / {checkout!r}")
    failing_before = release in (BAD, KNOWN)
    if checkout == ERROR:
        return NA if release == ERROR else NEW  # erring on both: the change did not make it err
    if checkout == BAD:
        return STILL if failing_before else NEW
    if checkout == KNOWN:
        return STILL if failing_before else NA
    if checkout == GOOD:
        return FIXED if failing_before else NA if release == ERROR else UNCHANGED
    return NA if failing_before or release == ERROR else UNCHANGED  # absent on the checkout


# ---------------------------------------------------------------------------------------------------- what to run
@dataclass(frozen=True, slots=True)
class Target:
    """One finding as validate sees it: its repro script (``None`` with ``why`` when there is none to run here) and
    its version ranges (``{"transformers": spec, "trl": spec}``, PEP 440; "" = every version)."""

    id: str
    source: str  # "upstream", "fuzz", "env"
    script: Path | None
    ranges: dict = field(default_factory=dict)
    why: str = ""


def imports(script: Path) -> set[str]:
    """The top-level modules ``script`` imports (anywhere in it)."""
    tree = ast.parse(script.read_text(), filename=str(script))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def findings_with_scripts(work: Path) -> Iterable[tuple[object, str, Path | None, str]]:
    """Every registered finding as ``(finding, source, its repro script or None, why none)``: the upstream registry's
    (their ``script``, through :func:`cbverify.upstream.bisect.script_of`), the engine environments' (run only there)
    and the fuzz findings' (a script written into ``work`` from the shrunk case, one template per engine and entry
    point)."""
    from cbverify.fuzz import repro
    from cbverify.fuzz.findings import BATCH_FINDINGS, FUZZ_FINDINGS
    from cbverify.upstream import bisect
    from cbverify.upstream.env_findings import ENV_FINDINGS
    from cbverify.upstream.findings import FINDINGS

    for finding in FINDINGS:
        try:
            yield finding, "upstream", bisect.script_of(finding), ""
        except ValueError:
            yield finding, "upstream", None, "no standalone repro: judged only through the upstream checks"
    for finding in ENV_FINDINGS:
        yield finding, "env", None, f"its repro runs in the {finding.env} environment only (make test-{finding.env})"
    seen = set()
    work.mkdir(parents=True, exist_ok=True)
    for finding in (*FUZZ_FINDINGS, *BATCH_FINDINGS):
        if finding.id in seen:
            continue
        seen.add(finding.id)
        made = getattr(repro, "standalone_script", None)  # all of its checks; else the template for its first
        script = work / f"{finding.id}.py"
        try:
            text = made(finding) if made else repro.script_text(finding.repro, finding.checks[0], finding.evidence)
            script.write_text(text)
        except ValueError as err:
            yield finding, "fuzz", None, f"no standalone repro: {err}"
            continue
        yield finding, "fuzz", script, ""


def targets(package: str, work: Path) -> list[Target]:
    """The findings validate reports on for a checkout of ``package``: each with a repro that imports it, the others
    with the reason they are not run."""
    out = []
    for finding, source, script, why in findings_with_scripts(work):
        ranges = {p: getattr(finding, p, "") for p in PACKAGES}
        if script is not None and package not in imports(script):
            script, why = None, f"its repro does not import {package}"
        out.append(Target(finding.id, source, script, ranges, why))
    return out


# ---------------------------------------------------------------------------------------------------- the two sides
@dataclass(frozen=True, slots=True)
class Side:
    """One side of the comparison: the interpreter, the environment it runs in, and what it imports."""

    name: str  # "release" or "checkout"
    python: str
    env: dict
    versions: dict  # {"transformers": ..., "trl": ...} as the venv's metadata says (None where it has none)
    pythonpath: str = ""  # the folder put first on PYTHONPATH (checkout side)

    def command(self, *args: str) -> str:
        """A shell command that reruns ``args`` on this side."""
        prefix = f"PYTHONPATH={shlex.quote(self.pythonpath)} " if self.pythonpath else ""
        return prefix + shlex.join([self.python, *args])


def base_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def checkout_env(root: Path, env: dict | None = None) -> dict:
    """``env`` with ``root`` first on ``PYTHONPATH``."""
    env = dict(base_env() if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return env


_PROBE = """import importlib.metadata as m, json, sys
def v(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
import {package}
print(json.dumps({{"file": {package}.__file__, "transformers": v("transformers"), "trl": v("trl")}}))
"""


def probe(python: str, package: str, env: dict) -> dict:
    """What ``python`` imports as ``package`` under ``env``: ``{"file", "transformers", "trl"}`` (the versions as the
    installed metadata says); a ``RuntimeError`` with the error's last line when it cannot import it."""
    proc = subprocess.run([python, "-c", _PROBE.format(package=package)], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        last = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
        raise RuntimeError(f"import {package}: {last[0][:300]}")
    return json.loads(lines[-1])


def checkout_root(path: Path, package: str) -> Path:
    """The folder to put first on ``PYTHONPATH`` for a checkout of ``package`` at ``path``; a ``ValueError`` that
    says why ``path`` is not one."""
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder: give the root of a {package} source checkout")
    other = next(p for p in PACKAGES if p != package)
    try:
        return source_root(path, package)
    except ValueError:
        try:
            source_root(path, other)
        except ValueError:
            pass
        else:
            raise ValueError(f"{path} is a {other} checkout, not a {package} one: use --{other}") from None
        raise ValueError(f"{path} is not a {package} source checkout (no {package}/__init__.py in it or in "
                         f"src/)") from None  # fmt: skip


def describe_checkout(path: Path, root: Path, package: str) -> str:
    """The checkout in words: the version its sources declare and, in a git repository, ``git describe``."""
    text = (root / package / "__init__.py").read_text(errors="replace")
    found = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", text, re.M)
    words = [f"{package} {found.group(1)}" if found else f"{package} sources"]
    if (path / ".git").exists():
        proc = subprocess.run(["git", "-C", str(path), "describe", "--always", "--dirty", "--tags"],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode == 0:
            words.append(f"git {proc.stdout.strip()}")
    return ", ".join(words)


def newest_release(package: str) -> tuple[str, str]:
    """``(version, where it came from)``: the newest final release the package index lists, else (an unreachable
    index) the installed one."""
    from packaging.version import Version

    from cbverify.upstream.matrix import index_versions

    try:
        listed = [Version(v) for v in index_versions(package)]
        final = [v for v in listed if not v.is_prerelease and not v.is_devrelease]
        if final:
            return str(max(final)), "the newest release on the package index"
    except (RuntimeError, ValueError):
        pass
    from importlib.metadata import version

    return version(package), "the installed release (the package index could not be read)"


def release_python(package: str, version: str, log) -> Path:
    """The interpreter of the matrix's cached venv for ``package`` at ``version`` (the other package as installed:
    the pinned trl, or the installed transformers, or the 4.x a trl release before 0.29 needs), built on demand; a
    ``RuntimeError`` with the installer's reason when it cannot be built."""
    import transformers as installed

    from cbverify import data
    from cbverify.upstream import matrix

    folder = data.workdir("matrix-venvs")
    folder.mkdir(parents=True, exist_ok=True)
    transformers = version if package == "transformers" else installed.__version__
    trl = version if package == "trl" else None
    venv = folder / matrix.combo_name(transformers, trl)
    error = matrix.ensure_venv(venv, transformers, trl, log)
    if error:
        raise RuntimeError(f"the venv of {package} {version} cannot be built: {error}")
    return venv / "bin" / "python"


def venv_python(folder: Path) -> Path | None:
    """``folder/bin/python`` when ``folder`` is a venv (a ``pyvenv.cfg`` and an interpreter), else ``None``."""
    python = folder / "bin" / "python"
    return python if (folder / "pyvenv.cfg").is_file() and python.exists() else None


# ---------------------------------------------------------------------------------------------------- running
@dataclass(slots=True)
class Outcome:
    verdict: str
    detail: str = ""
    seconds: float = 0.0
    label: str = ""  # a check's judged label (PASS, XFAIL(<finding>), FAIL(...), ...)


@dataclass(slots=True)
class Item:
    """One finding or check and its outcome on each side."""

    kind: str  # "check", or "<source> finding" (upstream, fuzz, env)
    id: str
    release: Outcome
    checkout: Outcome
    rerun: dict  # side -> shell command
    note: str = ""

    @property
    def category(self) -> str:
        """:func:`classify`'s category; a finding passing (or not run) on both sides is not applicable, not merely
        unchanged: its repro had nothing to show on either (e.g. a release outside its range)."""
        category = classify(self.release.verdict, self.checkout.verdict)
        return NA if category == UNCHANGED and self.kind != "check" else category


def check_verdict(row: dict) -> str:
    """A judged upstream row as a verdict: PASS and FIXED?(...) (a finding's check passing) good, XFAIL(...) known,
    NOT-APPLICABLE absent, FAIL(...) bad."""
    label = row["label"]
    if label.startswith("XFAIL"):
        return KNOWN
    if label.startswith("FAIL"):
        return BAD
    if label == "NOT-APPLICABLE":
        return ABSENT
    return GOOD  # PASS, FIXED?(finding): the check itself passed


def run_checks(side: Side, out: Path, timeout: float, path: str | None = None) -> tuple[dict[tuple, Outcome], str]:
    """The upstream checks on ``side`` (:data:`CHECKS_COMMAND`): ``({(check, path, scenario): Outcome}, "")``, or
    ``({}, why)`` when the step crashed or ran past ``timeout``."""
    out.unlink(missing_ok=True)
    args = [*CHECKS_COMMAND, *(["--path", path] if path else []), "--json", str(out)]
    start = time.perf_counter()
    try:
        proc = subprocess.run([side.python, *args], capture_output=True, text=True, env=side.env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {}, f"the upstream checks ran past their {timeout:.0f} s time box"
    seconds = time.perf_counter() - start
    if not out.is_file():
        last = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
        return {}, f"the upstream checks crashed (rc {proc.returncode}): {last[0][:300]}"
    rows = json.loads(out.read_text())["results"]
    each = seconds / max(1, len(rows))
    return {(r["check"], r["path"], r.get("scenario", "")): Outcome(check_verdict(r), r.get("reason", ""), each,
                                                                    r["label"]) for r in rows}, ""  # fmt: skip


@dataclass(slots=True)
class Progress:
    """Progress lines on stderr: ``[k/n] what: verdict (s); ETA ~m`` from the mean time of the units done so far."""

    total: int
    stream: object = None
    done: int = 0
    spent: float = 0.0
    start: float = field(default_factory=time.perf_counter)
    jobs: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tick(self, what: str, outcome: Outcome, units: int = 1, then: str = "") -> None:
        with self.lock:
            self.done += units
            self.spent += outcome.seconds * units
            left = max(0, self.total - self.done)
            eta = self.spent / max(1, self.done) * left / self.jobs
            print(f"[{self.done}/{self.total}] {what}: {outcome.label or outcome.verdict} ({outcome.seconds:.0f}s); "
                  f"elapsed {_span(time.perf_counter() - self.start)}, ETA ~{_span(eta)}{then}",
                  file=self.stream or sys.stderr, flush=True)  # fmt: skip


def _span(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def in_range(target: Target, versions: dict) -> bool | None:
    """Whether ``versions`` fall inside the target's ranges (``None`` when a version with a range is unknown)."""
    from packaging.specifiers import SpecifierSet

    for package, spec in target.ranges.items():
        if not spec:
            continue
        if versions.get(package) is None:
            return None
        if versions[package] not in SpecifierSet(spec):
            return False
    return True


def validate(
    package: str,
    targets_: Sequence[Target],
    release: Side,
    checkout: Side,
    *,
    checks: bool = True,
    checks_path: str | None = None,
    timeout: float = 600.0,
    checks_timeout: float = 1800.0,
    work: Path,
    jobs: int = 1,
    stream=None,
) -> list[Item]:
    """Every target's repro and (``checks``) the upstream checks on both sides; one :class:`Item` each."""
    runnable = [t for t in targets_ if t.script is not None]
    progress = Progress(total=2 * len(runnable), stream=stream, jobs=jobs)

    def repro(target: Target, side: Side) -> Outcome:
        start = time.perf_counter()
        verdict, tail = run_script(side.python, target.script, env=side.env, timeout=timeout)
        outcome = Outcome(verdict, tail, time.perf_counter() - start)
        progress.tick(f"{target.id} on the {side.name}", outcome, then=" + the upstream checks" if checks else "")
        return outcome

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {(t.id, s.name): pool.submit(repro, t, s) for t in runnable for s in (release, checkout)}
        results = {key: f.result() for key, f in futures.items()}
    items = []
    for t in targets_:
        if t.script is None:
            items.append(Item(f"{t.source} finding", t.id, Outcome(ABSENT), Outcome(ABSENT), {}, t.why))
            continue
        rerun = {s.name: s.command(str(t.script)) for s in (release, checkout)}
        inside = in_range(t, release.versions)
        ranges = ", ".join(f"{p} {s}" for p, s in t.ranges.items() if s) or "every version"
        note = {True: f"its range ({ranges}) holds the release", False: f"outside its range ({ranges}) on the release",
                None: f"range {ranges}"}[inside]  # fmt: skip
        pair = results[(t.id, "release")], results[(t.id, "checkout")]
        items.append(Item(f"{t.source} finding", t.id, *pair, rerun, note))
    if not checks:
        return items
    print(f"upstream checks on both sides (time box {checks_timeout:.0f} s each)", file=stream or sys.stderr,
          flush=True)  # fmt: skip
    sides = {}

    def side_checks(side: Side):
        start = time.perf_counter()
        found = run_checks(side, work / f"checks-{side.name}.json", checks_timeout, checks_path)
        seconds = time.perf_counter() - start
        rows, why = found
        status = Outcome(ERROR if why else GOOD, why, seconds, why and "ERROR" or f"{len(rows)} results")
        with progress.lock:
            print(f"  upstream checks on the {side.name}: {status.label} ({_span(seconds)})",
                  file=stream or sys.stderr, flush=True)  # fmt: skip
        sides[side.name] = found

    with ThreadPoolExecutor(max_workers=min(2, jobs)) as pool:
        list(pool.map(side_checks, (release, checkout)))
    (rel, rel_why), (co, co_why) = sides["release"], sides["checkout"]
    sides_ = (release, checkout)
    if rel_why or co_why:  # one item for the step: nothing to compare row by row
        rel_side = Outcome(ERROR, rel_why, label="ERROR") if rel_why else Outcome(GOOD, label=f"{len(rel)} results")
        co_side = Outcome(ERROR, co_why, label="ERROR") if co_why else Outcome(GOOD, label=f"{len(co)} results")
        args = [*CHECKS_COMMAND, *(["--path", checks_path] if checks_path else [])]
        items.append(Item("check", "upstream checks", rel_side, co_side, {s.name: s.command(*args) for s in sides_}))
        return items
    for key in [*rel, *(k for k in co if k not in rel)]:
        check, path, scenario = key
        rerun = {s.name: s.command(*CHECKS_COMMAND, "--path", path) for s in (release, checkout)}
        items.append(Item("check", f"{check} [{path}] {scenario}", rel.get(key, Outcome(ABSENT, label="absent")),
                          co.get(key, Outcome(ABSENT, label="absent")), rerun))  # fmt: skip
    return items


# ---------------------------------------------------------------------------------------------------- the report
def grouped(items: Iterable[Item]) -> dict[str, list[Item]]:
    out: dict[str, list[Item]] = {c: [] for c in CATEGORIES}
    for item in items:
        out[item.category].append(item)
    return out


def exit_code(items: Iterable[Item]) -> int:
    """1 when anything is newly failing, else 0."""
    return 1 if any(i.category == NEW for i in items) else 0


def _side(o: Outcome) -> str:
    return o.label or o.verdict


def _last(detail: str) -> str:
    """The last line of a run's output that is not a warning, shortened."""
    lines = [ln for ln in detail.splitlines() if "warn" not in ln.lower() and ln.strip()]
    observed = [ln for ln in lines if ln.lstrip().startswith("observed:")]  # what a repro says it saw, where it says
    return (observed or lines or [""])[-1].strip()[:200]


def render(items: Sequence[Item], header: Sequence[str]) -> str:
    """The three lists (fixed, still present, newly failing), what was not compared, and the unchanged checks."""
    groups = grouped(items)
    lines = list(header)
    for category in (FIXED, STILL, NEW):
        lines += ["", f"{TITLES[category]} ({len(groups[category])}):"]
        if not groups[category]:
            lines.append("  none")
        for item in groups[category]:
            lines.append(f"  {item.kind} {item.id}: release {_side(item.release)}, checkout {_side(item.checkout)}"
                         + (f"  ({item.note})" if item.note else ""))  # fmt: skip
            if category in (NEW, STILL) and (said := _last(item.checkout.detail)):
                lines.append(f"    checkout: {said}")
            if category == FIXED and item.kind != "check" and (said := _last(item.release.detail)):
                lines.append(f"    release:  {said}")
            if "checkout" in item.rerun:  # the release's command is the same without the PYTHONPATH
                lines.append(f"    rerun: {item.rerun['checkout']}")
    na = groups[NA]
    lines += ["", f"{TITLES[NA]} ({len(na)}):"]
    for item in na:
        why = item.note if item.release.verdict == ABSENT == item.checkout.verdict else (
            f"release {_side(item.release)}, checkout {_side(item.checkout)}"
            + (f"; {item.note}" if item.note else ""))  # fmt: skip
        if ERROR in (item.release.verdict, item.checkout.verdict) and (said := _last(item.checkout.detail)):
            why += f"; checkout: {said}"
        if item.checkout.verdict == KNOWN:
            why += "; fails on the checkout only as a registered finding predicts (its repro decides)"
        lines.append(f"  {item.kind} {item.id}: {why}")
    unchanged = groups[UNCHANGED]
    if unchanged:
        kind = "check(s)" if all(i.kind == "check" for i in unchanged) else "item(s)"
        lines += ["", f"{TITLES[UNCHANGED]}: {len(unchanged)} {kind} passing or not applicable on both sides"]
    counts = ", ".join(f"{len(groups[c])} {c}" for c in CATEGORIES)
    lines += ["", f"{len(items)} items: {counts}"]
    return "\n".join(lines)


def payload(items: Sequence[Item], **header) -> dict:
    """The run as JSON: the header's facts, each item with its category, and the counts."""
    groups = grouped(items)
    return {**header, "counts": {c: len(v) for c, v in groups.items()},
            "items": [asdict(i) | {"category": i.category} for i in items], "exit_code": exit_code(items)}  # fmt: skip
