"""``cbverify golden record|check``: write or verify the golden log-prob regression files (see golden/README.md).

``record`` refuses a dirty git tree and existing files without ``--force``; ``check`` exits 1 when any case fails
and prints, per failure, the case, the engine, the first divergent position and the environment diff since recording.
"""

from __future__ import annotations

import argparse

from cbverify.cli import device, integer, missing_device, refuse


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="golden_command", required=True, metavar="ACTION")
    rec = sub.add_parser("record", help="record golden files with the reference oracle (needs a clean git tree)")
    chk = sub.add_parser("check", help="check the reference and every applicable engine against the golden files")
    for p in (rec, chk):
        p.add_argument("--case", action="append", default=[], metavar="NAME",
                       help="a case name or a substring of one (repeatable); default: every case")  # fmt: skip
        p.add_argument("--device", type=device, default="cpu",
                       help="cpu, cuda or cuda:N; goldens are kept per device class (default cpu)")  # fmt: skip
        p.add_argument("--list", action="store_true", help="list the cases for the device and exit")
        p.add_argument("--threads", type=integer(1, 1024), default=2,
                       help="torch CPU threads, 1 to 1024 (default 2, as CI and the CPU goldens)")  # fmt: skip
    rec.add_argument("--force", action="store_true", help="overwrite existing records (say why in the commit)")
    chk.add_argument("--engine", action="append", default=None, metavar="NAME",
                     help="check only this engine (repeatable); default: every registered engine")  # fmt: skip
    chk.add_argument("--no-trajectory", action="store_true", help="skip re-running the recorded GRPO trajectory")


def run(args: argparse.Namespace) -> int:
    import torch

    from cbverify.golden import cases as golden_cases

    if (why := missing_device(args.device)) is not None:
        return refuse("golden", why)
    torch.set_num_threads(args.threads)
    try:
        cases = golden_cases.select(args.case, args.device)
    except ValueError as err:  # a case that matches nothing
        return refuse("golden", err)
    from cbverify.engines import known_engines

    unknown = [e for e in getattr(args, "engine", None) or () if e not in known_engines() and ":" not in e]
    if unknown:
        return refuse("golden", f"unknown engine {', '.join(unknown)}; known engines: {', '.join(known_engines())}, "
                      "or module:factory")  # fmt: skip
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
        return refuse("golden", err)
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
