"""One engine on one workload at several N, in a process of its own: ``python -m cbverify.bench.worker --engine ...``.

A fresh process per (engine, workload) keeps one engine's allocations out of another's peak RSS. N runs in ascending
order, so the process's lifetime peak RSS after case N is the peak of case N (memory grows with N). Each case is
preceded by an untimed warm-up on a 2-request batch of the same workload (allocator, kernels, CUDA context/graphs).
Results go to ``--out`` as one JSON object per line; an engine error is recorded in its case (``error``) and the
worker exits 1, so nothing fails silently.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import traceback
from pathlib import Path

import torch

from cbverify.bench import measure
from cbverify.bench.models import load_bench_model, parse_dtype
from cbverify.bench.timed import ENGINES, EngineOptions, run_engine
from cbverify.bench.workloads import WORKLOADS, LengthDist, Workload, kv_budget_tokens, make_requests, make_workload

CB_IMPL_BLOCK_SIZE = 16  # cb_impl's EngineConfig default block size


def warmup_workload(workload: Workload) -> Workload:
    tiny = LengthDist(8, 0.0, 8, 8)
    if workload.natural_eos:
        return make_workload(workload.name, 2, num_prompts=1, max_new_tokens=8, seed=999,
                             temperature=workload.temperature)  # fmt: skip
    return make_workload(workload.name, 2, num_prompts=1, completion_len=tiny, max_new_tokens=8, seed=999,
                         temperature=workload.temperature)  # fmt: skip


def profile(engine: str, fn, path: Path) -> None:
    """cProfile of one extra, untimed run: the 30 functions with the most own time, then the 30 most cumulative."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    text = io.StringIO()
    text.write(f"# cProfile of one untimed {engine} run (the timed run was not profiled)\n")
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    path.write_text(text.getvalue())


def run_case(model, vocab_size: int, workload: Workload, engine: str, args: argparse.Namespace) -> dict:
    n = workload.num_generations
    requests = make_requests(workload, vocab_size=vocab_size)
    budget = kv_budget_tokens(workload, requests, headroom=args.kv_headroom)
    opts = EngineOptions(device=args.device, num_blocks=-(-budget // CB_IMPL_BLOCK_SIZE),
                         max_batch_tokens=args.max_batch_tokens, time_forwards=args.time_forwards)  # fmt: skip
    warm = warmup_workload(workload)
    run_engine(engine, model, make_requests(warm, vocab_size=vocab_size), opts)
    baseline = measure.reset_peak(args.device)
    base_rss = measure.rss_mb()
    run = run_engine(engine, model, requests, opts)
    memory = measure.peak_memory(args.device, baseline, base_rss)
    if "engine_peak_rss_mb" in run.extra:  # an engine in a process of its own: its process's peak, not ours
        memory = {"peak_memory_mb": run.extra["engine_peak_rss_mb"], "peak_memory_delta_mb": None,
                  "memory_kind": "peak RSS of the engine's own process"}  # fmt: skip
    if args.profile:
        profile(
            engine, lambda: run_engine(engine, model, requests, opts), Path(args.out).with_suffix(f".N{n}.prof.txt")
        )
    lengths = [len(c) for c in run.completions]
    tokens = sum(lengths)
    necessary = measure.necessary_tokens(requests, lengths)
    non_forward = run.wall_s - run.forward_s
    return {
        "engine": engine, "workload": workload.name, "n": workload.num_generations,
        "num_prompts": workload.num_prompts,
        "num_requests": len(requests), "temperature": workload.temperature, "wall_s": run.wall_s, "ttft_s": run.ttft_s,
        "completion_tokens": tokens, "tokens_per_s": tokens / run.wall_s, "kv_reserved_bytes": run.kv_reserved_bytes,
        "cb_impl_kv_budget_tokens": budget, "steps": run.steps, "forward_tokens": run.forward_tokens,
        "necessary_tokens": necessary, "wasted_share": measure.wasted_share(necessary, run.forward_tokens),
        "forward_s": run.forward_s if args.time_forwards else None,
        "overhead_per_step_ms": 1e3 * non_forward / run.steps if args.time_forwards and run.steps else None,
        "setup_s": run.setup_s, **memory, "extra": run.extra, "completion_lengths": lengths,
        "finish_reasons": run.finish_reasons, "completions": run.completions if args.keep_tokens else None,
    }  # fmt: skip


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, required=True, help="which engine this process runs")
    parser.add_argument("--workload", choices=WORKLOADS, required=True, help="which workload")
    parser.add_argument("--n", type=int, nargs="+", required=True, help="generations per prompt, run ascending")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--model", default="random", help="'random' (device-shaped Llama) or a bundled name / path")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 CPU, bf16 CUDA)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--kv-headroom", type=float, default=1.25, help="cb_impl KV budget multiplier (workloads.py)")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="token budget per step of both CB engines")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy everywhere")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "--time-forwards",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time each model forward (engine overhead per step); syncs CUDA around forwards",
    )
    parser.add_argument("--profile", action="store_true", help="also cProfile one untimed run per case (logs/)")
    parser.add_argument("--keep-tokens", action="store_true", help="store completion token ids (greedy checks)")
    parser.add_argument("--out", required=True, help="JSON-lines file receiving one record per case")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_name = "tiny-llama-arith" if args.workload == "arith" else args.model  # arith prompts: its char vocab
    model, info = load_bench_model(model_name, device=args.device, dtype=parse_dtype(args.dtype, args.device))
    env = measure.environment(args.device)
    status = 0
    with open(args.out, "a") as out:
        for n in sorted(args.n):
            workload = make_workload(
                args.workload, n, device=args.device, temperature=args.temperature, seed=args.seed
            )
            try:
                record = run_case(model, info["vocab_size"], workload, args.engine, args)
            except Exception as err:  # recorded, reported, and turned into a failing exit code
                status = 1
                record = {"engine": args.engine, "workload": args.workload, "n": n,
                          "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}  # fmt: skip
            out.write(json.dumps(record | {"model": info, "env": env}) + "\n")
            out.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
