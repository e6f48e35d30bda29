"""``cbverify fuzz``: a Hypothesis search over one engine's configurations and call patterns (see cbverify.fuzz)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cbverify.checkpoint import load_checked
from cbverify.cli import held_stderr, integer, ray_backend, ray_option, refuse, seed_type


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=("transformers-cb", "cb_impl", "hf-generate", "vllm"),
        default="transformers-cb",
        help="vllm runs in its own environment (cbverify env build vllm), ~10 s per case",
    )
    parser.add_argument(
        "--entry",
        choices=("manager", "generate_batch"),
        default="manager",
        help="transformers-cb: drive the manager's request API, or call model.generate_batch as TRL does",
    )
    parser.add_argument("--model", default="tiny-llama-arith", help="bundled name or local checkpoint (float32)")
    parser.add_argument("--examples", type=integer(1), default=50,
                        help="cases to draw, >= 1 (~4 s each for transformers-cb)")  # fmt: skip
    parser.add_argument("--seed", type=seed_type(), default=0, help="Hypothesis seed, in [0, 2**32)")
    parser.add_argument("--out", type=Path, default=None, help="write one repro script + JSON per failure class")
    parser.add_argument("--json", type=Path, default=None, help="also write what was explored and found as JSON")
    parser.add_argument("--shrink-runs", type=integer(0), default=12,
                        help="re-runs allowed to shrink each failure class, >= 0")  # fmt: skip
    parser.add_argument("--shards", type=integer(1, 4096), default=1,
                        help="a campaign of this many searches, seeds --seed, --seed+1, ..., --examples each, sharing "
                        "what they find (needs --out; one at a time, or as Ray tasks with --ray)")  # fmt: skip
    ray_option(parser, "shards")


def run(args) -> int:
    import torch

    from cbverify.fuzz import repro
    from cbverify.fuzz.search import explore, shrink, summary

    if args.engine == "vllm":
        from cbverify.engines import envs

        if (why := envs.problem("vllm")) is not None:
            print(f"cbverify fuzz --engine vllm: NOT-APPLICABLE: {why}")
            return 0
    if args.entry == "generate_batch" and args.engine != "transformers-cb":
        return refuse("fuzz", f"--entry generate_batch is transformers CB's entry point, not {args.engine}'s")
    for flag, path in (("--json", args.json), ("--out", args.out)):
        if path is not None and (path.parent.is_file() or (flag == "--json" and path.is_dir())):
            return refuse("fuzz", f"{flag} {path}: a folder, or inside a file")
    if (args.shards > 1 or args.ray is not None) and args.out is None:
        return refuse("fuzz", "--shards / --ray need --out: the campaign's results and shared examples live there")
    backend = _campaign_backend(args)
    if isinstance(backend, int):
        return backend
    torch.set_num_threads(1)
    try:
        with held_stderr():
            model = load_checked(args.model)
    except (ValueError, FileNotFoundError) as err:
        if backend is not None:
            backend.close()
        return refuse("fuzz", err)
    if backend is not None:
        from cbverify.campaign import fuzz as campaign

        return campaign.run(args, backend)
    report = explore(model, args.engine, model_name=args.model, examples=args.examples, seed=args.seed,
                     entry=args.entry)  # fmt: skip
    entry = f" --entry {args.entry}" if args.entry != "manager" else ""
    print(f"cbverify fuzz --engine {args.engine}{entry}: {report.examples} examples in {report.seconds:.1f}s")
    print("explored:", ", ".join(f"{k} {v}" for k, v in sorted(report.explored.items())))
    print("configs: ", ", ".join(f"{k} {v}" for k, v in sorted(report.configs.items())))
    if report.decisive:  # generate_batch: in how many cases each check could fail, and did
        print("checks:  ", ", ".join(f"{k} {v} ({report.failed[k]} FAIL)" for k, v in sorted(report.decisive.items())))
    if report.coverage is not None:  # options acting on one quantity set together, from what the calls resolved to
        print("pairs:   ", report.coverage.line())
    for cls in report.classes.values():
        if args.out is not None:
            cls = shrink(model, cls, budget=args.shrink_runs)
        verdict = cls.verdict
        print(f"  {verdict:45s} {cls.check}: {cls.examples} times; e.g. {cls.detail[:160]}")
        if args.out is not None:
            for path in repro.write(args.out, cls.case, cls.check, cls.detail, cls.finding):
                print(f"    wrote {path}")
    if not report.classes:
        print("  no failures")
    print(f"total {report.seconds:.1f}s; {len(report.unregistered)} unregistered failure classes")
    if args.json is not None:
        args.json.write_text(json.dumps(summary(report, args.engine, args.entry), indent=2))
    return 1 if report.unregistered else 0


def _campaign_backend(args):
    """``--shards`` / ``--ray``: the local backend (one shard at a time) or the Ray backend (exit code 2 when Ray
    cannot be used); ``None`` for a single search."""
    from cbverify.campaign.local import LocalBackend

    if args.ray is not None:
        return ray_backend("fuzz", args.ray)
    return LocalBackend(jobs=1) if args.shards > 1 else None
