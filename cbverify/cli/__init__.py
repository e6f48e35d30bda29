"""The ``cbverify`` command line. Each subcommand lives in its own module exposing ``configure(parser)`` and
``run(args) -> int`` (the exit code); this file only wires them together."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

SUBCOMMANDS = {
    "verify": ("cbverify.cli.verify", "every engine against the reference oracle on one model; PASS/FAIL per engine"),
    "conformance": ("cbverify.cli.conformance", "the conformance suite on named engines; a property x engine report"),
    "golden": ("cbverify.cli.golden", "record or check golden log-prob regression files"),
    "bench": ("cbverify.cli.bench", "side-by-side throughput/memory benchmarks with plots"),
    "upstream": ("cbverify.cli.upstream", "TRL / transformers integration checks and the findings registry"),
    "matrix": ("cbverify.cli.matrix", "run the upstream checks across several transformers/trl versions"),
    "zoo": ("cbverify.cli.zoo", "every engine on tiny checkpoints of many architectures; the coverage table"),
    "fuzz": ("cbverify.cli.fuzz", "Hypothesis search over one engine's configurations and call patterns"),
    "env": ("cbverify.cli.env", "build or inspect the environments of engines that cannot share ours (vllm)"),
    "train": (
        "cbverify.cli.train",
        "the oracle's GRPO loop on the bundled model, with the reference or cb_impl engine",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    from cbverify import __version__

    parser = argparse.ArgumentParser(prog="cbverify", description="Can I trust my continuous-batching rollouts?")
    parser.add_argument("--version", action="version", version=f"cbverify {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        importlib.import_module(module).configure(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub, whatever the caller's environment says
    args = build_parser().parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
