"""Run the engine matrix (each engine x workload in its own ``cbverify.bench.worker`` process), check every output,
compute ratios against peers of the same run, and evaluate the CPU targets.

Rounds: the matrix runs ``rounds`` times, the job order reversed every other round, so that a drift of the machine
reaches every engine alike; each case is then its fastest round (interference on a shared CPU only ever adds time:
the least disturbed run is the best estimate of each engine's own cost, as ``timeit`` takes the minimum), its min-max
throughput kept beside it, so a ratio is read against the spread of the runs it came from.

Checks after timing (a failed check is reported in every output file and makes ``cbverify bench`` exit 1):
count of completions, per-request lengths (forced workloads: exactly ``L_i``; natural EOS: <= cap, ``stop`` iff the
last token is EOS), finish reasons, and with ``temperature == 0`` token equality with ``cb_impl``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from cbverify.bench.measure import pool_groups
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


def worker_command(config: SuiteConfig, engine: str, workload: str, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "cbverify.bench.worker", "--engine", engine, "--workload", workload,
           "--n", *map(str, config.ns), "--device", config.device, "--model", config.model,
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
    return cmd


def run_matrix(config: SuiteConfig, out_dir: Path) -> list[dict]:
    """Every (workload, engine) in a fresh worker process, ``rounds`` times (the order reversed every other round),
    with a progress bar; returns every round's case records (``round`` set on each)."""
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for f in [*log_dir.glob("*.jsonl"), *log_dir.glob("*.log")]:  # an earlier run's records would be read with ours
        if not f.name.startswith("grpo-"):
            f.unlink()
    records: list[dict] = []
    jobs = [(w, e) for w in config.workloads for e in config.engines]
    jobs = [(k, w, e) for k in range(config.rounds) for w, e in (jobs if k % 2 == 0 else jobs[::-1])]
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")])),
    }
    for k, workload, engine in (bar := tqdm(jobs, desc="bench", unit="job")):
        bar.set_postfix_str(f"round {k + 1} / {workload} / {engine} / N={','.join(map(str, config.ns))}")
        out = log_dir / f"{workload}-{engine}-r{k}.jsonl"
        with open(log_dir / f"{workload}-{engine}-r{k}.log", "w") as log:
            proc = subprocess.run(worker_command(config, engine, workload, out), stdout=log, stderr=subprocess.STDOUT,
                                  env=env, check=False)  # fmt: skip
        got = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        if not got:
            got = [
                {
                    "engine": engine,
                    "workload": workload,
                    "n": n,
                    "error": f"worker exited {proc.returncode} without results; see {log.name}",
                }
                for n in config.ns
            ]
        records += [r | {"round": k} for r in got]
    return records


def _fastest_round(group: list[dict]) -> dict:
    runs = sorted(group, key=lambda r: r["tokens_per_s"])
    return runs[-1] | {
        "rounds": len(runs), "tokens_per_s_min": runs[0]["tokens_per_s"], "tokens_per_s_max": runs[-1]["tokens_per_s"],
        "check_problems": list(dict.fromkeys(p for r in runs for p in r.get("check_problems", []))),
    }  # fmt: skip


def pool_matrix_rounds(records: list[dict]) -> list[dict]:
    """One record per (workload, N, engine): the round of highest throughput, with ``rounds``, the min-max throughput
    over the rounds and every round's output problems; a case that errored in any round is that round's error."""
    return pool_groups(records, lambda r: (r["workload"], r["n"], r["engine"]), _fastest_round)


def check_case(record: dict, config: SuiteConfig) -> list[str]:
    """Problems with one case's outputs (empty when it is sound)."""
    if "error" in record:
        return [f"engine error: {record['error']}"]
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
    by_key = {(r["workload"], r["n"], r["engine"]): r for r in records if "error" not in r}
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
    by_key = {(r["workload"], r["n"], r["engine"]): r for r in records if "error" not in r}
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
        round_match = re.search(r"-r(\d+)\.jsonl$", f.name)  # the worker's records do not name their round
        for line in f.read_text().splitlines():
            record = json.loads(line)
            record["engine"] = LEGACY_ENGINE_NAMES.get(record["engine"], record["engine"])
            record["round"] = int(round_match.group(1)) if round_match else 0
            records[(record["workload"], record["n"], record["engine"], record["round"])] = record
    if not records:
        raise FileNotFoundError(f"no worker results under {out_dir / 'logs'}")
    return list(records.values())


def run_suite(config: SuiteConfig, out_dir: Path, *, from_logs: bool = False) -> dict:
    """Run the matrix (or, with ``from_logs``, re-read an earlier run's worker records) and evaluate it."""
    records = read_logs(out_dir) if from_logs else run_matrix(config, out_dir)
    for record in records:
        record["check_problems"] = check_case(record, config)
    records = pool_matrix_rounds(records)
    token_agreement(records)
    return {
        "config": asdict(config),
        "cases": records,
        "ratios": ratios(records),
        "targets": evaluate_targets(records),
    }
