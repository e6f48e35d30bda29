"""``cbverify bench``: the three rollout engines side by side (throughput, latency, memory, waste) plus TRL GRPO step
timings, written to ``--out`` as JSON, a Markdown table and PNG plots. Exit code 1 when any engine errored, any
output check failed, or (with ``--strict-targets``) a CPU target was missed.

Everything is CUDA-ready: ``--device cuda`` uses bf16, the best attention available, a Llama-3.2-1B-shaped random
model unless ``--model`` names a checkpoint, warm-up before timing and synchronised clocks.

No case can hang the run and no finished case is lost: each case's record is in ``OUT/logs`` the moment it ends, a case
past its time box (``--case-timeout``, shrunk to a fair share of ``--time-budget``) is killed and recorded as a timeout
with what it had done, the report is rebuilt from the logs after every worker process and at the end (also after
Ctrl-C or SIGTERM: exit 130 / 143), and ``--from-logs [DIR]`` rebuilds it at any time
(:mod:`cbverify.bench.timebox`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from cbverify.bench.grpo_step import DEFAULT_PATHS
from cbverify.bench.grpo_step import WORKLOADS as GRPO_WORKLOADS
from cbverify.bench.timed import DEFAULT_ENGINES, ENGINES
from cbverify.bench.workloads import WORKLOADS
from cbverify.cli import device, held_stderr, integer, missing_device, number, refuse, seed_type

GRPO_NS = (8, 32, 64)
# Rounds per device class: on the shared CPU a run moves by 10-50% between rounds (bench/README.md, "Rounds"), so the
# matrix runs 3 times and the GRPO step twice; a GPU runs one round of each, which the default time budget can give
# every case of (cbverify.bench.timebox.DEFAULTS: the default `--device cuda` run ends within 8 minutes).
ROUNDS = {"cpu": (3, 2), "cuda": (1, 1)}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is: the worker in flight is killed, its case recorded, the report written."""


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
    parser.add_argument("--rounds", type=integer(1), default=None, help="runs of the whole matrix (>= 1; default 3 "
                        "on CPU, 1 on CUDA), the order reversed every other round; each case is its fastest round "
                        "(min-max beside it)")  # fmt: skip
    parser.add_argument("--out", default=None, help="output directory (created; default bench-results)")
    parser.add_argument("--case-timeout", type=number(0), default=None, metavar="SECONDS",
                        help="a case's time box, from its start (warm-up included) to its record: past it the worker "
                        "is killed and the case recorded as a timeout with what it had done, and the run goes on "
                        "(default 600 on CPU, 60 on CUDA; 0: none)")  # fmt: skip
    parser.add_argument("--time-budget", type=number(0), default=None, metavar="SECONDS",
                        help="the whole run's time: each case's box shrinks to a fair share of what is left, cases "
                        "with no time left are recorded as skipped (default none on CPU, 420 on CUDA: the default "
                        "run ends within 8 minutes; 0: none)")  # fmt: skip
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
    parser.add_argument("--grpo-rounds", type=integer(1), default=None,
                        help="rounds of every GRPO path, alternating the order, >= 1 (default 2 on CPU, 1 on "
                        "CUDA)")  # fmt: skip
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
        nargs="?",
        const=True,
        default=None,
        metavar="DIR",
        help="do not run: rebuild the report in DIR (default --out) from the records under DIR/logs, at any time, "
        "also of a run still going or cut short (its missing cases named)",
    )
    parser.add_argument(
        "--strict-targets",
        action="store_true",
        help="exit 1 when a target is missed (the matrix's in cbverify/bench/suite.py, the GRPO step's in report.py)",
    )


def run(args: argparse.Namespace) -> int:
    from cbverify.bench.grpo_step import GrpoConfig
    from cbverify.bench.suite import SuiteConfig

    if isinstance(args.from_logs, str):
        if args.out is not None and Path(args.out) != Path(args.from_logs):
            return refuse("bench", f"--from-logs {args.from_logs} and --out {args.out}: the report is rebuilt where "
                          "its logs are; give one of them")  # fmt: skip
        args.out = args.from_logs
    out = Path(args.out or "bench-results")
    args.out = str(out)
    try:
        config, grpo = _configs(args, SuiteConfig, GrpoConfig)
    except (ValueError, FileNotFoundError) as err:
        return refuse("bench", err)
    if not args.matrix and not args.grpo:
        return refuse("bench", "--no-matrix --no-grpo: nothing to run")
    if args.from_logs:
        try:
            result = _result(out, config, grpo, *_parts(out, args))
        except (FileNotFoundError, ValueError, KeyError, TypeError) as err:
            return refuse("bench", f"--from-logs: the records under {out / 'logs'} cannot be read: {err!r}")
        return _finish(args, result, report_paths(result, out))
    stopped = _run(args, out, config, grpo)
    result = _result(out, config, grpo, args.matrix, args.grpo)
    with _ignoring(signal.SIGTERM):  # the report is being written: a second SIGTERM must not cut it
        code = _finish(args, result, report_paths(result, out))
    if stopped is not None:
        why = "SIGTERM" if isinstance(stopped, Terminated) else "interrupted"
        print(f"bench: {why}: the report has every case with a record, the rest marked missing; the records are in "
              f"{out / 'logs'} (cbverify bench --from-logs {out} rebuilds it)")  # fmt: skip
        return 143 if isinstance(stopped, Terminated) else 130
    return code


def report_paths(result: dict, out: Path, *, png: bool = True) -> list[Path]:
    from cbverify.bench import report

    return report.write(result, out, png=png)


