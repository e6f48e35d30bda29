"""The GRPO-step benchmark's driver: every workload and path in a worker process of its own
(``python -m cbverify.bench.grpo_step``, the vLLM path with the ``vllm`` environment's python), the paths alternating
round by round, and the pooling of the workers' records into one row per (workload, path, N).

As the matrix (:mod:`cbverify.bench.suite`): each N's row lands in ``OUT/logs/grpo-<workload>-<path>-r<k>.jsonl`` as
it ends, each N is time-boxed (:mod:`cbverify.bench.timebox`; a cut N is recorded with the trainer steps it had
done), ``OUT/logs/grpo-plan.json`` holds the configuration, and the rows are always read back from the logs."""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from cbverify.bench import reasoning, timebox
from cbverify.bench.grpo_step import LOGGED_LENGTHS, MAX_COMPLETION, GrpoConfig
from cbverify.bench.timebox import Budget, Cut, TimeBoxes, append_record, cut_text, is_cut, status_of

PLAN = "grpo-plan.json"  # under OUT/logs: the GRPO step's configuration and time boxes
BUILD_RESERVE_S = 30.0  # the reasoning checkpoint (~8 s) is built only with at least this much of the budget left


def pool_rounds(rows: list[dict]) -> list[dict]:
    """One row per (workload, path, N) from every round's rows: step times without each round's warm-up, their median
    and spread, the generation share over the same steps, the largest peak memory, the completion lengths TRL logged
    at every step (warm-ups included: they describe the lengths, not the timing). A row without a workload is an
    arithmetic one (records written before the reasoning workload)."""

    def pool(group: list[dict]) -> dict:
        steps = [t for r in group for t in r["step_times_s"][1:]]
        gens = (
            [g for r in group for g in (r["generation_s"] or [])[1:]] if all(r["generation_s"] for r in group) else []
        )
        return {"workload": "arith"} | group[0] | {
            "rounds": len(group), "timed_steps": len(steps), "step_times_s": steps, "step_s": statistics.median(steps),
            "step_min_s": min(steps), "step_max_s": max(steps),
            "generation_share": sum(gens) / sum(steps) if gens else None, "generation_times_s": gens or None,
            "peak_memory_mb": max(r["peak_memory_mb"] for r in group),
            "completion_lengths": {k: [x for r in group for x in (r.get("completion_lengths") or {}).get(k) or []]
                                   for k in LOGGED_LENGTHS},
        }  # fmt: skip

    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row.get("workload", "arith"), row["path"], row["n"]), []).append(row)
    out = []
    for group in groups.values():  # an error in any round is the row's; rounds without a measurement are left out
        error = next((r for r in group if status_of(r) == "error"), None)
        measured = [r for r in group if status_of(r) == "ok"]
        cut = [r for r in group if is_cut(r)]
        if error is not None:
            out.append(error)
        elif measured:
            out.append(pool(measured) | ({"cut_rounds": [status_of(r) for r in cut]} if cut else {}))
        else:
            out.append(max(cut, key=lambda r: (r.get("steps_done") or 0, r.get("elapsed_s") or 0)))
    return out


def paired_speedups(base: list[float], other: list[float]) -> list[float] | None:
    """``base[i] / other[i]`` for each timed step: step ``i`` of every path trains on the same prompts (same data
    order, same round), so the ratio cancels what varies from step to step (the prompts, the completion lengths),
    which the ratio of the medians does not. ``None`` unless both paths timed the same number of steps."""
    if not base or not other or len(base) != len(other):
        return None
    return [b / o for b, o in zip(base, other, strict=True)]


def grpo_jobs(cfg: GrpoConfig) -> list[tuple[str, int, str, list[list[int]]]]:
    """``(workload, round, path, [ns of each worker process])`` in run order: the paths alternate round by round; a
    vLLM keeps its KV cache until its process ends and the next one sizes its own from what is left, so one process
    per N there (the other paths run N ascending in one process)."""
    return [(w, k, p, [[n] for n in cfg.ns] if p == "vllm" else [sorted(cfg.ns)]) for w in cfg.workloads
            for k in range(cfg.rounds) for p in (cfg.paths if k % 2 == 0 else cfg.paths[::-1])]  # fmt: skip


def grpo_size(cfg: GrpoConfig) -> tuple[int, int]:
    """``(cases, workers)`` the GRPO step plans."""
    jobs = grpo_jobs(cfg)
    return sum(len(ns) for *_, groups in jobs for ns in groups), sum(len(groups) for *_, groups in jobs)


