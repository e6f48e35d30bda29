"""``cbverify env build NAME`` / ``cbverify env status``: the venvs of engines that run in an environment of their own
(:mod:`cbverify.engines.envs`)."""

from __future__ import annotations

import argparse
import sys

from cbverify.engines import envs


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = sub.add_parser("build", help="create (or recreate) an engine's environment from constraints-NAME.txt")
    build.add_argument("name", choices=sorted(envs.ENVS))
    sub.add_parser("status", help="which environments are built and current, and where")


def run(args: argparse.Namespace) -> int:
    if args.action == "build":
        try:
            envs.build(args.name)
        except (RuntimeError, ValueError) as err:  # a failed step, or a CBVERIFY_INSTALLER that cannot be honoured
            print(f"cbverify env build: error: {err}", file=sys.stderr)
            return 1
        return 0
    for name, spec in sorted(envs.ENVS.items()):
        why = envs.problem(name)
        print(f"{name}: {'ready at ' + str(envs.python(name).parent.parent) if why is None else why}  ({spec.why})")
    return 0
