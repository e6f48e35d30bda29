"""``rollout_func`` backends for TRL's ``GRPOTrainer``: ``cb_impl``'s adapter, or the reference generator.

TRL 1.16 calls ``rollout_func(prompts, trainer)`` with one entry per completion (each prompt already repeated
``num_generations`` times by TRL's sampler) and expects ``{"prompt_ids", "completion_ids", "logprobs"}`` back, one row
per entry, in order. The reference backend here reads the trainer's sampling options (temperature, top-k, top-p,
min-p, ``max_completion_length``, EOS ids, ``do_sample``) and rejects the ones it cannot honour (repetition penalty)
instead of dropping them; its log-probs are the processed (sampling-distribution) log-probs of DESIGN §2.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch

from reference.spec import MAX_SEED, RolloutRequest, SamplingParams

RolloutFunc = Callable[[list, object], dict]


def cb_impl_available() -> bool:
    """Whether ``cb_impl.trl.make_rollout_func`` can be imported (written concurrently by another engineer)."""
    try:
        return importlib.util.find_spec("cb_impl.trl") is not None and hasattr(
            importlib.import_module("cb_impl.trl"), "make_rollout_func"
        )
    except ImportError:
        return False


def resolve_backend(requested: str) -> str:
    """``auto`` -> ``cb_impl`` when importable, else ``reference``; an explicit ``cb_impl`` that is missing raises."""
    if requested == "auto":
        return "cb_impl" if cb_impl_available() else "reference"
    if requested == "cb_impl" and not cb_impl_available():
        raise ImportError("rollout_backend='cb_impl' requested but cb_impl.trl.make_rollout_func is not importable")
    return requested


def sampling_from_trainer(trainer) -> SamplingParams:
    """The trainer's generation options as :class:`SamplingParams`; options we cannot honour raise ``ValueError``."""
    if getattr(trainer, "repetition_penalty", 1.0) not in (None, 1.0):
        raise ValueError(f"repetition_penalty={trainer.repetition_penalty} is not supported by this rollout_func")
    do_sample = getattr(getattr(trainer, "generation_config", None), "do_sample", True)
    return SamplingParams(
        temperature=float(trainer.temperature) if do_sample else 0.0,
        top_k=int(trainer.top_k or 0),
        top_p=float(trainer.top_p if trainer.top_p is not None else 1.0),
        min_p=float(trainer.min_p or 0.0),
        max_new_tokens=int(trainer.max_completion_length),
    )


def request_seed(base_seed: int, step: int, index: int) -> int:
    """A distinct, reproducible seed per (run seed, training step, row)."""
    return (base_seed * 1_000_003 + step * 10_007 + index) % MAX_SEED


def _ids(tokenizer, prompt: str) -> tuple[int, ...]:
    return tuple(tokenizer(prompt)["input_ids"])


def make_reference_rollout_func(base_seed: int = 0) -> RolloutFunc:
    """A ``rollout_func`` that completes every row with ``reference.generate`` on the trainer's current model."""
    from reference.generate import generate

    def rollout_func(prompts: list, trainer) -> dict:
        tokenizer = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        sampling = sampling_from_trainer(trainer)
        eos = tuple(int(t) for t in trainer.eos_token_ids)
        step = int(trainer.state.global_step)
        requests = [
            RolloutRequest(f"row{i}", _ids(tokenizer, p), sampling, request_seed(base_seed, step, i), eos)
            for i, p in enumerate(prompts)
        ]
        with torch.no_grad():
            rollouts = generate(model, requests)
        return {
            "prompt_ids": [list(r.prompt_ids) for r in rollouts],
            "completion_ids": [list(r.completion_ids) for r in rollouts],
            "logprobs": [list(r.logprobs) for r in rollouts],
        }

    return rollout_func


def make_rollout_func(backend: str, model, tokenizer, base_seed: int = 0) -> RolloutFunc:
    """The ``rollout_func`` for ``backend`` (``cb_impl`` or ``reference``)."""
    if backend == "reference":
        return make_reference_rollout_func(base_seed)
    if backend == "cb_impl":
        make = importlib.import_module("cb_impl.trl").make_rollout_func
        return make(model=model, tokenizer=tokenizer, seed=base_seed)
    raise ValueError(f"unknown rollout backend {backend!r}")
