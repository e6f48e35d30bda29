"""``rollout_func`` backends for TRL's ``GRPOTrainer``: our engine, or the oracle behind the same adapter.

Both go through ``cb_impl.trl.make_rollout_func`` (one trainer -> sampling conversion, one seed rule, one prompt
handling), so the only difference between the two paths is the engine that completes the rows: ``cb_impl``'s
``LLMEngine`` or ``reference.generate`` on the trainer's live model. Options neither can honour (repetition penalty)
raise instead of being dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cb_impl.trl import make_rollout_func as make_cb_rollout_func
from reference.generate import generate
from reference.spec import Rollout, RolloutRequest

RolloutFunc = Callable[[list, object], dict]
BACKENDS = ("cb_impl", "reference")


class OracleEngine:
    """``reference.generate`` on ``model`` (read live at every call) behind the engine interface ``cb_impl.trl``
    drives."""

    def __init__(self, model) -> None:
        self.model = model

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        with torch.no_grad():
            return generate(self.model, requests)


def make_rollout_func(backend: str, model, tokenizer, base_seed: int = 0) -> RolloutFunc:
    """The ``rollout_func`` for ``backend`` (``cb_impl`` or ``reference``) on ``model``."""
    if backend == "cb_impl":
        return make_cb_rollout_func(model=model, tokenizer=tokenizer, seed=base_seed)
    if backend == "reference":
        return make_cb_rollout_func(model=model, tokenizer=tokenizer, seed=base_seed, engine=OracleEngine(model))
    raise ValueError(f"unknown rollout backend {backend!r}; known: {', '.join(BACKENDS)}")
