"""A readable GRPO loop on the bundled arithmetic model: ``python -m reference.train --steps 30``.

One step, in order:

1. draw ``num_prompts`` arithmetic problems (``reference.tasks``; seeded by step) and ask the rollout engine (the
   oracle's own ``reference.generate`` unless the caller passes another: ``cbverify train --engine cb_impl``) for
   ``num_generations`` completions of each (one counter-based sampling seed per completion);
2. reward each completion (exact answer and EOS: 1, else 0), group-relative advantages (``reference.advantages``);
3. teacher-force the trainer-side log-probs of the sampled tokens with the current weights (``old_per_token_logps``),
   compare them with the engine's (``reference.metrics``), and, with ``beta > 0``, the frozen initial model's;
4. ``num_iterations`` optimizer steps on the GRPO loss (``reference.loss``), each on the whole batch, with gradient
   clipping; the logged loss, grad norm, KL and clip fraction are those of the first iteration.

Deterministic given the seeds (the same config gives the same per-step numbers on the same machine and threads).

Simplifications versus TRL's ``GRPOTrainer``: one process, one micro-batch per step (no gradient accumulation, no
``steps_per_generation`` buffering), no padding (one forward per completion), no entropy logging or masking, no
learning-rate schedule, one reward function, full-precision float32 weights.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields

import torch

from reference import tasks
from reference.advantages import SCALE_REWARDS, compute_advantages
from reference.generate import generate as reference_generate
from reference.logprobs import per_token_logps
from reference.loss import IS_MODES, LOSS_TYPES, LossConfig, grpo_loss
from reference.metrics import mismatch_metrics, pad_rows
from reference.spec import Rollout, RolloutRequest, SamplingParams


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Everything one GRPO run depends on. Loss fields mirror ``reference.loss.LossConfig``."""

    model: str = "tiny-llama-arith"
    steps: int = 30
    num_prompts: int = 4
    num_generations: int = 4
    min_terms: int = 2
    max_terms: int = 4
    max_new_tokens: int = 48
    temperature: float = 1.0
    learning_rate: float = 1e-4
    max_grad_norm: float = 1.0
    num_iterations: int = 1
    scale_rewards: str = "group"
    loss_type: str = "grpo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.04
    is_correction: str | None = None
    is_clip_max: float | None = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "num_prompts", "num_generations", "max_new_tokens", "num_iterations"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (GRPO samples), got {self.temperature}")
        if not (self.learning_rate > 0 and self.max_grad_norm > 0):
            raise ValueError("learning_rate and max_grad_norm must be > 0")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}")
        self.loss_config()  # validates the loss fields with LossConfig's own messages

    def loss_config(self) -> LossConfig:
        return LossConfig(
            loss_type=self.loss_type, epsilon_low=self.epsilon, epsilon_high=self.epsilon_high, beta=self.beta,
            is_correction=self.is_correction, is_clip_max=self.is_clip_max, max_completion_length=self.max_new_tokens,
        )  # fmt: skip


def step_requests(config: TrainConfig, step: int) -> tuple[list[tasks.ArithProblem], list[RolloutRequest]]:
    """The step's problems and one request per completion; seeds depend only on (config.seed, step, index)."""
    problems = tasks.make_problems(
        config.num_prompts, seed=config.seed * 1_000_003 + step, min_terms=config.min_terms, max_terms=config.max_terms
    )
    sampling = SamplingParams(temperature=config.temperature, max_new_tokens=config.max_new_tokens)
    requests = [
        RolloutRequest(
            request_id=f"s{step}-p{p}-g{g}",
            prompt_ids=tuple(tasks.prompt_ids(problem)),
            sampling=sampling,
            seed=(config.seed * 1_000_003 + step) * 10_007 + p * config.num_generations + g,
            eos_token_ids=(tasks.EOS_ID,),
        )
        for p, problem in enumerate(problems)
        for g in range(config.num_generations)
    ]
    return problems, requests


Generate = Callable[[Sequence[RolloutRequest]], list[Rollout]]


