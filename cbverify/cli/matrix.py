"""``cbverify matrix``: the upstream checks, the compatibility tests, ``verify`` and optionally the fuzzer across
transformers x trl versions, one cached venv each (see ``cbverify.upstream.matrix`` and ``matrix_checks``).

Versions not given default to the installed ones: ``--trl 1.8.0`` alone runs trl 1.8.0 beside the installed
transformers, ``--transformers 5.9.0`` alone beside the pinned trl."""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cbverify import install
from cbverify.cli import integer, ray_backend, ray_option, refuse
from cbverify.data import workdir
from cbverify.upstream.matrix import combo_name, ensure_base, ensure_venv, minor_releases
from cbverify.upstream.matrix_checks import install_failed, run_combo, write_report

STEPS = ("upstream", "pytest", "verify")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transformers", nargs="+", default=[], help="transformers versions or checkout paths")
    parser.add_argument(
        "--all-minors", metavar="FROM", default=None,
        help="also every transformers minor release from FROM (e.g. 5.8), the newest patch of each, as the package "
        "index lists",
    )  # fmt: skip
    parser.add_argument("--trl", nargs="+", default=[], help="trl versions or checkout paths (default: pinned)")
    parser.add_argument(
        "--all-trl-minors", metavar="FROM", default=None,
        help="also every trl minor release from FROM (e.g. 1.0), the newest patch of each, as the package index lists",
    )  # fmt: skip
    parser.add_argument(
        "--venv-dir",
        type=Path,
        default=None,
        help=f"where the cached venvs live, on every node that runs a combination (default: {workdir('matrix-venvs')}"
        ", or that node's own checkout or user cache)",
    )
    parser.add_argument("--out", type=Path, default=workdir("matrix-venvs") / "results",
                        help="folder for JSON/Markdown/log output (default: %(default)s)")  # fmt: skip
    parser.add_argument("--model", default="tiny-llama-arith", help="bundled model name or local checkpoint path")
    parser.add_argument(
        "--random-model", action="store_true", help="--model's architecture with seeded random weights"
    )
    parser.add_argument("--path", choices=("generate", "cb", "rollout_func"), help="only scenarios on this path")
    parser.add_argument("--fuzz", type=integer(0), default=0, metavar="N",
                        help="also run N fuzz examples of transformers-cb")  # fmt: skip
    parser.add_argument("--jobs", type=integer(1, 256), default=1,
                        help="combinations checked at once (each uses ~1 core)")  # fmt: skip
    parser.add_argument("--timeout", type=integer(1), default=3600, help="seconds allowed per step of a combination")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS),
                        help="the steps run in each venv (default: all; the venv row is always there)")  # fmt: skip
    ray_option(parser, "combinations")


def _below_trl_floor(versions: list[str]) -> str | None:
    """Why a trl version (not a checkout path) is out of reach, if one is (``trl_compat.FLOOR``)."""
    from packaging.version import InvalidVersion, Version

    from cbverify.upstream.trl_compat import FLOOR

    for v in versions:
        try:
            below = Version(v) < Version(FLOOR)
        except InvalidVersion:  # a checkout path
            continue
        if below:
            return (f"trl {v} is before {FLOOR}, the first release with a GRPOTrainer "
                    "(cbverify.upstream.trl_compat)")  # fmt: skip
    return None


def run(args: argparse.Namespace) -> int:
    import transformers
    from tqdm import tqdm

    if problem := _below_trl_floor([*args.trl, *([args.all_trl_minors] if args.all_trl_minors else [])]):
        return refuse("matrix", problem)
    try:
        install.installer()  # a CBVERIFY_INSTALLER that cannot be honoured, before anything is built
    except ValueError as err:
        return refuse("matrix", err)
    try:  # the package index lists the releases (pip index versions): unreachable, it is one line
        versions = list(args.transformers) + (minor_releases("transformers", args.all_minors) if args.all_minors
                                              else [])  # fmt: skip
        trls = list(args.trl) + (minor_releases("trl", args.all_trl_minors) if args.all_trl_minors else [])
    except RuntimeError as err:
        return refuse("matrix", err)
    if not versions and not trls:
        return refuse("matrix", "give --transformers / --all-minors and/or --trl / --all-trl-minors")
    combos = [
        (t, r) for t in dict.fromkeys(versions or [transformers.__version__]) for r in dict.fromkeys(trls or [None])
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ray is not None:
        from cbverify.campaign import matrix as campaign

        backend = ray_backend("matrix", args.ray)
        return backend if isinstance(backend, int) else campaign.run(args, combos, backend)
    args.venv_dir = args.venv_dir or workdir("matrix-venvs")
    args.venv_dir.mkdir(parents=True, exist_ok=True)
    with (args.out / "base.log").open("w") as log:
        base = ensure_base(args.venv_dir, log)
    if isinstance(base, str):
        return refuse("matrix", f"cannot build the shared torch venv: {base}")
    bar = tqdm(total=len(combos), desc="matrix", unit="combo")

    def one(combo: tuple[str, str | None]) -> tuple[str, dict | str, float]:
        name, start = combo_name(*combo), time.perf_counter()
        with (args.out / f"{name}.log").open("w") as log:
            error = ensure_venv(args.venv_dir / name, *combo, log)
            payload = (
                run_combo(args.venv_dir / name, args, args.out, name, log) if error is None else install_failed(error)
            )
        seconds = round(time.perf_counter() - start, 1)
        bad = [r["label"] if r["check"] == "venv" else r["check"] for r in payload["results"] if not r["ok"]]
        tqdm.write(f"[{name}] {seconds} s: " + (f"unexpected: {bad}" if bad else "as expected"))
        bar.update()
        return name, payload, seconds

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        done = list(pool.map(one, combos))
    bar.close()
    columns = {name: payload for name, payload, _ in done}
    text, ok = write_report(args.out, columns, {name: seconds for name, _, seconds in done})
    print(text)
    print(f"wrote {args.out / 'matrix.json'} and {args.out / 'matrix.md'}")
    return 0 if ok else 1
