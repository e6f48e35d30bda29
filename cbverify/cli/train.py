"""``cbverify train``: the oracle's GRPO loop (``reference.train``) with a chosen rollout engine.

``--engine reference`` is ``python -m reference.train``; ``--engine cb_impl`` builds our engine once on the model being
trained (it reads the live weights at every step), so with the same seeds it must give the same rollouts. The choice
lives here, above both, so the oracle never imports the engine it judges.
"""

from __future__ import annotations

import argparse

from reference import train as reference_train

ENGINES = ("reference", "cb_impl")


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


def run(args: argparse.Namespace) -> int:
    return reference_train.run(args, make_generate(args.engine))
