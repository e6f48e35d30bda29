"""Drive TRL's real trainers offline, one :class:`~cbverify.upstream.scenario.TrainerScenario` at a time.

:func:`run_scenario` copies the model (the caller's stays untouched), builds the trainer for the scenario's
generation path, wraps it with :mod:`cbverify.upstream.capture`, trains (or evaluates) for ``max_steps`` steps and
returns
the :class:`~cbverify.upstream.capture.Capture`. A trainer that raises does not raise here: the error is kept in
``capture.run_error`` so that each check can report it as a FAIL with its reason (a crash is a result).

:func:`not_applicable` says why a scenario cannot run on the installed versions (checked by presence, never assumed:
TRL's through :mod:`cbverify.upstream.trl_compat`), so its checks report NOT-APPLICABLE naming the version.
"""

from __future__ import annotations

import copy
import logging
import warnings

import torch

from cbverify.upstream import trl_compat
from cbverify.upstream.capture import Capture, install
from cbverify.upstream.rollout import make_rollout_func
from cbverify.upstream.scenario import TrainerScenario, build_trainer


def versions() -> dict[str, str]:
    import accelerate
    import transformers
    import trl

    return {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__,
            "trl": trl.__version__, "accelerate": accelerate.__version__}  # fmt: skip


def transformers_cb_support(return_logprobs: bool) -> str | None:
    """Why the installed transformers cannot serve TRL's ``cb`` path (with ``return_logprobs``), or ``None``."""
    import transformers

    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        return f"transformers {transformers.__version__} has no ContinuousBatchingConfig"
    if return_logprobs and "return_logprobs" not in ContinuousBatchingConfig.__dataclass_fields__:
        return f"transformers {transformers.__version__} ContinuousBatchingConfig has no return_logprobs"
    return None


def not_applicable(scenario: TrainerScenario) -> str | None:
    """Why ``scenario`` cannot run on the installed stack, or ``None``."""
    try:
        trl_compat.require_path(scenario.trainer, scenario.path)
        trl_compat.require_hooks(scenario.trainer)
        if scenario.trainer == "grpo":
            trl_compat.require_loss_type(scenario.loss_type)
    except trl_compat.MissingFeature as missing:
        return str(missing)
    if scenario.path == "cb" and (reason := transformers_cb_support(scenario.cb_return_logprobs)):
        return reason
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
