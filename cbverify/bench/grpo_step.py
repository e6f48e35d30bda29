"""TRL ``GRPOTrainer`` steps with each generation path, in the shape of TRL PR #5765's table (step time, speedup and
peak-memory delta versus ``generate()``):
``python -m cbverify.bench.grpo_step --path generate --n 8 32 64 --out f.jsonl``.

Paths: ``generate`` (TRL's default), ``transformers-cb`` (``use_transformers_continuous_batching=True`` with TRL's
``max_memory_percent=0.5``; on CPU also explicit ``num_blocks`` / ``max_batch_tokens``), ``cb_impl``
(``rollout_func=cb_impl.trl.make_rollout_func(...)``) and, where its environment is built, ``vllm``
(``use_vllm=True, vllm_mode="colocate"``, run with the ``vllm`` environment's python and its TRL). Two workloads:

- ``arith``: the arithmetic task (``reference.tasks``) on the bundled ``tiny-llama-arith`` (natural EOS,
  exact-answer reward, ``max_completion_length`` 128; completions average ~40 tokens);
- ``reasoning``: long, long-tailed completions the model ends itself (``cbverify.bench.reasoning``: a random-weight
  Llama whose EOS probability gives geometric lengths, median 64, cut at ``max_completion_length`` 256), a cheap
  reward; the setting where generation dominates the step.

``num_prompts`` prompts x N generations per step. ``grpo_suite`` runs each path in its own process (N ascending, so
the lifetime peak RSS after case N is case N's), ``rounds`` times, the paths alternating (A B C, then C B A, ...) so
that a drift of the machine reaches every path alike. In each process the first of ``steps`` is a warm-up; the median
and the spread (min, max) are over the other steps of every round pooled. The generation share is the time spent in
the trainer's ``_generate`` over the step time (the same steps), where the TRL release has that method.

Each N's row is appended to ``--out`` (flushed and fsynced) the moment it ends, with its ``round`` and ``status``;
with ``--progress FILE`` a ``start`` line per N and a ``progress`` line per trainer step go to the parent that
time-boxes the worker (``cbverify.bench.timebox``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from cbverify.bench import measure, reasoning
from cbverify.bench.timebox import ProgressFile, append_record
from reference import tasks

# TRL GRPOTrainer's generation paths, not cbverify.engines names: TRL itself drives generation here ("generate" is the
# trainer's default model.generate() path; the bench's engine for it is "hf-generate"). vllm is opt-in (its own venv).
PATHS = ("generate", "transformers-cb", "cb_impl", "vllm")
DEFAULT_PATHS = PATHS[:3]
WORKLOADS = ("arith", "reasoning")
MAX_COMPLETION = {"arith": 128, "reasoning": reasoning.MAX_COMPLETION}
LOGGED_LENGTHS = ("mean_length", "max_length", "clipped_ratio")  # TRL's completions/* logs, one value per step
CB_PAGE = 256  # transformers CB's page size on CPU: explicit num_blocks give each request enough of these


@dataclass(frozen=True, slots=True)
class GrpoConfig:
    device: str = "cpu"
    ns: tuple[int, ...] = (8, 32, 64)
    steps: int = 5
    rounds: int = 2
    num_prompts: int = 2
    model: str = "tiny-llama-arith"
    threads: int = 2
    paths: tuple[str, ...] = DEFAULT_PATHS
    workloads: tuple[str, ...] = WORKLOADS

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2 (the first is a warm-up), got {self.steps}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if not self.ns or min(self.ns) < 2:
            raise ValueError(f"ns must be integers >= 2 (GRPO needs a group), got {list(self.ns)}")
        if not set(self.paths) <= set(PATHS) or not self.paths:
            raise ValueError(f"paths must be a non-empty subset of {', '.join(PATHS)}, got {list(self.paths)}")
        if not set(self.workloads) <= set(WORKLOADS) or not self.workloads:
            raise ValueError(f"workloads: a non-empty subset of {', '.join(WORKLOADS)}, got {list(self.workloads)}")


def _arith_reward(completions, answer, **_) -> list[float]:
    return [float(tasks.parse_answer(c) == a) for c, a in zip(completions, answer, strict=True)]


def _task(workload: str, count: int) -> tuple[list[dict], object]:
    """The dataset rows (``count`` prompts, in training order) and the reward function of a workload."""
    if workload == "reasoning":
        return [{"prompt": p} for p in reasoning.prompts(count)], reasoning.reward
    return [{"prompt": p.prompt, "answer": p.answer} for p in tasks.make_problems(count, seed=7)], _arith_reward


def _path_args(path: str, batch: int, longest: int, cuda: bool) -> dict:
    """The ``GRPOConfig`` fields that select a generation path (``longest``: prompt plus completion tokens)."""
    if path == "transformers-cb":
        if cuda:
            return {"use_transformers_continuous_batching": True}
        # CPU: explicit sizes (the defaults reserve GBs): enough 256-token pages for every request at full length
        pages = batch * -(-longest // CB_PAGE)
        return {"use_transformers_continuous_batching": True,
                "transformers_continuous_batching_config": {"num_blocks": pages, "max_batch_tokens": 512}}  # fmt: skip
    if path == "vllm":  # on CPU the fraction is of RAM, less what the process already holds (~2.4 GB at N = 64):
        # vLLM's default 0.9 refuses to start, 0.1 leaves nothing for the KV cache
        return {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
                "vllm_enable_sleep_mode": False}  # fmt: skip
    return {}


def _cb_impl_rollout(model):
    from cb_impl.trl import make_rollout_func

    return make_rollout_func(model)


def run_case(path: str, n: int, cfg: GrpoConfig, out_dir: str, workload: str = "arith",
             reports: ProgressFile | None = None) -> dict:  # fmt: skip
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reference.models import load

    model, tokenizer = load(cfg.model, device=cfg.device)
    batch = cfg.num_prompts * n
    rows, reward = _task(workload, cfg.num_prompts * cfg.steps)
    longest = max(len(tokenizer(r["prompt"])["input_ids"]) for r in rows) + MAX_COMPLETION[workload]
    cuda = cfg.device.startswith("cuda")
    args = GRPOConfig(
        output_dir=str(Path(out_dir) / f"trainer-{path}-{n}"), use_cpu=not cuda, bf16=cuda, num_generations=n,
        per_device_train_batch_size=batch, max_completion_length=MAX_COMPLETION[workload], max_steps=cfg.steps,
        learning_rate=1e-5, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, shuffle_dataset=False, **_path_args(path, batch, longest, cuda),
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
            if reports is not None:
                reports.write("progress", n=n, steps_done=len(times), steps=cfg.steps, step_times_s=list(times))

    clock = StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[clock],
        rollout_func=_cb_impl_rollout(model) if path == "cb_impl" else None,
    )
    note = None
    if path == "vllm" and not cuda:  # the sync raises there: the registered vllm-colocate-weight-sync-crashes
        trainer.vllm_generation.sync_weights = lambda: None
        note = "weight sync held off: it crashes on vLLM-CPU (vllm-colocate-weight-sync-crashes); a lower bound"
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
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]  # one per step
    return {"workload": workload, "path": path, "n": n, "batch": batch, "step_times_s": times, "note": note,
            "generation_s": generation if timed_generation else None,
            "mean_completion_length": logs[-1]["completions/mean_length"] if logs else None,
            "completion_lengths": {k: [h.get(f"completions/{k}") for h in logs] for k in LOGGED_LENGTHS},
            **memory}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=PATHS, required=True, help="generation path of the trainer")
    parser.add_argument("--workload", choices=WORKLOADS, default="arith", help="the task trained on")
    parser.add_argument("--n", type=int, nargs="+", required=True, help="num_generations values, run ascending")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--steps", type=int, default=5, help="trainer steps per case (the first is a warm-up)")
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--model", default="tiny-llama-arith", help="bundled name or local checkpoint directory")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", required=True, help="JSON-lines file receiving one record per N")
    parser.add_argument("--round", type=int, default=0, help="the round (written in each record)")
    parser.add_argument("--progress", default=None, help="file receiving progress lines (cbverify.bench.timebox)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = GrpoConfig(device=args.device, ns=tuple(args.n), steps=args.steps, num_prompts=args.num_prompts,
                     model=args.model, threads=args.threads, paths=(args.path,),
                     workloads=(args.workload,))  # fmt: skip
    env, status = measure.environment(args.device), 0
    reports = ProgressFile(args.progress)
    with tempfile.TemporaryDirectory() as tmp:
        for n in sorted(args.n):
            start = time.perf_counter()
            reports.write("start", n=n, pid=os.getpid())
            try:
                row = run_case(args.path, n, cfg, tmp, args.workload, reports) | {"status": "ok"}
            except Exception as err:  # recorded, reported, and turned into a failing exit code
                status, row = 1, {"workload": args.workload, "path": args.path, "n": n, "status": "error",
                                  "error": f"{type(err).__name__}: {err}",
                                  "traceback": traceback.format_exc()}  # fmt: skip
            row["case_wall_s"] = math.ceil(time.perf_counter() - start)
            append_record(Path(args.out), row | {"round": args.round, "env": env})
    return status


if __name__ == "__main__":
    sys.exit(main())
