"""A TRL ``rollout_func`` backed by one persistent :class:`LLMEngine`: ``GRPOTrainer(rollout_func=...)``.

TRL 1.16 calls ``rollout_func(prompts, trainer)`` with one entry per completion (a GRPO group's prompts back to back,
which the engine prefills once and shares) and expects ``{"prompt_ids", "completion_ids", "logprobs"}`` in order.
The engine is built at the first call (from the trainer's model unless given one) and reads the weights live, so
updates need no weight sync. Without a ``config`` it holds at most that call's batch, its KV cache sized for it;
after each call it hands the cache's pages back for the trainer's update (and with them its CUDA graphs, which the
next call records again: a few forwards per bucket, against a memory peak the update would otherwise share with the
cache). ``logprobs`` are the sampler's processed
log-probs (``reference.spec.Rollout``). Seeds are a function of (base seed, training step, row of the *global*
batch): process ``r`` of ``N`` completes rows ``r * B`` to ``(r + 1) * B - 1``, so no two processes share a seed and
N processes draw what one would; a rerun with the same seeds reproduces the rollouts. Trainer options the engine
cannot honour (repetition penalty) raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from reference.spec import MAX_SEED, RolloutRequest, SamplingParams

RolloutFunc = Callable[[list, Any], dict[str, list]]


def trainer_sampling(trainer: Any) -> SamplingParams:
    """The trainer's generation options as :class:`SamplingParams` (``do_sample=False`` -> greedy)."""
    penalty = getattr(trainer, "repetition_penalty", None)
    if penalty not in (None, 1.0):
        raise ValueError(f"this rollout_func cannot apply repetition_penalty={penalty}")
    do_sample = getattr(getattr(trainer, "generation_config", None), "do_sample", True)
    top_p = getattr(trainer, "top_p", None)
    return SamplingParams(temperature=float(trainer.temperature) if do_sample else 0.0,
                          top_k=int(getattr(trainer, "top_k", None) or 0),
                          top_p=float(top_p) if top_p is not None else 1.0,
                          min_p=float(getattr(trainer, "min_p", None) or 0.0),
                          max_new_tokens=int(trainer.max_completion_length))  # fmt: skip


def row_seed(base_seed: int, step: int, row: int) -> int:
    """A distinct, reproducible seed per (run seed, training step, row)."""
    return (base_seed * 1_000_003 + step * 10_007 + row) % MAX_SEED


def make_rollout_func(model: torch.nn.Module | None = None, tokenizer: Any = None, *,
                      config: EngineConfig | None = None, seed: int = 0,
                      engine: Any = None) -> RolloutFunc:  # fmt: skip
    """``rollout_func(prompts, trainer)`` for ``GRPOTrainer``. ``model``/``tokenizer`` default to the trainer's;
    ``engine`` reuses an existing engine (anything with ``generate(requests) -> rollouts`` in request order, e.g. the
    oracle in ``cbverify.upstream.rollout``). The engine in use is exposed as ``rollout_func.engine``."""

    def rollout_func(prompts: list, trainer: Any) -> dict[str, list]:
        if rollout_func.engine is None:
            target = model if model is not None else trainer.accelerator.unwrap_model(trainer.model)
            cfg = config if config is not None else EngineConfig(max_num_seqs=len(prompts))  # one batch in flight
            rollout_func.engine = LLMEngine(target, cfg)
        tok = tokenizer if tokenizer is not None else trainer.processing_class
        sampling = trainer_sampling(trainer)
        eos = tuple(int(t) for t in (getattr(trainer, "eos_token_ids", None) or [tok.eos_token_id]))
        step = int(trainer.state.global_step)
        first = int(trainer.accelerator.process_index) * len(prompts)  # rows of the global batch: seeds per process
        requests = []
        for i, prompt in enumerate(prompts, start=first):
            if not isinstance(prompt, str):
                raise ValueError(f"this rollout_func takes plain-text prompts, got {type(prompt).__name__}")
            ids = tuple(tok(prompt)["input_ids"])
            requests.append(RolloutRequest(f"step{step}-row{i}", ids, sampling, row_seed(seed, step, i), eos))
        rollouts = rollout_func.engine.generate(requests)
        if isinstance(rollout_func.engine, LLMEngine):  # idle again: the trainer's update runs in the pages given back
            rollout_func.engine.release_cache()
        return {key: [list(getattr(r, key)) for r in rollouts] for key in ("prompt_ids", "completion_ids", "logprobs")}

    rollout_func.engine = engine
    return rollout_func