def _cut_row(cut: Cut, base: dict, log_name: str, steps: int) -> dict:
    if cut.reason == "crashed":
        return base | {"status": "error", "error": f"the worker exited {cut.returncode} during this case after "
                       f"{cut.elapsed_s:.0f}s; see {log_name}"}  # fmt: skip
    if cut.reason == "skipped":
        return base | {"status": "skipped", "reason": "the time budget was spent before this case"}
    box = None if cut.box_s is None or cut.box_s == float("inf") else round(cut.box_s, 1)
    return base | {"status": "interrupted" if cut.reason == "interrupted" else "timeout", "timeout_s": box,
                   "elapsed_s": round(cut.elapsed_s, 1), "steps": steps,
                   "phase": "start" if cut.n is None else "steps",
                   "steps_done": cut.progress.get("steps_done", 0),
                   "step_times_s": cut.progress.get("step_times_s", [])}  # fmt: skip


def _label(row: dict) -> str:
    return f"GRPO step {row['workload']} / {row['path']} / N={row['n']} / round {row.get('round', 0) + 1}"


def _text(row: dict, seconds: float) -> str:
    if is_cut(row):
        return cut_text(row)
    if "error" in row:
        return "ERROR " + row["error"].splitlines()[0][:120]
    return f"{statistics.median(row['step_times_s'][1:] or row['step_times_s']):.2f} s/step, {seconds:.1f}s"


def prepare(cfg: GrpoConfig, out_dir: Path, boxes: TimeBoxes) -> None:
    """Clear an earlier run's GRPO-step logs and write this run's plan (what a rebuilt report expects)."""
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for f in log_dir.glob("grpo-*"):
        f.unlink()
    config = {k: getattr(cfg, k) for k in cfg.__slots__}
    (log_dir / PLAN).write_text(json.dumps({"config": config, "time_boxes": asdict(boxes)}) + "\n")


def run_grpo(cfg: GrpoConfig, out_dir: Path, *, from_logs: bool = False, budget: Budget | None = None,
             after_worker=None, prepared: bool = False) -> dict:  # fmt: skip
    """Every workload, every path in a fresh process, each N time-boxed (``budget``: the device's defaults when
    None), a line per N on stderr, ``after_worker()`` after each process; returns ``{"setup": {workload: text},
    "config", "rows": [...]}`` read back from the logs. The reasoning workload's checkpoint is built first, into
    ``out_dir/reasoning-model``. With ``from_logs`` nothing runs: the rows an earlier run left are read."""
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if not from_logs:
        _run(cfg, out_dir, log_dir, budget, after_worker, prepared)
    return read_grpo(cfg, out_dir)


