"""``cbverify validate --transformers PATH`` / ``--trl PATH``: did my change fix it, and did it break anything?

PATH is a local source tree of the package (a git checkout, or a plain tree such as an unpacked wheel or sdist with a
patch). Every registered finding's standalone repro that imports the package, and (unless ``--no-checks``) the
upstream checks the matrix runs, are run on the release (``--against VERSION``, default the newest release) in its
cached matrix venv, and on the checkout in the same venv with its sources first on ``PYTHONPATH``
(:mod:`cbverify.upstream.validate`). Prints FIXED by the change, STILL PRESENT, NEWLY FAILING (each with the command
that reruns it on each side) and what could not be compared; progress with an ETA on stderr. Exit 1 when anything is
newly failing, 0 otherwise, 2 on bad input (a path that is not a checkout of the package).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cbverify import data
from cbverify.cli import integer, refuse


def configure(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--transformers", type=Path, metavar="PATH", help="a transformers source checkout to validate")
    where.add_argument("--trl", type=Path, metavar="PATH", help="a trl source checkout to validate")
    parser.add_argument("--against", metavar="VERSION",
                        help="the release to compare with (default: the newest release on the package index), its "
                        "venv from the matrix's cache, built when missing; or the folder of a venv that has the "
                        "release installed")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every item, its verdict on each side and its category here")
    parser.add_argument("--no-checks", action="store_true", help="the findings' repros only, no upstream checks")
    parser.add_argument("--checks-path", choices=("generate", "cb", "rollout_func"),
                        help="only the upstream scenarios on this generation path")  # fmt: skip
    parser.add_argument("--timeout", type=integer(1), default=600, help="seconds allowed per repro run (default 600)")
    parser.add_argument("--checks-timeout", type=integer(1), default=1800,
                        help="seconds allowed to the upstream checks on each side (default 1800)")  # fmt: skip
    parser.add_argument("--jobs", type=integer(1, 64), default=1, help="repro runs at a time (default 1)")


def _release(package: str, against: str | None, log) -> tuple[str, str, str]:
    """``(python, the release in words, where it came from)``; a ``ValueError`` / ``RuntimeError`` when it cannot be
    had."""
    from packaging.version import InvalidVersion, Version

    from cbverify.upstream import validate

    if against is not None and Path(against).expanduser().is_dir():
        python = validate.venv_python(Path(against).expanduser())
        if python is None:
            raise ValueError(f"--against {against}: a folder given as the release must be a venv (bin/python and "
                             "pyvenv.cfg)")  # fmt: skip
        return str(python), f"the venv {against}", "given"
    if against is None:
        version, source = validate.newest_release(package)
    else:
        try:
            version, source = str(Version(against)), "given"
        except InvalidVersion:
            raise ValueError(f"--against {against!r} is neither a version nor a venv folder") from None
    return str(validate.release_python(package, version, log)), f"{package} {version}", source


def run(args: argparse.Namespace) -> int:
    from cbverify.upstream import validate

    package = "transformers" if args.transformers else "trl"
    path = (args.transformers or args.trl).expanduser().resolve()
    try:
        root = validate.checkout_root(path, package)
    except ValueError as err:
        return refuse("validate", err)
    work = data.workdir("matrix-venvs") / "validate"
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with (work / f"validate-{package}.log").open("w") as log:
        try:
            python, release_words, source = _release(package, args.against, log)
        except (ValueError, RuntimeError) as err:
            return refuse("validate", err)
    release_env = validate.base_env()
    try:
        seen = validate.probe(python, package, release_env)
    except RuntimeError as err:
        return refuse("validate", f"the release side cannot import {package}: {err}")
    co_env = validate.checkout_env(root, release_env)
    try:
        imported = validate.probe(python, package, co_env)
    except RuntimeError as err:  # the change itself may break the import: every repro then errs, newly failing
        imported = {"file": f"(import failed: {err})"}
    if not imported["file"].startswith("(") and not Path(imported["file"]).resolve().is_relative_to(root):
        return refuse("validate", f"with {root} first on PYTHONPATH, {package} is imported from {imported['file']}, "
                      "not from the checkout")  # fmt: skip
    versions = {p: seen.get(p) for p in validate.PACKAGES}
    release = validate.Side("release", python, release_env, versions)
    checkout = validate.Side("checkout", python, co_env, versions, str(root))
    targets = validate.targets(package, work)
    runnable = sum(t.script is not None for t in targets)
    header = [
        f"validate {package} checkout {path} ({validate.describe_checkout(path, root, package)}; imported from "
        f"{imported['file']})",
        f"against {release_words} ({source}): {python} (transformers {versions['transformers']}, trl "
        f"{versions['trl']})",
        f"{runnable} finding repro(s) on both sides"
        + ("" if args.no_checks else f", the upstream checks ({' '.join(validate.CHECKS_COMMAND[1:])}) on both"),
    ]
    print("\n".join(header), file=sys.stderr, flush=True)
    items = validate.validate(package, targets, release, checkout, checks=not args.no_checks,
                              checks_path=args.checks_path, timeout=args.timeout, checks_timeout=args.checks_timeout,
                              work=work, jobs=args.jobs)  # fmt: skip
    seconds = time.perf_counter() - start
    print(validate.render(items, header) + f"\nin {seconds:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        facts = {"package": package, "checkout": str(path), "source_root": str(root), "release": release_words,
                 "python": python, "versions": versions, "seconds": round(seconds, 1)}  # fmt: skip
        args.json.write_text(json.dumps(validate.payload(items, **facts), indent=1, default=str))
        print(f"wrote {args.json}", file=sys.stderr)
    return validate.exit_code(items)
