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


def replace_generate(trainer, rollout: RolloutFunc) -> None:
    """Make ``trainer`` (a trainer that takes no ``rollout_func``: ``RLOOTrainer``) generate with ``rollout``: its
    ``_generate`` returns what ``rollout(prompts, trainer)`` completes, in the layout the installed TRL unpacks
    (``cbverify.upstream.trl_compat``). TRL's completion-length metrics, which ``_generate`` also logs, are not."""
    from cbverify.upstream import trl_compat

    provided = ("prompt_ids_list", "completion_ids_list", "completions")
    if missing := [name for name in trl_compat.generate_layout(type(trainer)) if name not in provided]:
        raise trl_compat.MissingFeature(f"trl {trl_compat.VERSION}: {type(trainer).__name__}._generate also returns "
                                        f"{', '.join(missing)}")  # fmt: skip

    def generate(prompts):
        out = rollout(prompts, trainer)
        texts = trainer.processing_class.batch_decode(out["completion_ids"], skip_special_tokens=True)
        return trl_compat.generate_output(type(trainer), prompt_ids_list=out["prompt_ids"],
                                          completion_ids_list=out["completion_ids"], completions=texts)  # fmt: skip

    trainer._generate = generate
