"""Run the engine matrix (each engine x workload in its own ``cbverify.bench.worker`` process), check every output,
compute ratios against peers of the same run, and evaluate the CPU targets.

Rounds: the matrix runs ``rounds`` times, the job order reversed every other round, so that a drift of the machine
reaches every engine alike; each case is then its fastest round (interference on a shared CPU only ever adds time:
the least disturbed run is the best estimate of each engine's own cost, as ``timeit`` takes the minimum), its min-max
throughput kept beside it, so a ratio is read against the spread of the runs it came from.

Checks after timing (a failed check is reported in every output file and makes ``cbverify bench`` exit 1):
count of completions, per-request lengths (forced workloads: exactly ``L_i``; natural EOS: <= cap, ``stop`` iff the
last token is EOS), finish reasons, and with ``temperature == 0`` token equality with ``cb_impl``.

Records: each case's record is appended to ``OUT/logs/<workload>-<engine>-r<round>.jsonl`` the moment the case ends
(by its worker; by this process for a case it cut: ``timeout``, ``interrupted``, ``skipped``, or an ``error`` when the
worker died in it). ``OUT/logs/plan-matrix.json`` says what the run set out to do, so the report rebuilt from the logs
at any time (:func:`run_suite` with ``from_logs``) is the run's own and names the cases that have no record yet
(``missing``). Time boxes: :mod:`cbverify.bench.timebox`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from cbverify.bench import timebox
from cbverify.bench.timebox import Budget, Cut, TimeBoxes, append_record, cut_text, is_cut, status_of
from cbverify.bench.timed import DEFAULT_ENGINES, ENGINES
from cbverify.bench.workloads import WORKLOADS, make_requests, make_workload

NS = (8, 32, 64, 128)
# (workload, N, engine, peer, metric, op, threshold): the CPU targets. cb_impl at least as fast as generate() on every
# workload and N, and with no more engine overhead per step from N = 32; on gsm8k-like N=64 well ahead of both peers
# with at most 40% of generate()'s KV cache.
TARGETS = (
    *((w, n, "cb_impl", "hf-generate", "tokens_per_s", ">=", 1.0) for w in WORKLOADS for n in NS),
    *((w, n, "cb_impl", "hf-generate", "overhead_per_step_ms", "<=", 1.0) for w in WORKLOADS for n in NS if n >= 32),
    ("gsm8k-like", 64, "cb_impl", "hf-generate", "tokens_per_s", ">=", 3.0),
    ("gsm8k-like", 64, "cb_impl", "transformers-cb", "tokens_per_s", ">=", 4.0),
    ("gsm8k-like", 64, "cb_impl", "hf-generate", "kv_reserved_bytes", "<=", 0.4),
    *((w, n, "cb_impl", "vllm", "tokens_per_s", ">=", 1.0) for w in WORKLOADS for n in NS),  # when vLLM is run
)
# Engine names of records written before the bench used the registry's names (read back by --from-logs).
LEGACY_ENGINE_NAMES = {"generate": "hf-generate"}
PLAN = "plan-matrix.json"  # under OUT/logs: the run's configuration and time boxes


@dataclass(frozen=True, slots=True)
class SuiteConfig:
    device: str = "cpu"
    workloads: tuple[str, ...] = WORKLOADS
    ns: tuple[int, ...] = NS
    engines: tuple[str, ...] = DEFAULT_ENGINES
    model: str = "random"
    dtype: str | None = None
    threads: int = 2
    kv_headroom: float = 1.25
    max_batch_tokens: int = 512
    temperature: float = 1.0
    seed: int = 0
    time_forwards: bool = True
    profile: bool = False
    rounds: int = 3

    def __post_init__(self) -> None:
        for name, values, allowed in (("workload", self.workloads, WORKLOADS), ("engine", self.engines, ENGINES)):
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ValueError(f"{name}s must be a non-empty subset of {', '.join(allowed)}, got {list(values)}")
        if not self.ns or min(self.ns) < 1:
            raise ValueError(f"ns must be non-empty positive integers, got {list(self.ns)}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


def worker_command(config: SuiteConfig, engine: str, workload: str, out: Path, *, ns: list[int] | None = None,
                   round_: int = 0, progress: Path | None = None) -> list[str]:  # fmt: skip
    cmd = [sys.executable, "-m", "cbverify.bench.worker", "--engine", engine, "--workload", workload,
           "--n", *map(str, config.ns if ns is None else ns), "--device", config.device, "--model", config.model,
           "--threads", str(config.threads), "--kv-headroom", str(config.kv_headroom),
           "--max-batch-tokens", str(config.max_batch_tokens), "--temperature", str(config.temperature),
           "--seed", str(config.seed), "--out", str(out),
           "--time-forwards" if config.time_forwards else "--no-time-forwards"]  # fmt: skip
    if config.dtype:
        cmd += ["--dtype", config.dtype]
    if config.temperature == 0:
        cmd.append("--keep-tokens")
    if config.profile:
        cmd.append("--profile")
    if round_:
        cmd += ["--round", str(round_)]
    if progress is not None:
        cmd += ["--progress", str(progress)]
    return cmd


def matrix_jobs(config: SuiteConfig) -> list[tuple[int, str, str]]:
    """``(round, workload, engine)`` in run order: one worker each, the order reversed every other round."""
    jobs = [(w, e) for w in config.workloads for e in config.engines]
    return [(k, w, e) for k in range(config.rounds) for w, e in (jobs if k % 2 == 0 else jobs[::-1])]


def matrix_size(config: SuiteConfig) -> tuple[int, int]:
    """``(cases, workers)`` the matrix plans."""
    return len(matrix_jobs(config)) * len(config.ns), len(matrix_jobs(config))


def worker_env() -> dict:
    return os.environ | {
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")])),
    }


def cut_record(cut: Cut, base: dict, log_name: str) -> dict:
    """The record this process writes for a case its worker did not finish (``base``: the case's keys), with the
    progress the worker last reported for it."""
    progress = {k: v for k, v in cut.progress.items() if k not in ("event", "t", "n")}
    box = None if cut.box_s is None or cut.box_s == float("inf") else round(cut.box_s, 1)
    if cut.reason == "crashed":
        return base | {"status": "error", "error": f"the worker exited {cut.returncode} during this case after "
                       f"{cut.elapsed_s:.0f}s; see {log_name}", "progress": progress}  # fmt: skip
    if cut.reason == "skipped":
        return base | {"status": "skipped", "reason": "the time budget was spent before this case"}
    status = "interrupted" if cut.reason == "interrupted" else "timeout"
    record = base | {"status": status, "timeout_s": box, "elapsed_s": round(cut.elapsed_s, 1),
                     "phase": progress.get("phase", "start" if cut.n is None else "warmup"),
                     "progress": progress}  # fmt: skip
    tokens, timed = progress.get("tokens_done"), progress.get("timed_s")
    speed = tokens / timed if tokens and timed else None
    return record | {"requests_done": progress.get("requests_done"), "num_requests": progress.get("num_requests"),
                     "tokens_done": tokens, "tokens_per_s_so_far": speed}  # fmt: skip


def _case_label(record: dict) -> str:
    return f"{record['workload']} / {record['engine']} / N={record['n']} / round {record.get('round', 0) + 1}"


def _done_text(record: dict, seconds: float) -> str:
    if is_cut(record):
        return cut_text(record)
    if "error" in record:
        return "ERROR " + record["error"].splitlines()[0][:120]
    return f"{record['tokens_per_s']:.0f} tok/s, {seconds:.1f}s"


def clear_logs(log_dir: Path) -> None:
    """Remove an earlier run's matrix records, logs, progress and plan: they would be read with this run's (the GRPO
    step's, ``grpo-*``, are its own)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for f in log_dir.iterdir():
        if f.is_file() and not f.name.startswith("grpo-") and (f.suffix in (".jsonl", ".log", ".progress")
                                                               or f.name == PLAN):  # fmt: skip
            f.unlink()


def prepare(config: SuiteConfig, out_dir: Path, boxes: TimeBoxes) -> None:
    """Clear an earlier run's matrix logs and write this run's plan (what a rebuilt report expects)."""
    log_dir = out_dir / "logs"
    clear_logs(log_dir)
    (log_dir / PLAN).write_text(json.dumps({"config": asdict(config), "time_boxes": asdict(boxes)}) + "\n")


def run_matrix(config: SuiteConfig, out_dir: Path, budget: Budget | None = None, after_worker=None, *,
               prepared: bool = False) -> None:  # fmt: skip
    """Every (workload, engine) in a fresh worker process, ``rounds`` times (the order reversed every other round),
    each case time-boxed (``budget``: the device's defaults when None); every case's record lands in the logs as it
    ends, ``after_worker()`` runs after each worker process (the report is rebuilt there), a line per case on
    stderr. A worker whose case was cut is replaced by a fresh one for the cases after it. ``prepared``: the caller
    has already called :func:`prepare`."""
    log_dir = out_dir / "logs"
    if budget is None:
        cases, workers = matrix_size(config)
        budget = Budget(TimeBoxes.for_device(config.device), cases=cases, workers=workers)
    if not prepared:
        prepare(config, out_dir, budget.boxes)
    env = worker_env()
    for k, workload, engine in matrix_jobs(config):
        stem = f"{workload}-{engine}-r{k}"
        out, log = log_dir / f"{stem}.jsonl", log_dir / f"{stem}.log"
        pending = sorted(config.ns)

        def base(n: int) -> dict:
            return {"engine": engine, "workload": workload, "n": n, "round": k}  # noqa: B023

        def on_record(record: dict, seconds: float) -> None:
            if record.get("n") in pending:  # noqa: B023
                pending.remove(record["n"])  # noqa: B023
                budget.case_done(_case_label(record), _done_text(record, seconds))

        def on_cut(cut: Cut) -> None:  # the case in flight; with no time left or no worker, every case left
            if cut.reason in ("skipped", "start timeout"):
                cut_ns = list(pending)  # noqa: B023
            else:
                cut_ns = [cut.n] if cut.n in pending else []  # noqa: B023
            for n in cut_ns:
                on_record(append_and_return(out, cut_record(cut, base(n), log.name)), cut.elapsed_s)  # noqa: B023

        while pending:
            cmd = worker_command(config, engine, workload, out, ns=pending, round_=k,
                                 progress=log_dir / f"{stem}.progress")  # fmt: skip
            cut = timebox.supervise(cmd, env=env, log=log, records=out, progress=log_dir / f"{stem}.progress",
                                    budget=budget, on_record=on_record, on_cut=on_cut)  # fmt: skip
            if cut is None and pending:  # exited between cases without recording the rest
                for n in list(pending):
                    error = f"the worker exited without a record of this case; see {log.name}"
                    on_record(append_and_return(out, base(n) | {"status": "error", "error": error}), 0.0)
            if cut is not None and cut.reason in ("skipped", "start timeout"):
                break
            if pending:  # a fresh worker for the cases after the cut one
                budget.restart()
        if after_worker is not None:
            after_worker()


def append_and_return(path: Path, record: dict) -> dict:
    append_record(path, record)
    return record


def _fastest_round(group: list[dict]) -> dict:
    runs = sorted(group, key=lambda r: r["tokens_per_s"])
    return runs[-1] | {
        "rounds": len(runs), "tokens_per_s_min": runs[0]["tokens_per_s"], "tokens_per_s_max": runs[-1]["tokens_per_s"],
        "check_problems": list(dict.fromkeys(p for r in runs for p in r.get("check_problems", []))),
    }  # fmt: skip


def pool_matrix_rounds(records: list[dict]) -> list[dict]:
    """One record per (workload, N, engine): the round of highest throughput, with ``rounds``, the min-max throughput
    over the rounds and every round's output problems; a case that errored in any round is that round's error. Rounds
    without a measurement (timed out, interrupted, skipped) are left out and counted (``cut_rounds``); a case with no
    measured round is its cut record that got furthest."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["workload"], r["n"], r["engine"]), []).append(r)
    out = []
    for group in groups.values():
        error = next((r for r in group if status_of(r) == "error"), None)
        measured = [r for r in group if status_of(r) == "ok"]
        cut = [r for r in group if is_cut(r)]
        if error is not None:
            out.append(error)
        elif measured:
            pooled = _fastest_round(measured)
            out.append(pooled | ({"cut_rounds": [status_of(r) for r in cut]} if cut else {}))
        else:
            out.append(max(cut, key=lambda r: (r.get("tokens_done") or 0, r.get("elapsed_s") or 0)))
    return out


def measured(record: dict) -> bool:
    """A record with a measurement (not an error, not cut)."""
    return status_of(record) == "ok"


def missing_cases(records: list[dict], config: SuiteConfig) -> list[dict]:
    """A ``missing`` record for every planned (workload, N, engine) no round has a record of."""
    seen = {(r["workload"], r["n"], r["engine"]) for r in records}
    return [{"engine": e, "workload": w, "n": n, "status": "missing"} for w in config.workloads for n in config.ns
            for e in config.engines if (w, n, e) not in seen]  # fmt: skip


def check_case(record: dict, config: SuiteConfig) -> list[str]:
    """Problems with one case's outputs (empty when it is sound, or when it has none: timed out, skipped...)."""
    if "error" in record:
        return [f"engine error: {record['error']}"]
    if is_cut(record):
        return []
    workload = make_workload(record["workload"], record["n"], device=config.device, temperature=config.temperature,
                             seed=config.seed)  # fmt: skip
    requests = make_requests(workload, vocab_size=record["model"]["vocab_size"])
    lengths, reasons = record["completion_lengths"], record["finish_reasons"]
    if len(lengths) != len(requests) or len(reasons) != len(requests):
        return [f"{len(lengths)} completions for {len(requests)} requests"]
    problems = []
    for r, n, reason in zip(requests, lengths, reasons, strict=True):
        if workload.natural_eos:
            if n > r.sampling.max_new_tokens or reason not in ("stop", "length"):
                problems.append(f"{r.request_id}: length {n} / reason {reason!r} breaks the contract")
            elif reason == "length" and n != r.sampling.max_new_tokens:
                problems.append(f"{r.request_id}: finish 'length' at {n} < cap {r.sampling.max_new_tokens}")
        elif n != r.sampling.max_new_tokens or reason != "length":
            problems.append(
                f"{r.request_id}: length {n} / {reason!r}, expected {r.sampling.max_new_tokens} / 'length'"
            )
    return problems[:5] + ([f"... {len(problems) - 5} more"] if len(problems) > 5 else [])


def token_agreement(records: list[dict]) -> None:
    """With greedy decoding, the share of requests whose tokens equal cb_impl's (stored on each record)."""
    ours = {(r["workload"], r["n"]): r for r in records if r["engine"] == "cb_impl" and r.get("completions")}
    for record in records:
        peer = ours.get((record["workload"], record["n"]))
        if peer is not None and record.get("completions") and record is not peer:
            same = [a == b for a, b in zip(record["completions"], peer["completions"], strict=True)]
            record["tokens_equal_to_cb_impl"] = sum(same) / len(same)


def ratios(records: list[dict]) -> list[dict]:
    """Per (workload, N, engine): throughput and memory as multiples of each peer's in the same run."""
    by_key = {(r["workload"], r["n"], r["engine"]): r for r in records if measured(r)}
    rows = []
    for (workload, n, engine), r in by_key.items():
        row = {"workload": workload, "n": n, "engine": engine}
        for peer in ENGINES:
            p = by_key.get((workload, n, peer))
            if p is None or peer == engine:
                continue
            row[f"throughput_vs_{peer}"] = r["tokens_per_s"] / p["tokens_per_s"]
            if r["kv_reserved_bytes"] and p["kv_reserved_bytes"]:
                row[f"kv_vs_{peer}"] = r["kv_reserved_bytes"] / p["kv_reserved_bytes"]
            row[f"peak_memory_delta_mb_vs_{peer}"] = r["peak_memory_mb"] - p["peak_memory_mb"]
        rows.append(row)
    return sorted(rows, key=lambda x: (x["workload"], x["n"], ENGINES.index(x["engine"])))


def evaluate_targets(records: list[dict]) -> list[dict]:
    by_key = {(r["workload"], r["n"], r["engine"]): r for r in records if measured(r)}
    out = []
    engines = {r["engine"] for r in records}
    for workload, n, engine, peer, metric, op, threshold in TARGETS:
        if peer == "vllm" and peer not in engines:  # vLLM is opt-in: no run of it, no target against it
            continue
        a, b = by_key.get((workload, n, engine)), by_key.get((workload, n, peer))
        value = a[metric] / b[metric] if a and b and a.get(metric) and b.get(metric) else None
        met = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
        out.append({"target": f"{workload} N={n}: {engine} {metric} / {peer} {op} {threshold}", "value": value,
                    "met": met})  # fmt: skip
    return out


def read_logs(out_dir: Path) -> list[dict]:
    """Every case record the workers of an earlier (possibly interrupted) run left in ``out_dir/logs``, one per round
    (files ``<workload>-<engine>-r<k>.jsonl``; a file without a round is round 0); records named with a legacy engine
    name (``generate``) are renamed to the registry's (``hf-generate``)."""
    files = sorted((out_dir / "logs").glob("*.jsonl"))
    files = [f for f in files if not f.name.startswith("grpo-")]
    records: dict[tuple, dict] = {}  # a newer file's record of the same case replaces an older-named one's
    for f in files:
        round_match = re.search(r"-r(\d+)\.jsonl$", f.name)  # records before rounds were written: the file's
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            record["engine"] = LEGACY_ENGINE_NAMES.get(record["engine"], record["engine"])
            record["round"] = int(round_match.group(1)) if round_match else record.get("round", 0)
            records[(record["workload"], record["n"], record["engine"], record["round"])] = record
    if not records and not (out_dir / "logs" / PLAN).exists():
        raise FileNotFoundError(f"no worker results under {out_dir / 'logs'}")
    return list(records.values())


def read_plan(out_dir: Path) -> dict | None:
    """The plan an earlier run wrote (``config``, ``time_boxes``), None for runs before plans."""
    path = out_dir / "logs" / PLAN
    return json.loads(path.read_text()) if path.exists() else None


def config_from_plan(plan: dict) -> SuiteConfig:
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in plan["config"].items()}
    return SuiteConfig(**{k: v for k, v in fields.items() if k in SuiteConfig.__dataclass_fields__})


def run_suite(config: SuiteConfig, out_dir: Path, *, from_logs: bool = False, budget: Budget | None = None,
              after_worker=None) -> dict:  # fmt: skip
    """Run the matrix (or, with ``from_logs``, not) and evaluate the records under ``out_dir/logs``: the report of a
    run is the report rebuilt from its logs. With a plan in the logs its configuration is the run's (``config`` is
    then only the fallback for runs before plans), its time boxes are reported and its missing cases named."""
    if not from_logs:
        run_matrix(config, out_dir, budget, after_worker)
    return evaluate(read_logs(out_dir), config, read_plan(out_dir))


def evaluate(records: list[dict], config: SuiteConfig, plan: dict | None = None) -> dict:
    """The matrix part of the report from every round's records."""
    if plan is not None:
        config = config_from_plan(plan)
    for record in records:
        record["check_problems"] = check_case(record, config)
    records = pool_matrix_rounds(records)
    if plan is not None:
        records += missing_cases(records, config)
    token_agreement(records)
    result = {
        "config": asdict(config),
        "cases": records,
        "ratios": ratios(records),
        "targets": evaluate_targets(records),
    }
    if plan is not None and plan.get("time_boxes"):
        result["time_boxes"] = plan["time_boxes"]
    return result
