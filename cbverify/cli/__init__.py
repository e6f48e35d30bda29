"""The ``cbverify`` command line. Each subcommand lives in its own module exposing ``configure(parser)`` and
``run(args) -> int`` (the exit code); this file wires them together and holds what they share: the flag validators
(:func:`integer`, :func:`number`) and the rule every subcommand follows for bad input: one line on stderr
(``cbverify COMMAND: error: ...``) and exit code 2, from the parser as from the checks a command makes itself
(:func:`refuse`, :func:`held_stderr`)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterator

SUBCOMMANDS = {
    "verify": ("cbverify.cli.verify", "every engine against the reference oracle on one model; PASS/FAIL per engine"),
    "conformance": ("cbverify.cli.conformance", "the conformance suite on named engines; a property x engine report"),
    "golden": ("cbverify.cli.golden", "record or check golden log-prob regression files"),
    "bench": ("cbverify.cli.bench", "side-by-side throughput/memory benchmarks with plots"),
    "upstream": ("cbverify.cli.upstream", "TRL / transformers integration checks and the findings registry"),
    "matrix": ("cbverify.cli.matrix", "run the upstream checks across several transformers/trl versions"),
    "bisect": ("cbverify.cli.bisect", "where a finding came in: over releases, or over a local checkout's commits"),
    "report": ("cbverify.cli.report", "one finding's upstream issue in Markdown: its repro run, a regression test"),
    "validate": ("cbverify.cli.validate", "a transformers/trl checkout against a release: fixed, still present, new"),
    "zoo": ("cbverify.cli.zoo", "every engine on tiny checkpoints of many architectures; the coverage table"),
    "fuzz": ("cbverify.cli.fuzz", "Hypothesis search over one engine's configurations and call patterns"),
    "env": ("cbverify.cli.env", "build or inspect the environments of engines that cannot share ours (vllm)"),
    "train": (
        "cbverify.cli.train",
        "the oracle's GRPO loop on the bundled model, with the reference or cb_impl engine",
    ),
}
MAX_SEED = 2**32 - 1  # every seed flag: torch, numpy and Hypothesis all take it; request seeds derived from it fit


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``PROG: error: MESSAGE``, exit 2 (no usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an int in ``[low, high]`` (no upper bound when ``high`` is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def number(low: float, high: float | None = None, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            left = "(" if low_open else "["
            bound = f"in {left}{low:g}, {high:g}]" if high is not None else f"{'>' if low_open else '>='} {low:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def seed_type() -> Callable[[str], int]:
    """An argparse ``type``: a seed in ``[0, MAX_SEED]``."""
    return integer(0, MAX_SEED)


def device(text: str) -> str:
    """An argparse ``type``: ``cpu``, ``cuda`` or ``cuda:N``."""
    if re.fullmatch(r"cpu|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def missing_device(name: str) -> str | None:
    """Why ``name`` (a :func:`device`) cannot be used on this machine, or ``None`` when it can."""
    if not name.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return f"--device {name}: CUDA is not available on this machine"
    index = int(name.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def refuse(command: str, err: BaseException | str) -> int:
    """Print the one-line refusal of bad input for ``cbverify COMMAND`` and return exit code 2."""
    text = " ".join(str(err).split()) or type(err).__name__
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate from a file cannot be printed
    print(f"cbverify {command}: error: {text}", file=sys.stderr)
    return 2


def ray_option(parser: argparse.ArgumentParser, units: str) -> None:
    """The ``--ray`` flag of a command whose ``units`` can run as a campaign (:mod:`cbverify.campaign`)."""
    parser.add_argument("--ray", metavar="ADDRESS", default=None,
                        help=f"run the {units} as Ray tasks: 'auto' starts a local Ray instance, else the address of "
                        "a running cluster (needs pip install 'cbverify[ray]'; see docs/campaigns.md)")  # fmt: skip


def ray_backend(command: str, address: str):
    """The connected Ray backend for ``--ray ADDRESS``, or :func:`refuse`'s exit code 2 with one line when Ray is
    not installed or the cluster cannot be reached."""
    from cbverify.campaign.core import RayUnavailable
    from cbverify.campaign.ray_backend import connect

    try:
        return connect(address)
    except RayUnavailable as err:
        return refuse(command, err)


@contextlib.contextmanager
def held_stderr() -> Iterator[None]:
    """Hold everything written to stderr while the block runs (progress bars, warnings, library log lines, through
    ``sys.stderr`` or a logging handler bound to it) and write it out only when the block succeeds: a refusal that
    follows is then the only line on stderr."""
    buffer, original = io.StringIO(), sys.stderr
    handlers = []
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]  # fmt: skip
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and handler.stream in (original, sys.__stderr__):
                handlers.append((handler, handler.setStream(buffer)))
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    finally:
        for handler, stream in handlers:
            handler.setStream(stream)
    original.write(buffer.getvalue())  # only reached when the block raised nothing
    original.flush()


def build_parser() -> argparse.ArgumentParser:
    from cbverify import __version__

    parser = Parser(prog="cbverify", description="Can I trust my continuous-batching rollouts?")
    parser.add_argument("--version", action="version", version=f"cbverify {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        importlib.import_module(module).configure(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub, whatever the caller's environment says
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # --help, --version, or the parser's one-line error: its code, as a return value
        return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