def _run(args: argparse.Namespace, out: Path, config, grpo) -> KeyboardInterrupt | None:
    """Run the matrix and the GRPO step time-boxed, the report rebuilt after every worker process; returns the
    interruption (Ctrl-C, SIGTERM) that stopped the run, if one did."""
    from cbverify.bench import grpo_suite, suite
    from cbverify.bench.timebox import Budget, TimeBoxes

    boxes = TimeBoxes.for_device(args.device, case_timeout_s=args.case_timeout, time_budget_s=args.time_budget)
    m_cases, m_workers = suite.matrix_size(config) if args.matrix else (0, 0)
    g_cases, g_workers = grpo_suite.grpo_size(grpo) if grpo is not None else (0, 0)
    budget = Budget(boxes, cases=m_cases + g_cases, workers=m_workers + g_workers)
    what = [f"{m_cases} matrix case(s) in {m_workers} worker process(es)"] if args.matrix else []
    what += [f"{g_cases} GRPO-step case(s) in {g_workers} process(es)"] if grpo is not None else []
    budget.say(budget.plan_line(" + ".join(what)))
    if args.matrix:
        suite.prepare(config, out, boxes)
    if grpo is not None:
        grpo_suite.prepare(grpo, out, boxes)

    def render() -> None:  # JSON and Markdown between worker processes (no worker runs: nothing measured is slowed)
        report_paths(_result(out, config, grpo, args.matrix, args.grpo), out, png=False)

    with _on_sigterm():
        try:
            if args.matrix:
                suite.run_matrix(config, out, budget, render, prepared=True)
            if grpo is not None:
                grpo_suite.run_grpo(grpo, out, budget=budget, after_worker=render, prepared=True)
        except KeyboardInterrupt as stop:
            return stop
    return None


def _parts(out: Path, args: argparse.Namespace) -> tuple[bool, bool]:
    """Which parts ``--from-logs`` rebuilds: those the run planned (its plans in the logs), else the flags'."""
    from cbverify.bench import grpo_suite, suite

    logs = out / "logs"
    if (logs / suite.PLAN).exists() or (logs / grpo_suite.PLAN).exists():
        return (logs / suite.PLAN).exists(), (logs / grpo_suite.PLAN).exists()
    return args.matrix, args.grpo


def _result(out: Path, config, grpo, matrix: bool, with_grpo: bool) -> dict:
    """The report's data, read from the logs (a run's report and a rebuilt one are the same by construction)."""
    from cbverify.bench.grpo_step import GrpoConfig
    from cbverify.bench.grpo_suite import run_grpo
    from cbverify.bench.suite import run_suite

    result = (run_suite(config, out, from_logs=True) if matrix
              else {"config": asdict(config), "cases": [], "ratios": [], "targets": []})  # fmt: skip
    if with_grpo:
        result["grpo"] = run_grpo(grpo or GrpoConfig(), out, from_logs=True)
    return result


def _finish(args: argparse.Namespace, result: dict, paths: list[Path]) -> int:
    from cbverify.bench import report
    from cbverify.bench.timebox import CUT, status_of

    print(report.markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    rows = [*result["cases"], *(result.get("grpo") or {}).get("rows", [])]
    failed = [c for c in result["cases"] if c.get("check_problems")]
    failed += [r for r in (result.get("grpo") or {}).get("rows", []) if "error" in r]
    missed = [t for t in result["targets"] + report.grpo_targets((result.get("grpo") or {}).get("rows", []))
              if t["met"] is False]  # fmt: skip
    cut = {s: sum(status_of(r) == s for r in rows) for s in CUT}
    if any(cut.values()):
        print("NOTE: cases without a measurement: " + ", ".join(f"{n} {s}" for s, n in cut.items() if n)
              + " (see results.md)")  # fmt: skip
    if failed:
        print(f"FAIL: {len(failed)} case(s) errored or failed their output checks (see results.md)")
    if missed:
        print(f"{'FAIL' if args.strict_targets else 'NOTE'}: {len(missed)} target(s) missed: "
              + "; ".join(t["target"] for t in missed))  # fmt: skip
    return 1 if failed or (missed and args.strict_targets) else 0


@contextlib.contextmanager
def _on_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in the main thread while the block runs."""

    def handler(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: SIGTERM keeps its handler
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _ignoring(signum: int) -> Iterator[None]:
    try:
        previous = signal.signal(signum, signal.SIG_IGN)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signum, previous)


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
    rounds, grpo_rounds = ROUNDS["cuda" if args.device.startswith("cuda") else "cpu"]
    config = suite_config(device=args.device, workloads=tuple(args.workload), ns=tuple(args.n),
                          engines=tuple(args.engines), model=args.model, dtype=args.dtype, threads=args.threads,
                          kv_headroom=args.kv_headroom, max_batch_tokens=args.max_batch_tokens,
                          temperature=args.temperature, seed=args.seed,
                          time_forwards=not args.device.startswith("cuda") if args.time_forwards is None
                          else args.time_forwards, profile=args.profile,
                          rounds=rounds if args.rounds is None else args.rounds)  # fmt: skip
    # the trainer's vLLM path joins the GRPO step when vLLM is one of the engines compared
    paths = (*DEFAULT_PATHS, "vllm") if "vllm" in args.engines else DEFAULT_PATHS
    if "vllm" in args.engines and not args.from_logs:
        from cbverify.engines import envs

        if (why := envs.problem("vllm")) is not None:
            raise ValueError(f"--engines vllm: {why}")
    grpo_rounds = grpo_rounds if args.grpo_rounds is None else args.grpo_rounds
    grpo = grpo_config(device=args.device, ns=tuple(args.grpo_n), steps=args.grpo_steps, rounds=grpo_rounds,
                       threads=args.threads, model=args.grpo_model, paths=paths,
                       workloads=tuple(args.grpo_workload)) if args.grpo else None  # fmt: skip
    return config, grpo
