"""The GRPO-step benchmark's driver: every workload and path in a worker process of its own
(``python -m cbverify.bench.grpo_step``, the vLLM path with the ``vllm`` environment's python), the paths alternating
round by round, and the pooling of the workers' records into one row per (workload, path, N)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from cbverify.bench import measure, reasoning
from cbverify.bench.grpo_step import LOGGED_LENGTHS, MAX_COMPLETION, GrpoConfig


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

    return measure.pool_groups(rows, lambda r: (r.get("workload", "arith"), r["path"], r["n"]), pool)


def paired_speedups(base: list[float], other: list[float]) -> list[float] | None:
    """``base[i] / other[i]`` for each timed step: step ``i`` of every path trains on the same prompts (same data
    order, same round), so the ratio cancels what varies from step to step (the prompts, the completion lengths),
    which the ratio of the medians does not. ``None`` unless both paths timed the same number of steps."""
    if not base or not other or len(base) != len(other):
        return None
    return [b / o for b, o in zip(base, other, strict=True)]


def run_grpo(cfg: GrpoConfig, out_dir: Path, *, from_logs: bool = False) -> dict:
    """Every workload, every path in a fresh process (progress bar); returns ``{"setup": {workload: text}, "config",
    "rows": [...]}``. The reasoning workload's checkpoint is built first, into ``out_dir/reasoning-model``. With
    ``from_logs`` the rows an earlier run's workers left in ``out_dir/logs`` are re-read instead."""
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    built = log_dir / "grpo-reasoning-model.json"
    config = {k: getattr(cfg, k) for k in cfg.__slots__}
    if from_logs:
        rows = [json.loads(line) for f in sorted(log_dir.glob("grpo-*.jsonl")) for line in f.read_text().splitlines()]
        model = json.loads(built.read_text()) if built.exists() else None
        return {"setup": _setup(cfg, model), "config": config, "rows": pool_rounds(rows)}
    for f in log_dir.glob("grpo-*"):
        f.unlink()
    model = None
    if "reasoning" in cfg.workloads:
        model = reasoning.write_checkpoint(out_dir / "reasoning-model") | {"path": str(out_dir / "reasoning-model")}
        built.write_text(json.dumps(model))
    order = [(w, k, p) for w in cfg.workloads for k in range(cfg.rounds)
             for p in (cfg.paths if k % 2 == 0 else cfg.paths[::-1])]  # fmt: skip
    rows: list[dict] = []
    for workload, k, path in tqdm(order, desc="grpo-step", unit="run"):
        out, log = log_dir / f"grpo-{workload}-{path}-r{k}.jsonl", log_dir / f"grpo-{workload}-{path}-r{k}.log"
        name = model["path"] if workload == "reasoning" else cfg.model
        python, env = _worker(path)
        # a vLLM keeps its KV cache until its process ends and the next one sizes its own from what is left: one
        # process per N there (the other paths run N ascending in one process)
        with open(log, "w") as stream:
            for ns in [[n] for n in cfg.ns] if path == "vllm" else [list(cfg.ns)]:
                cmd = [python, "-m", "cbverify.bench.grpo_step", "--workload", workload, "--path", path, "--n",
                       *map(str, ns), "--device", cfg.device, "--steps", str(cfg.steps), "--num-prompts",
                       str(cfg.num_prompts), "--model", name, "--threads", str(cfg.threads),
                       "--out", str(out)]  # fmt: skip
                stream.flush()
                subprocess.run(cmd, stdout=stream, stderr=subprocess.STDOUT, env=env, check=False)
        got = {r["n"]: r for r in (json.loads(line) for line in out.read_text().splitlines())} if out.exists() else {}
        rows += [got.get(n) or {"workload": workload, "path": path, "n": n,
                                "error": f"no record from the worker; see {log.name}"} for n in cfg.ns]  # fmt: skip
    return {"setup": _setup(cfg, model), "config": config, "rows": pool_rounds(rows)}


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
