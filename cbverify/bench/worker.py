"""One engine on one workload at several N, in a process of its own: ``python -m cbverify.bench.worker --engine ...``.

A fresh process per (engine, workload) keeps one engine's allocations out of another's peak RSS. N runs in ascending
order, so the process's lifetime peak RSS after case N is the peak of case N (memory grows with N). Each case is
preceded by an untimed warm-up on a 2-request batch of the same workload (allocator, kernels, CUDA context/graphs).
Results go to ``--out`` as one JSON object per line, written (flushed and fsynced) the moment the case ends, with its
``round`` and ``status`` (``ok``, or ``error`` when the engine raised: the worker then exits 1, so nothing fails
silently).

With ``--progress FILE`` the worker also reports to the parent that time-boxes it (``cbverify.bench.timebox``): a
``start`` line when a case begins and, every second, what the case has done so far (phase ``warmup`` / ``timed`` /
``profile``, requests finished, completion tokens, model forwards). Those counts come from outside the engines' timed
code where possible: tokens are the logit rows of the forwards (``ForwardStats.logit_rows``; ``generate()``: each row
one token per forward, up to its length; ``cb_impl``: its own ``stats`` counter, as it samples a shared prompt's first
tokens from one row), finished requests are what ``cb_impl``'s ``step()`` returns and what the transformers CB
manager's ``get_result`` hands back (both wrapped in this process only: one call each per step or result), and for
``generate()`` the rows whose length is reached (unknown with a natural EOS until the call returns).

Test hook: ``CBVERIFY_BENCH_SLOW_FORWARD="ENGINE:N:SECONDS[,...]"`` sleeps ``SECONDS`` before every model forward of
the timed run of ``ENGINE`` at ``N`` (a slow or hung case, for the time-box tests; never set by the bench itself).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from cbverify.bench import measure
from cbverify.bench.measure import ForwardStats
from cbverify.bench.models import load_bench_model, parse_dtype
from cbverify.bench.timebox import PROGRESS_EVERY_S, ProgressFile, append_record
from cbverify.bench.timed import ENGINES, EngineOptions, run_engine
from cbverify.bench.workloads import WORKLOADS, LengthDist, Workload, kv_budget_tokens, make_requests, make_workload

CB_IMPL_BLOCK_SIZE = 16  # cb_impl's EngineConfig default block size
SLOW_FORWARD_ENV = "CBVERIFY_BENCH_SLOW_FORWARD"  # test hook: "ENGINE:N:SECONDS[,...]" (module docstring)


class CaseProgress:
    """What the case in flight has done, read every second by the progress thread (module docstring)."""

    def __init__(self, engine: str, n: int, requests: list, natural_eos: bool) -> None:
        self.engine, self.n, self.num_requests = engine, n, len(requests)
        self.lengths = None if natural_eos else sorted(r.sampling.max_new_tokens for r in requests)
        self.phase, self.begin, self.timed_begin = "warmup", time.perf_counter(), None
        self.forwards: ForwardStats | None = None
        self.finished, self.adapter = 0, None

    def timed(self, forwards: ForwardStats) -> None:
        self.phase, self.timed_begin, self.forwards, self.finished = "timed", time.perf_counter(), forwards, 0

    def count_finished(self, adapter) -> None:
        """Count finished requests where the engine hands them back one by one (see the module docstring)."""
        self.adapter = adapter
        engine = getattr(adapter, "engine", None)
        if self.engine == "cb_impl" and engine is not None:
            step = engine.step  # the adapter wraps this instance's step in turn and deletes its wrapper afterwards

            def counted():
                done = step()
                self.finished += len(done)
                return done

            engine.step = counted

    def snapshot(self) -> dict:
        now = time.perf_counter()
        out = {"n": self.n, "phase": self.phase, "elapsed_s": now - self.begin, "num_requests": self.num_requests}
        f = self.forwards
        if self.phase != "timed" or f is None:
            return out
        if self.engine == "hf-generate":  # every row one token per forward, until its length (generate() runs on)
            tokens = f.logit_rows if self.lengths is None else sum(min(n, f.steps) for n in self.lengths)
            done = None if self.lengths is None else sum(n <= f.steps for n in self.lengths)
        else:  # cb_impl samples a shared prompt's first tokens from one logit row: its own counter says how many
            tokens = self._generated() if self.engine == "cb_impl" else None
            if tokens is None:
                tokens = f.logit_rows if self.lengths is None else min(f.logit_rows, sum(self.lengths))
            done = self.finished if self.engine in ("cb_impl", "transformers-cb") else None
        return out | {"timed_s": now - self.timed_begin, "requests_done": done, "tokens_done": tokens,
                      "steps": f.steps, "forward_tokens": f.forward_tokens}  # fmt: skip

    def _generated(self) -> int | None:
        """cb_impl's tokens sampled so far (``LLMEngine.stats``: plain counters, read from the progress thread)."""
        try:
            return int(self.adapter.stats["num_generated_tokens"])
        except Exception:  # no adapter yet, or the counters changed under us: the logit rows instead
            return None


