"""``cbverify golden record|check``: write or verify the golden log-prob regression files (see golden/README.md).

``record`` refuses a dirty git tree and existing files without ``--force``; ``check`` exits 1 when any case fails
and prints, per failure, the case, the engine, the first divergent position and the environment diff since recording.
"""

from __future__ import annotations

import argparse
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="golden_command", required=True, metavar="ACTION")
    rec = sub.add_parser("record", help="record golden files with the reference oracle (needs a clean git tree)")
    chk = sub.add_parser("check", help="check the reference and every applicable engine against the golden files")
    for p in (rec, chk):
        p.add_argument("--case", action="append", default=[], metavar="NAME",
                       help="a case name or a substring of one (repeatable); default: every case")  # fmt: skip
        p.add_argument("--device", default="cpu", help="torch device; goldens are kept per device class (default cpu)")
        p.add_argument("--list", action="store_true", help="list the cases for the device and exit")
        p.add_argument("--threads", type=int, default=2,
                       help="torch CPU threads (default 2, as CI and the committed CPU goldens)")  # fmt: skip
    rec.add_argument("--force", action="store_true", help="overwrite existing records (say why in the commit)")
    chk.add_argument("--engine", action="append", default=None, metavar="NAME",
                     help="check only this engine (repeatable); default: every registered engine")  # fmt: skip
    chk.add_argument("--no-trajectory", action="store_true", help="skip re-running the recorded GRPO trajectory")


def run(args: argparse.Namespace) -> int:
    import torch

    from cbverify.golden import cases as golden_cases

    if args.threads < 1:
        print(f"error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        cases = golden_cases.select(args.case, args.device)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    if args.golden_command == "record":
        return _record(cases, args)
    return _check(cases, args)


def _record(cases: list, args: argparse.Namespace) -> int:
    from cbverify.golden.record import RecordRefused, record

    try:
        written = record(cases, args.device, force=args.force)
    except RecordRefused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(f"wrote {path}" for path in written))
    return 0


def _check(cases: list, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from cbverify.golden.check import check_case

    results = []
    for case in tqdm(cases, desc="checking goldens", unit="case"):
        results.append(check_case(case, args.device, engines=args.engine, trajectory=not args.no_trajectory))
        tqdm.write(results[-1].report())
    failed = [r.case for r in results if not r.ok]
    print(f"{len(results) - len(failed)}/{len(results)} golden cases pass" + (f"; FAILED: {', '.join(failed)}"
                                                                              if failed else ""))  # fmt: skip
    return 1 if failed else 0