def read_grpo(cfg: GrpoConfig, out_dir: Path) -> dict:
    """The GRPO part of the report from the logs; with a plan its configuration is the run's and its missing rows
    are named."""
    log_dir = out_dir / "logs"
    plan = json.loads((log_dir / PLAN).read_text()) if (log_dir / PLAN).exists() else None
    if plan is not None:
        cfg = GrpoConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in plan["config"].items()})
    config = {k: getattr(cfg, k) for k in cfg.__slots__}
    rows = [json.loads(line) for f in sorted(log_dir.glob("grpo-*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]  # fmt: skip
    built = log_dir / "grpo-reasoning-model.json"
    model = json.loads(built.read_text()) if built.exists() else None
    rows = pool_rounds(rows)
    if plan is not None:
        seen = {(r.get("workload", "arith"), r["path"], r["n"]) for r in rows}
        rows += [{"workload": w, "path": p, "n": n, "status": "missing"} for w in cfg.workloads for p in cfg.paths
                 for n in cfg.ns if (w, p, n) not in seen]  # fmt: skip
    return {"setup": _setup(cfg, model), "config": config, "rows": rows}


def _run(cfg: GrpoConfig, out_dir: Path, log_dir: Path, budget: Budget | None, after_worker, prepared: bool) -> None:
    if budget is None:
        cases, workers = grpo_size(cfg)
        budget = Budget(TimeBoxes.for_device(cfg.device), cases=cases, workers=workers)
    if not prepared:
        prepare(cfg, out_dir, budget.boxes)
    model = None
    if "reasoning" in cfg.workloads and budget.left() >= BUILD_RESERVE_S:
        model = reasoning.write_checkpoint(out_dir / "reasoning-model") | {"path": str(out_dir / "reasoning-model")}
        (log_dir / "grpo-reasoning-model.json").write_text(json.dumps(model))
    for workload, k, path, groups in grpo_jobs(cfg):
        stem = f"grpo-{workload}-{path}-r{k}"
        out, log, progress = log_dir / f"{stem}.jsonl", log_dir / f"{stem}.log", log_dir / f"{stem}.progress"
        python, env = _worker(path)
        for ns in groups:
            pending = list(ns)

            def on_record(row: dict, seconds: float) -> None:
                if row.get("n") in pending:  # noqa: B023
                    pending.remove(row["n"])  # noqa: B023
                    budget.case_done(_label(row), _text(row, seconds))

            def on_cut(cut: Cut) -> None:
                if cut.reason in ("skipped", "start timeout"):  # no time left or no worker: every N left
                    cut_ns = list(pending)  # noqa: B023
                else:
                    cut_ns = [cut.n] if cut.n in pending else []  # noqa: B023
                for n in cut_ns:
                    base = {"workload": workload, "path": path, "n": n, "round": k}  # noqa: B023
                    row = _cut_row(cut, base, log.name, cfg.steps)  # noqa: B023
                    append_record(out, row)  # noqa: B023
                    on_record(row, cut.elapsed_s)

            while pending:
                if workload == "reasoning" and model is None:  # no time was left to build its checkpoint
                    budget.spawning()
                    on_cut(Cut(None, "skipped", None, 0.0))
                    break
                name = model["path"] if workload == "reasoning" else cfg.model
                cmd = [python, "-m", "cbverify.bench.grpo_step", "--workload", workload, "--path", path, "--n",
                       *map(str, pending), "--device", cfg.device, "--steps", str(cfg.steps), "--num-prompts",
                       str(cfg.num_prompts), "--model", name, "--threads", str(cfg.threads), "--out", str(out),
                       "--round", str(k), "--progress", str(progress)]  # fmt: skip
                cut = timebox.supervise(cmd, env=env, log=log, records=out, progress=progress, budget=budget,
                                        on_record=on_record, on_cut=on_cut)  # fmt: skip
                if cut is None and pending:
                    for n in list(pending):
                        row = {"workload": workload, "path": path, "n": n, "round": k, "status": "error",
                               "error": f"no record from the worker; see {log.name}"}  # fmt: skip
                        append_record(out, row)
                        on_record(row, 0.0)
                if cut is not None and cut.reason in ("skipped", "start timeout"):
                    break
                if pending:  # a fresh worker for the N after the cut one
                    budget.restart()
            if after_worker is not None:
                after_worker()


def _worker(path: str) -> tuple[str, dict]:
    """The python that runs a path's worker and its environment: ours, or the ``vllm`` environment's (our packages
    only on its path) for ``vllm``, whose absence is an error naming the command that builds it."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    if path != "vllm":
        return sys.executable, env | {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))
        }
    from cbverify import data
    from cbverify.engines import envs

    if (why := envs.problem("vllm")) is not None:
        raise ValueError(f"the vllm GRPO path needs the vllm environment: {why}")
    return str(envs.python("vllm")), env | {"PYTHONPATH": str(data.import_path())}


def _setup(cfg: GrpoConfig, model: dict | None) -> dict[str, str]:
    """Per workload, one line saying what was run and how the numbers were pooled."""
    pooled = (f"{cfg.num_prompts} prompts x N per step; {cfg.rounds} rounds of {cfg.steps} steps per path, paths "
              f"alternating, the first step of each round a warm-up: median and (min, max) of "
              f"{cfg.rounds * (cfg.steps - 1)} steps; device {cfg.device}")  # fmt: skip
    arith = f"TRL GRPOTrainer on {cfg.model}, arithmetic task, max_completion_length {MAX_COMPLETION['arith']}; "
    out = {"arith": arith + pooled}
    if model is not None:
        e = model["expected"]
        out["reasoning"] = (
            f"TRL GRPOTrainer on the reasoning-length checkpoint (cbverify.bench.reasoning: random Llama h256 L4, "
            f"{model['parameters'] / 1e6:.1f}M parameters, vocab {model['vocab_size']}), EOS probability "
            f"{model['hazard']:.4f} per token: geometric completion lengths, median {e['median']}, mean "
            f"{e['mean']:.0f}, {e['cut_share']:.1%} cut at max_completion_length {MAX_COMPLETION['reasoning']}; "
            f"reward: share of vowels; " + pooled
        )
    return {w: out[w] for w in cfg.workloads if w in out}
