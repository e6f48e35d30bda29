"""``cbverify train``: the oracle's GRPO loop (``reference.train``) with a chosen rollout engine.

``--engine reference`` is ``python -m reference.train``; ``--engine cb_impl`` builds our engine once on the model being
trained (it reads the live weights at every step), so with the same seeds it must give the same rollouts. The choice
lives here, above both, so the oracle never imports the engine it judges.

Bad input is one line and exit 2 before any step: every numeric flag is range-checked by the parser, the whole
configuration by ``TrainConfig`` (the rules that tie flags together), and the checkpoint is checked and loaded once
(:func:`cbverify.checkpoint.load_checked`; it must have the arithmetic task's tokenizer, whose problems it trains on).
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from cbverify.cli import held_stderr, integer, number, refuse, seed_type
from reference import train as reference_train

ENGINES = ("reference", "cb_impl")
# The range of each numeric flag reference.train defines (TrainConfig's and LossConfig's own rules, checked by the
# parser so a bad value is refused in one line).
FLAG_TYPES = {
    "steps": integer(1), "num_prompts": integer(1), "num_generations": integer(1), "max_new_tokens": integer(1),
    "num_iterations": integer(1), "min_terms": integer(2), "max_terms": integer(2),
    "temperature": number(0, low_open=True), "learning_rate": number(0, low_open=True),
    "max_grad_norm": number(0, low_open=True), "epsilon": number(0), "epsilon_high": number(0), "beta": number(0),
    "is_clip_max": number(0, low_open=True), "seed": seed_type(), "threads": integer(1, 1024),
}  # fmt: skip


def make_generate(engine: str):
    """``model -> (requests -> rollouts)`` for ``engine``; ``None`` = the oracle (``reference.train``'s default)."""
    if engine == "reference":
        return None
    from cb_impl.config import EngineConfig
    from cb_impl.engine import LLMEngine

    return lambda model: LLMEngine(model, EngineConfig(num_blocks=512, max_model_len=256)).generate


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="reference",
                        help="rollout engine: 'reference' (the slow oracle) or 'cb_impl' (our CB engine)")  # fmt: skip
    reference_train.add_arguments(parser)
    for action in parser._actions:
        if action.dest in FLAG_TYPES:
            action.type = FLAG_TYPES[action.dest]


def run(args: argparse.Namespace) -> int:
    from cbverify.checkpoint import load_checked, open_checkpoint

    try:
        reference_train.TrainConfig(**{f.name: getattr(args, f.name) for f in fields(reference_train.TrainConfig)})
        with held_stderr():
            if not open_checkpoint(args.model).arithmetic:
                raise ValueError(f"--model {args.model}: cbverify train trains on the arithmetic task, and this "
                                 "checkpoint's tokenizer is not the task's")  # fmt: skip
            load_checked(args.model)  # weights that do not load are refused here, not in a traceback mid-run
    except (ValueError, FileNotFoundError) as err:
        return refuse("train", err)
    return reference_train.run(args, make_generate(args.engine))
