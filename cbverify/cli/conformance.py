"""``cbverify conformance``: the conformance suite (:mod:`cbverify.conformance`, a pytest plugin) on the named engines,
its property x engine table written as Markdown (versions, the reason of each NOT-APPLICABLE, the assertion and repro
command of each FAIL). The same run as ``pytest --pyargs cbverify.conformance --cbverify-engine NAME ...``, kept apart
from the pytest configuration of the directory it is started in. Exit 0 when no property fails."""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from cbverify.cli import held_stderr, integer, refuse


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


def run(args: argparse.Namespace) -> int:
    import pytest

    import cbverify.conformance
    from cbverify.checkpoint import preflight

    if args.markdown.is_dir() or not args.markdown.resolve().parent.is_dir():
        return refuse("conformance", f"--markdown {args.markdown}: a folder, or its folder does not exist")
    try:
        with held_stderr():
            preflight(args.model)
    except (ValueError, FileNotFoundError) as err:
        return refuse("conformance", err)
    package = Path(cbverify.conformance.__file__).parent
    with tempfile.TemporaryDirectory(prefix="cbverify-conformance-") as tmp:
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n")  # none of the current directory's addopts, markers or conftest files
        argv = ["-q", "-c", str(ini), "--rootdir", tmp, "--confcutdir", str(package), "-p", "no:cacheprovider",
                "--pyargs", "cbverify.conformance", "--cbverify-model", args.model, "--cbverify-examples",
                str(args.examples), "--cbverify-report", str(args.markdown.resolve())]  # fmt: skip
        for engine in args.engines:
            argv += ["--cbverify-engine", engine]
        for option in args.option:
            argv += ["--cbverify-option", option]
        if args.keyword:
            argv += ["-k", args.keyword]
        code = pytest.main(argv)
    print(f"conformance report: {args.markdown}")
    return 0 if code == pytest.ExitCode.OK else 1
