"""``cbverify conformance``: the conformance suite (:mod:`cbverify.conformance`, a pytest plugin) on the named engines,
its property x engine table written as Markdown (versions, the reason of each NOT-APPLICABLE, the assertion and repro
command of each FAIL). The same run as ``pytest --pyargs cbverify.conformance --cbverify-engine NAME ...``, kept apart
from the pytest configuration of the directory it is started in. Exit 0 when no property fails."""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from cbverify.cli import held_stderr, integer, ray_backend, ray_option, refuse
from cbverify.data import workdir


def option(text: str) -> str:
    """An argparse ``type``: ``KEY=VALUE`` with an identifier as the key (a factory's keyword argument)."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", text, flags=re.DOTALL) is None:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY a keyword argument name, got {text!r}")
    return text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", nargs="+", required=True, metavar="ENGINE",
                        help="built-in names, installed cbverify.engines entry points, or module:factory")  # fmt: skip
    parser.add_argument("--model", default="tiny-llama-arith", help="bundled model name or local checkpoint folder")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", type=option,
                        help="an option for every engine's factory (a JSON value when it parses)")  # fmt: skip
    parser.add_argument("--examples", type=integer(1), default=10, help="Hypothesis examples per property, >= 1")
    parser.add_argument("--markdown", type=Path, default=Path("conformance.md"), help="where the report goes")
    parser.add_argument("-k", dest="keyword", default=None, help="only the properties matching this pytest -k")
    ray_option(parser, "engines (one task each)")
    parser.add_argument("--out", type=Path, default=workdir("campaigns") / "conformance",
                        help="with --ray: the campaign's results file (resume) and conformance.json "
                        "(default: %(default)s)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import pytest

    from cbverify.checkpoint import preflight
    from cbverify.conformance import suite_argv

    if args.markdown.is_dir() or not args.markdown.resolve().parent.is_dir():
        return refuse("conformance", f"--markdown {args.markdown}: a folder, or its folder does not exist")
    try:
        with held_stderr():
            preflight(args.model)
    except (ValueError, FileNotFoundError) as err:
        return refuse("conformance", err)
    if args.ray is not None:
        from cbverify.campaign import conformance as campaign

        backend = ray_backend("conformance", args.ray)
        return backend if isinstance(backend, int) else campaign.run(args, backend)
    with tempfile.TemporaryDirectory(prefix="cbverify-conformance-") as tmp:
        argv = suite_argv(Path(tmp), args.model, args.examples, args.engines, args.option, args.keyword,
                          args.markdown.resolve())  # fmt: skip
        code = pytest.main(argv)
    print(f"conformance report: {args.markdown}")
    return 0 if code == pytest.ExitCode.OK else 1
