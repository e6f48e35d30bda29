"""``cbverify bench``: the three rollout engines side by side (throughput, latency, memory, waste) plus TRL GRPO step
timings, written to ``--out`` as JSON, a Markdown table and PNG plots. Exit code 1 when any engine errored, any
output check failed, or (with ``--strict-targets``) a CPU target was missed.

Everything is CUDA-ready: ``--device cuda`` uses bf16, the best attention available, a Llama-3.2-1B-shaped random
model unless ``--model`` names a checkpoint, warm-up before timing and synchronised clocks.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cbverify.bench.timed import DEFAULT_ENGINES, ENGINES
from cbverify.bench.workloads import WORKLOADS

GRPO_NS = (8, 32, 64)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (bf16 and flash/sdpa attention on CUDA)")
    parser.add_argument(
        "--workload",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="workloads to run (cbverify/bench/workloads.py documents their length distributions)",
    )
    parser.add_argument("--n", nargs="+", type=int, default=[8, 32, 64, 128], help="generations per prompt")
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
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default fp32 CPU, bf16 CUDA)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of the whole matrix, the order reversed every "
                        "other round; each case is its fastest round (min-max beside it)")  # fmt: skip
    parser.add_argument("--out", default="bench-results", help="output directory (created)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch CPU threads")
    parser.add_argument(
        "--kv-headroom",
        type=float,
        default=1.25,
        help="cb_impl KV budget = distinct prompts + headroom x a-priori mean completion x requests",
    )
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="per-step token budget of both CB engines")
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature (TRL's default 1.0); 0 = greedy and checks tokens vs cb_impl",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (prompts, lengths, request seeds)")
    parser.add_argument(
        "--time-forwards",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time model forwards for engine overhead per step (default: on for CPU, off for CUDA, where the sync "
        "around each forward would remove the CPU/GPU overlap that engines rely on)",
    )
    parser.add_argument(
        "--grpo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time TRL GRPOTrainer steps with each generation path",
    )
    parser.add_argument("--grpo-n", nargs="+", type=int, default=list(GRPO_NS), help="N for the GRPO-step benchmark")
    parser.add_argument("--grpo-steps", type=int, default=5, help="trainer steps per GRPO case and round (the first "
                        "a warm-up)")  # fmt: skip
    parser.add_argument("--grpo-rounds", type=int, default=2, help="rounds of every GRPO path, alternating the order")
    parser.add_argument(
        "--grpo-model",
        default="tiny-llama-arith",
        help="bundled name or local checkpoint (with its tokenizer) for the GRPO-step benchmark",
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
    from cbverify.bench.suite import SuiteConfig, run_suite

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: CUDA is not available on this machine")
    out = Path(args.out)
    config = SuiteConfig(device=args.device, workloads=tuple(args.workload), ns=tuple(args.n),
                         engines=tuple(args.engines), model=args.model, dtype=args.dtype, threads=args.threads,
                         kv_headroom=args.kv_headroom, max_batch_tokens=args.max_batch_tokens,
                         temperature=args.temperature, seed=args.seed,
                         time_forwards=not args.device.startswith("cuda") if args.time_forwards is None
                         else args.time_forwards, profile=args.profile, rounds=args.rounds)  # fmt: skip
    result = run_suite(config, out, from_logs=args.from_logs)
    if args.grpo:
        from cbverify.bench.grpo_step import GrpoConfig, run_grpo

        grpo = GrpoConfig(device=args.device, ns=tuple(args.grpo_n), steps=args.grpo_steps, rounds=args.grpo_rounds,
                          threads=args.threads, model=args.grpo_model)  # fmt: skip
        result["grpo"] = run_grpo(grpo, out, from_logs=args.from_logs)
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
