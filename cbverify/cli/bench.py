"""``cbverify bench``: the three rollout engines side by side (throughput, latency, memory, waste) plus TRL GRPO step
timings, written to ``--out`` as JSON, a Markdown table and PNG plots. Exit code 1 when any engine errored, any
output check failed, or (with ``--strict-targets``) a CPU target was missed.

Everything is CUDA-ready: ``--device cuda`` uses bf16, the best attention available, a Llama-3.2-1B-shaped random
model unless ``--model`` names a checkpoint, warm-up before timing and synchronised clocks.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from pathlib import Path

from cbverify.bench.grpo_step import DEFAULT_PATHS
from cbverify.bench.grpo_step import WORKLOADS as GRPO_WORKLOADS
from cbverify.bench.timed import DEFAULT_ENGINES, ENGINES
from cbverify.bench.workloads import WORKLOADS
from cbverify.cli import device, held_stderr, integer, missing_device, number, refuse, seed_type

GRPO_NS = (8, 32, 64)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=device, default="cpu",
                        help="cpu or cuda[:i] (bf16 and flash/sdpa attention on CUDA)")  # fmt: skip
    parser.add_argument(
        "--workload",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="workloads to run (cbverify/bench/workloads.py documents their length distributions)",
    )
    parser.add_argument("--n", nargs="+", type=integer(1), default=[8, 32, 64, 128],
                        help="generations per prompt, each >= 1")  # fmt: skip
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=list(DEFAULT_ENGINES),
        help="engines to compare (vllm: opt-in, after `cbverify env build vllm`)",
    )
    parser.add_argument(
        "--model",
        default="random",
        help="'random' (device-shaped random Llama) or a bundled name / local checkpoint directory "
        "for gsm8k-like and uniform; arith always uses tiny-llama-arith (its prompts are in that vocabulary)",
    )
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="model dtype (default fp32 CPU, bf16 CUDA)")  # fmt: skip
    parser.add_argument("--rounds", type=integer(1), default=3, help="runs of the whole matrix (>= 1), the order "
                        "reversed every other round; each case is its fastest round (min-max beside it)")  # fmt: skip
    parser.add_argument("--out", default="bench-results", help="output directory (created)")
    parser.add_argument("--threads", type=integer(1, 1024), default=min(2, os.cpu_count() or 1),
                        help="torch CPU threads, 1 to 1024")  # fmt: skip
    parser.add_argument(
        "--kv-headroom",
        type=number(0, low_open=True),
        default=1.25,
        help="cb_impl KV budget = distinct prompts + headroom (> 0) x a-priori mean completion x requests",
    )
    parser.add_argument("--max-batch-tokens", type=integer(1), default=512,
                        help="per-step token budget of both CB engines, >= 1")  # fmt: skip
    parser.add_argument(
        "--temperature",
        type=number(0),
        default=1.0,
        help="sampling temperature, >= 0 (TRL's default 1.0); 0 = greedy and checks tokens vs cb_impl",
    )
    parser.add_argument("--seed", type=seed_type(), default=0,
                        help="workload seed (prompts, lengths, request seeds), in [0, 2**32)")  # fmt: skip
    parser.add_argument(
        "--time-forwards",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time model forwards for engine overhead per step (default: on for CPU, off for CUDA, where the sync "
        "around each forward would remove the CPU/GPU overlap that engines rely on)",
    )
    parser.add_argument("--matrix", action=argparse.BooleanOptionalAction, default=True,
                        help="the generation matrix (--no-matrix: the GRPO step only)")  # fmt: skip
    parser.add_argument(
        "--grpo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time TRL GRPOTrainer steps with each generation path",
    )
    parser.add_argument("--grpo-n", nargs="+", type=integer(2), default=list(GRPO_NS),
                        help="N for the GRPO-step benchmark, each >= 2 (GRPO needs a group)")  # fmt: skip
    parser.add_argument("--grpo-steps", type=integer(2), default=5, help="trainer steps per GRPO case and round, "
                        ">= 2 (the first a warm-up)")  # fmt: skip
    parser.add_argument("--grpo-rounds", type=integer(1), default=2,
                        help="rounds of every GRPO path, alternating the order, >= 1")  # fmt: skip
    parser.add_argument("--grpo-workload", nargs="+", choices=GRPO_WORKLOADS, default=list(GRPO_WORKLOADS),
                        help="GRPO-step workloads: arith (tiny-llama-arith, ~40-token completions) and reasoning "
                        "(long-tailed completions up to 256 tokens, cbverify/bench/reasoning.py)")  # fmt: skip
    parser.add_argument(
        "--grpo-model",
        default="tiny-llama-arith",
        help="bundled name or local checkpoint (with its tokenizer) for the arith GRPO-step benchmark",
    )
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one extra untimed run per case into OUT/logs/*.prof.txt")  # fmt: skip
    parser.add_argument(
        "--from-logs",
        action="store_true",
        help="do not run: rebuild the report from the worker records already under OUT/logs",
    )
    parser.add_argument(
        "--strict-targets",
        action="store_true",
        help="exit 1 when a target is missed (the matrix's in cbverify/bench/suite.py, the GRPO step's in report.py)",
    )


def run(args: argparse.Namespace) -> int:
    from cbverify.bench import report
    from cbverify.bench.grpo_step import GrpoConfig
    from cbverify.bench.grpo_suite import run_grpo
    from cbverify.bench.suite import SuiteConfig, run_suite

    out = Path(args.out)
    try:
        config, grpo = _configs(args, SuiteConfig, GrpoConfig)
    except (ValueError, FileNotFoundError) as err:
        return refuse("bench", err)
    try:
        if not args.matrix and not args.grpo:
            return refuse("bench", "--no-matrix --no-grpo: nothing to run")
        result = (run_suite(config, out, from_logs=args.from_logs) if args.matrix
                  else {"config": asdict(config), "cases": [], "ratios": [], "targets": []})  # fmt: skip
        if grpo is not None:
            result["grpo"] = run_grpo(grpo, out, from_logs=args.from_logs)
    except (FileNotFoundError, ValueError, KeyError, TypeError) as err:
        if not args.from_logs:
            raise
        return refuse("bench", f"--from-logs: the records under {out / 'logs'} cannot be read: {err!r}")
    paths = report.write(result, out)
    print(report.markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = [c for c in result["cases"] if c.get("check_problems")]
    failed += [r for r in (result.get("grpo") or {}).get("rows", []) if "error" in r]
    missed = [t for t in result["targets"] + report.grpo_targets((result.get("grpo") or {}).get("rows", []))
              if t["met"] is False]  # fmt: skip
    if failed:
        print(f"FAIL: {len(failed)} case(s) errored or failed their output checks (see results.md)")
    if missed:
        print(f"{'FAIL' if args.strict_targets else 'NOTE'}: {len(missed)} target(s) missed: "
              + "; ".join(t["target"] for t in missed))  # fmt: skip
    return 1 if failed or (missed and args.strict_targets) else 0


def _configs(args: argparse.Namespace, suite_config: type, grpo_config: type) -> tuple:
    """The suite's and (with ``--grpo``) the GRPO benchmark's configurations, after the checks no flag type makes: the
    device exists, the checkpoints named are usable (:func:`cbverify.checkpoint.preflight`), ``--out`` is a folder."""
    from cbverify.checkpoint import preflight

    if (why := missing_device(args.device)) is not None:
        raise ValueError(why)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out}: exists and is not a folder")
    with held_stderr():
        if args.model != "random":
            preflight(args.model)
        if args.grpo:
            preflight(args.grpo_model)
    config = suite_config(device=args.device, workloads=tuple(args.workload), ns=tuple(args.n),
                          engines=tuple(args.engines), model=args.model, dtype=args.dtype, threads=args.threads,
                          kv_headroom=args.kv_headroom, max_batch_tokens=args.max_batch_tokens,
                          temperature=args.temperature, seed=args.seed,
                          time_forwards=not args.device.startswith("cuda") if args.time_forwards is None
                          else args.time_forwards, profile=args.profile, rounds=args.rounds)  # fmt: skip
    # the trainer's vLLM path joins the GRPO step when vLLM is one of the engines compared
    paths = (*DEFAULT_PATHS, "vllm") if "vllm" in args.engines else DEFAULT_PATHS
    if "vllm" in args.engines and not args.from_logs:
        from cbverify.engines import envs

        if (why := envs.problem("vllm")) is not None:
            raise ValueError(f"--engines vllm: {why}")
    grpo = grpo_config(device=args.device, ns=tuple(args.grpo_n), steps=args.grpo_steps, rounds=args.grpo_rounds,
                       threads=args.threads, model=args.grpo_model, paths=paths,
                       workloads=tuple(args.grpo_workload)) if args.grpo else None  # fmt: skip
    return config, grpo
