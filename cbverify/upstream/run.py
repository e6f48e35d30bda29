"""Drive TRL's real trainers offline, one :class:`~cbverify.upstream.scenario.TrainerScenario` at a time.

:func:`run_scenario` copies the model (the caller's stays untouched), builds the trainer for the scenario's
generation path, wraps it with :mod:`cbverify.upstream.capture`, trains (or evaluates) for ``max_steps`` steps and
returns
the :class:`~cbverify.upstream.capture.Capture`. A trainer that raises does not raise here: the error is kept in
``capture.run_error`` so that each check can report it as a FAIL with its reason (a crash is a result).

:func:`feature_support` says which trainer features the installed versions offer (checked by presence, never
assumed), so a check on a version that lacks one reports NOT-APPLICABLE naming the version.
"""

from __future__ import annotations

import copy
import inspect
import logging
import warnings

import torch

from cbverify.upstream.capture import Capture, install
from cbverify.upstream.rollout import make_rollout_func
from cbverify.upstream.scenario import TrainerScenario, build_trainer


def versions() -> dict[str, str]:
    import accelerate
    import transformers
    import trl

    return {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__,
            "trl": trl.__version__, "accelerate": accelerate.__version__}  # fmt: skip


def feature_support() -> dict[str, str | None]:
    """Feature -> ``None`` when supported, else a one-line reason naming the installed version that lacks it."""
    import trl
    from trl import GRPOConfig, GRPOTrainer

    v = versions()
    fields = set(GRPOConfig.__dataclass_fields__)
    out: dict[str, str | None] = {}
    out["cb"] = (
        None if "use_transformers_continuous_batching" in fields
        else f"trl {trl.__version__} has no GRPOConfig.use_transformers_continuous_batching"
    )  # fmt: skip
    if out["cb"] is None:
        try:
            from transformers.generation import ContinuousBatchingConfig  # noqa: F401
        except ImportError:
            out["cb"] = f"transformers {v['transformers']} has no ContinuousBatchingConfig"
    has_rollout = "rollout_func" in inspect.signature(GRPOTrainer.__init__).parameters
    out["rollout_func"] = None if has_rollout else f"trl {trl.__version__} GRPOTrainer takes no rollout_func"
    out["generate"] = None
    out["cb_return_logprobs"] = None
    if out["cb"] is None:
        from transformers.generation import ContinuousBatchingConfig

        if "return_logprobs" not in ContinuousBatchingConfig.__dataclass_fields__:
            lacks = f"transformers {v['transformers']} ContinuousBatchingConfig has no return_logprobs"
            out["cb_return_logprobs"] = lacks
    return out


HOOKS = ("_generate", "_calculate_rewards", "_generate_and_score_completions", "_compute_loss",
         "_get_per_token_logps_and_entropies")  # fmt: skip


def missing_hooks(trainer: str) -> str | None:
    """The private trainer methods :mod:`cbverify.upstream.capture` wraps that this TRL lacks, named, or ``None``."""
    import trl

    cls = trl.GRPOTrainer if trainer == "grpo" else trl.RLOOTrainer
    missing = [h for h in HOOKS if not hasattr(cls, h)]
    return f"trl {trl.__version__} {cls.__name__} lacks {', '.join(missing)} (hook points)" if missing else None


def not_applicable(scenario: TrainerScenario) -> str | None:
    """Why ``scenario`` cannot run on the installed stack, or ``None``."""
    support = feature_support()
    if support.get(scenario.path):
        return support[scenario.path]
    if hooks := missing_hooks(scenario.trainer):
        return hooks
    if scenario.path == "rollout_func" and scenario.trainer != "grpo":
        return f"RLOOTrainer (trl {versions()['trl']}) offers no rollout_func"
    if scenario.path == "cb" and scenario.cb_return_logprobs and support["cb_return_logprobs"]:
        return support["cb_return_logprobs"]
    if scenario.bf16 and not torch.cuda.is_available() and not _cpu_bf16_ok():
        return "bf16 autocast unavailable on this CPU"
    return None


def _cpu_bf16_ok() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.ones(2, 2) @ torch.ones(2, 2)
        return True
    except RuntimeError:
        return False


def run_scenario(scenario: TrainerScenario, model, tokenizer) -> Capture:
    """Train (or evaluate) a copy of ``model`` under ``scenario`` and return what the trainer saw."""
    reason = not_applicable(scenario)
    if reason:
        raise ValueError(f"scenario not applicable on this stack: {reason}")
    torch.manual_seed(scenario.seed)
    work_model = copy.deepcopy(model).float().train()
    capture = Capture()
    rollout_func = None
    if scenario.path == "rollout_func":
        capture.rollout_backend = scenario.rollout_backend
        rollout_func = make_rollout_func(capture.rollout_backend, work_model, tokenizer, base_seed=scenario.seed)
    with warnings.catch_warnings(), _quiet_loggers():
        # TRL/transformers deprecation chatter (gradient_checkpointing -> activation_checkpointing, block_size) is
        # about their own internals, repeated every run; it carries no information about the scenario under test.
        warnings.simplefilter("ignore", FutureWarning)
        trainer = build_trainer(scenario, work_model, tokenizer, rollout_func=rollout_func)
        install(trainer, capture)
        try:
            trainer.evaluate() if scenario.evaluate else trainer.train()
        except Exception as err:  # a crash is a finding: every check reports it, nothing is swallowed
            capture.run_error = err
    return capture


class _quiet_loggers:
    """Silence the CB manager's per-run INFO/WARNING chatter for the duration; errors still print."""

    NAMES = ("transformers", "ContinuousBatchingLogger", "trl")

    def __enter__(self):
        self.levels = {n: logging.getLogger(n).level for n in self.NAMES}
        for n in self.NAMES:
            logging.getLogger(n).setLevel(logging.ERROR)

    def __exit__(self, *exc):
        for n, level in self.levels.items():
            logging.getLogger(n).setLevel(level)