_CURRENT: list[CaseProgress] = []  # the case in flight (the transformers CB counter reads it)


@contextmanager
def counting_manager_results():
    """While the block runs, the transformers CB manager's ``get_result`` (wrapped in this process) counts each
    finished result it hands back for the case in flight."""
    from transformers.generation.continuous_batching import ContinuousBatchingManager as Manager

    inner = Manager.get_result

    def get_result(self, *args, **kwargs):
        result = inner(self, *args, **kwargs)
        if result is not None and _CURRENT and _CURRENT[-1].phase == "timed" and result.is_finished():
            _CURRENT[-1].finished += 1
        return result

    Manager.get_result = get_result
    try:
        yield
    finally:
        Manager.get_result = inner


def slow_forward_seconds(engine: str, n: int) -> float:
    """The test hook's sleep before each forward of this case (0 without the hook)."""
    for item in filter(None, os.environ.get(SLOW_FORWARD_ENV, "").split(",")):
        name, size, seconds = item.rsplit(":", 2)
        if name == engine and int(size) == n:
            return float(seconds)
    return 0.0


@contextmanager
def slowed(model, seconds: float):
    handle = model.register_forward_pre_hook(lambda *_: time.sleep(seconds))
    try:
        yield
    finally:
        handle.remove()


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


def run_case(model, vocab_size: int, workload: Workload, engine: str, args: argparse.Namespace,
             progress: CaseProgress | None = None) -> dict:  # fmt: skip
    n = workload.num_generations
    requests = make_requests(workload, vocab_size=vocab_size)
    progress = progress or CaseProgress(engine, n, requests, workload.natural_eos)
    budget = kv_budget_tokens(workload, requests, headroom=args.kv_headroom)
    opts = EngineOptions(device=args.device, num_blocks=-(-budget // CB_IMPL_BLOCK_SIZE),
                         max_batch_tokens=args.max_batch_tokens, time_forwards=args.time_forwards)  # fmt: skip
    warm = warmup_workload(workload)
    run_engine(engine, model, make_requests(warm, vocab_size=vocab_size), opts)
    baseline = measure.reset_peak(args.device)
    base_rss = measure.rss_mb()
    forwards = ForwardStats()
    progress.timed(forwards)
    slow = slow_forward_seconds(engine, n)
    with slowed(model, slow) if slow else nullcontext():
        run = run_engine(engine, model, requests, opts, forwards=forwards, on_adapter=progress.count_finished)
    memory = measure.peak_memory(args.device, baseline, base_rss)
    if "engine_peak_rss_mb" in run.extra:  # an engine in a process of its own: its process's peak, not ours
        memory = {"peak_memory_mb": run.extra["engine_peak_rss_mb"], "peak_memory_delta_mb": None,
                  "memory_kind": "peak RSS of the engine's own process"}  # fmt: skip
    if args.profile:
        progress.phase = "profile"
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
        "step_ms": 1e3 * run.wall_s / run.steps if run.steps else None,
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
    parser.add_argument("--round", type=int, default=0, help="the round of the matrix (written in each record)")
    parser.add_argument("--progress", default=None, help="file receiving progress lines (cbverify.bench.timebox)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_name = "tiny-llama-arith" if args.workload == "arith" else args.model  # arith prompts: its char vocab
    model, info = load_bench_model(model_name, device=args.device, dtype=parse_dtype(args.dtype, args.device))
    env = measure.environment(args.device)
    counting = args.engine == "transformers-cb" and args.progress
    with counting_manager_results() if counting else nullcontext():
        return _run_cases(model, info, env, args)


def _run_cases(model, info: dict, env: dict, args: argparse.Namespace) -> int:
    reports = ProgressFile(args.progress)
    status = 0
    for n in sorted(args.n):
        workload = make_workload(args.workload, n, device=args.device, temperature=args.temperature, seed=args.seed)
        requests = make_requests(workload, vocab_size=info["vocab_size"])
        _CURRENT[:] = [progress := CaseProgress(args.engine, n, requests, workload.natural_eos)]
        reports.write("start", n=n, pid=os.getpid())
        stop = reports.every(PROGRESS_EVERY_S, progress.snapshot)
        try:
            record = run_case(model, info["vocab_size"], workload, args.engine, args, progress) | {"status": "ok"}
        except Exception as err:  # recorded, reported, and turned into a failing exit code
            status = 1
            record = {"engine": args.engine, "workload": args.workload, "n": n, "status": "error",
                      "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}  # fmt: skip
        finally:
            stop()
        append_record(Path(args.out), record | {"round": args.round, "model": info, "env": env})
    return status


if __name__ == "__main__":
    sys.exit(main())
