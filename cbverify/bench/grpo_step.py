"""TRL ``GRPOTrainer`` steps with each generation path, in the shape of TRL PR #5765's table (step time, speedup and
peak-memory delta versus ``generate()``):
``python -m cbverify.bench.grpo_step --path generate --n 8 32 64 --out f.jsonl``.

Paths: ``generate`` (TRL's default), ``transformers-cb`` (``use_transformers_continuous_batching=True`` with TRL's
``max_memory_percent=0.5``; on CPU also explicit ``num_blocks`` / ``max_batch_tokens``), ``cb_impl``
(``rollout_func=cb_impl.trl.make_rollout_func(...)``). The task is the arithmetic one (``reference.tasks``) on the
bundled ``tiny-llama-arith`` (natural EOS, exact-answer reward), ``num_prompts`` prompts x N generations per step.
Each path runs in its own process (N ascending, so the lifetime peak RSS after case N is case N's), ``rounds``
times, the paths alternating (A B C, then C B A, ...) so that a drift of the machine reaches every path alike. In each
process the first of ``steps`` is a warm-up; the median and the spread (min, max) are over the other steps of every
round pooled. The generation share is the time spent in the trainer's ``_generate`` over the step time (the same
steps), where the TRL release has that method.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cbverify.bench import measure
from reference import tasks

# TRL GRPOTrainer's generation paths, not cbverify.engines names: TRL itself drives generation here ("generate" is the
# trainer's default model.generate() path; the bench's engine for it is "hf-generate").
PATHS = ("generate", "transformers-cb", "cb_impl")
MAX_COMPLETION = 128


@dataclass(frozen=True, slots=True)
class GrpoConfig:
    device: str = "cpu"
    ns: tuple[int, ...] = (8, 32, 64)
    steps: int = 5
    rounds: int = 2
    num_prompts: int = 2
    model: str = "tiny-llama-arith"
    threads: int = 2
    paths: tuple[str, ...] = PATHS

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2 (the first is a warm-up), got {self.steps}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if not self.ns or min(self.ns) < 2:
            raise ValueError(f"ns must be integers >= 2 (GRPO needs a group), got {list(self.ns)}")
        if not set(self.paths) <= set(PATHS) or not self.paths:
            raise ValueError(f"paths must be a non-empty subset of {', '.join(PATHS)}, got {list(self.paths)}")


def _reward(completions, answer, **_) -> list[float]:
    return [float(tasks.parse_answer(c) == a) for c, a in zip(completions, answer, strict=True)]


def _rollout_func(model, cfg: GrpoConfig):
    from cb_impl.trl import make_rollout_func

    return make_rollout_func(model)


def run_case(path: str, n: int, cfg: GrpoConfig, out_dir: str) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reference.models import load

    model, tokenizer = load(cfg.model, device=cfg.device)
    batch = cfg.num_prompts * n
    problems = tasks.make_problems(cfg.num_prompts * cfg.steps, seed=7)
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    cuda = cfg.device.startswith("cuda")
    extra: dict = {}
    if path == "transformers-cb":
        extra["use_transformers_continuous_batching"] = True
        if not cuda:  # CPU: explicit sizes (defaults reserve GBs); one 256-token page per request fits prompt + 128
            extra["transformers_continuous_batching_config"] = {"num_blocks": batch, "max_batch_tokens": 512}
    args = GRPOConfig(
        output_dir=str(Path(out_dir) / f"trainer-{path}-{n}"), use_cpu=not cuda, bf16=cuda, num_generations=n,
        per_device_train_batch_size=batch, max_completion_length=MAX_COMPLETION, max_steps=cfg.steps,
        learning_rate=1e-5, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, shuffle_dataset=False, **extra,
    )  # fmt: skip
    times: list[float] = []
    generation: list[float] = []  # per step: seconds inside the trainer's _generate

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.base = measure.reset_peak(cfg.device)

        def on_step_begin(self, *a, **k):
            self.t = measure.clock(cfg.device)
            generation.append(0.0)

        def on_step_end(self, *a, **k):
            times.append(measure.clock(cfg.device) - self.t)

    clock = StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[clock],
        rollout_func=_rollout_func(model, cfg) if path == "cb_impl" else None,
    )
    timed_generation = hasattr(trainer, "_generate")  # TRL 1.x; a release without it reports no share
    if timed_generation:
        inner = trainer._generate

        def _generate(*a, **k):
            t = measure.clock(cfg.device)
            try:
                return inner(*a, **k)
            finally:
                generation[-1] += measure.clock(cfg.device) - t

        trainer._generate = _generate
    base_rss = measure.rss_mb()
    trainer.train()
    memory = measure.peak_memory(cfg.device, getattr(clock, "base", 0.0), base_rss)
    if len(times) != cfg.steps:
        raise RuntimeError(f"expected {cfg.steps} timed steps, got {len(times)}")
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"path": path, "n": n, "batch": batch, "step_times_s": times,
            "generation_s": generation if timed_generation else None,
            "mean_completion_length": lengths[-1] if lengths else None, **memory}  # fmt: skip


def pool_rounds(rows: list[dict]) -> list[dict]:
    """One row per (path, N) from every round's rows: step times without each round's warm-up, their median and
    spread, the generation share over the same steps, the largest peak memory."""

    def pool(group: list[dict]) -> dict:
        steps = [t for r in group for t in r["step_times_s"][1:]]
        gens = (
            [g for r in group for g in (r["generation_s"] or [])[1:]] if all(r["generation_s"] for r in group) else []
        )
        return group[0] | {
            "rounds": len(group), "timed_steps": len(steps), "step_times_s": steps, "step_s": statistics.median(steps),
            "step_min_s": min(steps), "step_max_s": max(steps),
            "generation_share": sum(gens) / sum(steps) if gens else None, "generation_times_s": gens or None,
            "peak_memory_mb": max(r["peak_memory_mb"] for r in group),
        }  # fmt: skip

    return measure.pool_groups(rows, lambda r: (r["path"], r["n"]), pool)


def paired_speedups(base: list[float], other: list[float]) -> list[float] | None:
    """``base[i] / other[i]`` for each timed step: step ``i`` of every path trains on the same prompts (same data
    order, same round), so the ratio cancels what varies from step to step (the prompts, the completion lengths),
    which the ratio of the medians does not. ``None`` unless both paths timed the same number of steps."""
    if not base or not other or len(base) != len(other):
        return None
    return [b / o for b, o in zip(base, other, strict=True)]


def run_grpo(cfg: GrpoConfig, out_dir: Path, *, from_logs: bool = False) -> dict:
    """Every path in a fresh process (progress bar); returns ``{"setup": ..., "rows": [...]}``. With ``from_logs``
    the rows an earlier run's workers left in ``out_dir/logs`` are re-read instead."""
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if from_logs:
        rows = [json.loads(line) for f in sorted(log_dir.glob("grpo-*.jsonl")) for line in f.read_text().splitlines()]
        return {"setup": _setup(cfg), "config": {k: getattr(cfg, k) for k in cfg.__slots__}, "rows": pool_rounds(rows)}
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")])),
    }
    for f in log_dir.glob("grpo-*"):
        f.unlink()
    order = [(k, p) for k in range(cfg.rounds) for p in (cfg.paths if k % 2 == 0 else cfg.paths[::-1])]
    for k, path in tqdm(order, desc="grpo-step", unit="run"):
        out = log_dir / f"grpo-{path}-r{k}.jsonl"
        cmd = [sys.executable, "-m", "cbverify.bench.grpo_step", "--path", path, "--n", *map(str, cfg.ns), "--device",
               cfg.device, "--steps", str(cfg.steps), "--num-prompts", str(cfg.num_prompts), "--model", cfg.model,
               "--threads", str(cfg.threads), "--out", str(out)]  # fmt: skip
        with open(log_dir / f"grpo-{path}-r{k}.log", "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
        got = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        rows += got or [{"path": path, "n": n, "error": f"worker exited {proc.returncode}; see {log.name}"}
                        for n in cfg.ns]  # fmt: skip
    return {"setup": _setup(cfg), "config": {k: getattr(cfg, k) for k in cfg.__slots__}, "rows": pool_rounds(rows)}


def _setup(cfg: GrpoConfig) -> str:
    return (
        f"TRL GRPOTrainer on {cfg.model}, {cfg.num_prompts} prompts x N per step, max_completion_length "
        f"{MAX_COMPLETION}; {cfg.rounds} rounds of {cfg.steps} steps per path, paths alternating, the first step of "
        f"each round a warm-up: median and (min, max) of {cfg.rounds * (cfg.steps - 1)} steps; device {cfg.device}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=PATHS, required=True, help="generation path of the trainer")
    parser.add_argument("--n", type=int, nargs="+", required=True, help="num_generations values, run ascending")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--steps", type=int, default=5, help="trainer steps per case (the first is a warm-up)")
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--model", default="tiny-llama-arith", help="bundled name or local checkpoint directory")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", required=True, help="JSON-lines file receiving one record per N")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = GrpoConfig(device=args.device, ns=tuple(args.n), steps=args.steps, num_prompts=args.num_prompts,
                     model=args.model, threads=args.threads, paths=(args.path,))  # fmt: skip
    env, status = measure.environment(args.device), 0
    with tempfile.TemporaryDirectory() as tmp, open(args.out, "a") as out:
        for n in sorted(args.n):
            start = time.perf_counter()
            try:
                row = run_case(args.path, n, cfg, tmp)
            except Exception as err:  # recorded, reported, and turned into a failing exit code
                status, row = 1, {"path": args.path, "n": n, "error": f"{type(err).__name__}: {err}",
                                  "traceback": traceback.format_exc()}  # fmt: skip
            row["case_wall_s"] = math.ceil(time.perf_counter() - start)
            out.write(json.dumps(row | {"env": env}) + "\n")
            out.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