def train(
    config: TrainConfig, log: Callable[[dict], None] | None = None, model=None, generate: Generate | None = None
) -> list[dict]:
    """Run ``config.steps`` GRPO steps and return one metrics dict per step (also passed to ``log``).

    ``model`` defaults to a fresh load of ``config.model`` (float32, CPU); it is trained in place. ``generate`` is the
    rollout engine (``requests -> rollouts`` in request order); it must read ``model``'s live weights at every call.
    The default is the oracle, ``reference.generate.generate`` on ``model``.
    """
    if model is None:
        from reference.models import load  # transformers is needed only to load the model

        model, _ = load(config.model)
    torch.manual_seed(config.seed)
    ref_model = copy.deepcopy(model).eval() if config.beta != 0.0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    loss_config = config.loss_config()
    history: list[dict] = []
    if generate is None:
        generate = functools.partial(reference_generate, model)
    for step in range(config.steps):
        start = time.perf_counter()
        problems, requests = step_requests(config, step)
        model.eval()
        rollouts = generate(requests)
        if [r.request_id for r in rollouts] != [q.request_id for q in requests]:
            raise RuntimeError("the rollout engine returned rollouts out of request order or incomplete")
        problem_of = [problem for problem in problems for _ in range(config.num_generations)]
        rewards = torch.tensor([tasks.reward(p, r.completion_ids) for p, r in zip(problem_of, rollouts, strict=True)])
        advantages = compute_advantages(rewards, config.num_generations, config.scale_rewards)  # (B,)

        prompts = [list(r.prompt_ids) for r in rollouts]
        completions = [list(r.completion_ids) for r in rollouts]
        old, mask = pad_rows(per_token_logps(model, prompts, completions, config.temperature))  # (B, T) both
        sampling, _ = pad_rows([torch.tensor(r.logprobs) for r in rollouts])  # (B, T)
        ref = pad_rows(per_token_logps(ref_model, prompts, completions, config.temperature))[0] if ref_model else None

        model.train()
        first = None
        for _ in range(config.num_iterations):
            current = per_token_logps(model, prompts, completions, config.temperature, grad=True)
            width = mask.shape[1]
            logps = torch.stack([torch.nn.functional.pad(c.double(), (0, width - len(c))) for c in current])  # (B, T)
            out = grpo_loss(logps, old, ref, sampling, advantages, mask, loss_config)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm))
            optimizer.step()
            first = first or (out, grad_norm)

        out, grad_norm = first
        record = {
            "step": step, "mean_reward": float(rewards.mean()), "loss": float(out.loss.detach()),
            "grad_norm": grad_norm, "kl": out.kl, "clip_fraction": out.clip_fraction,
            "mean_completion_length": float(mask.sum(1).double().mean()),
            "stop_fraction": statistics.mean(r.finish_reason == "stop" for r in rollouts),
            **mismatch_metrics(old, sampling, mask), "step_time_s": time.perf_counter() - start,
        }  # fmt: skip
        history.append(record)
        if log is not None:
            log(record)
    return history


def build_parser(prog: str = "python -m reference.train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field, plus ``--json`` and ``--threads`` (``cbverify train`` adds ``--engine``)."""
    defaults = TrainConfig()
    helps = {
        "model": "bundled model name or local checkpoint directory",
        "steps": "optimizer steps (one generation batch each)",
        "num_prompts": "problems per step", "num_generations": "completions per problem (the GRPO group size)",
        "min_terms": "fewest numbers in a problem", "max_terms": "most numbers in a problem",
        "max_new_tokens": "completion length cap (also dr_grpo's normaliser)",
        "temperature": "sampling temperature (trainer log-probs use the same, as in TRL)",
        "learning_rate": "AdamW learning rate", "max_grad_norm": "gradient clipping norm",
        "num_iterations": "optimizer steps per generation batch (> 1 makes the clip matter)",
        "scale_rewards": f"advantage scaling: {', '.join(SCALE_REWARDS)}",
        "loss_type": f"one of {', '.join(LOSS_TYPES)}", "epsilon": "lower clip epsilon",
        "epsilon_high": "upper clip epsilon (default: epsilon)", "beta": "KL coefficient against the initial model",
        "is_correction": f"generation-vs-training IS correction: {', '.join(IS_MODES)} (default: none)",
        "is_clip_max": "upper bound of the IS correction", "seed": "seed for problems, sampling and initialisation",
    }  # fmt: skip
    for field in fields(TrainConfig):
        default = getattr(defaults, field.name)
        kind = {"int": int, "float": float}.get(str(field.type).split(" ")[0], str)  # "float | None" -> float
        flag = "--" + field.name.replace("_", "-")
        choices = {"loss_type": LOSS_TYPES, "scale_rewards": SCALE_REWARDS,
                   "is_correction": IS_MODES}  # fmt: skip
        extra = {"choices": choices[field.name]} if field.name in choices else {}
        help_text = f"{helps[field.name]} (default: {default})"
        parser.add_argument(flag, type=kind, default=default, help=help_text, **extra)
    parser.add_argument("--json", action="store_true", help="print one JSON object per step instead of a table row")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace, make_generate: Callable[[object], Generate] | None = None) -> int:
    """Train as ``args`` say and print a table row (or JSON) per step; ``make_generate(model)`` builds the engine."""
    torch.set_num_threads(args.threads)
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    print(json.dumps(asdict(config)), file=sys.stderr)
    from tqdm import tqdm

    bar = tqdm(total=config.steps, desc="GRPO steps", file=sys.stderr)

    def log(record: dict) -> None:
        if args.json:
            tqdm.write(json.dumps(record))
        else:
            tqdm.write(
                f"step {record['step']:3d}  reward {record['mean_reward']:.3f}  loss {record['loss']:+.4f}  "
                f"kl {record['kl'] or 0.0:.4f}  clip {record['clip_fraction']:.3f}  grad {record['grad_norm']:.3f}  "
                f"len {record['mean_completion_length']:.1f}  |dlogp| {record['logprob_abs_diff_max']:.1e}  "
                f"{record['step_time_s']:.1f}s"
            )
        bar.update(1)

    start = time.perf_counter()
    from reference.models import load

    model, _ = load(config.model)
    history = train(config, log=log, model=model, generate=make_generate(model) if make_generate else None)
    bar.close()
    rewards = [r["mean_reward"] for r in history]
    k = max(1, len(rewards) // 5)
    print(f"mean reward: first {k} steps {statistics.mean(rewards[:k]):.3f}, last {k} steps "
          f"{statistics.mean(rewards[-k:]):.3f}; {time.perf_counter() - start:.0f}s total")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
