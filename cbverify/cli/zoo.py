"""``cbverify zoo``: every engine on tiny random checkpoints of many transformers architectures (coverage table).

Builds the architecture zoo (:mod:`cbverify.zoo.architectures`) in a temporary folder, runs every engine on every
architecture (:mod:`cbverify.zoo.matrix`), prints one line per cell and, with ``--markdown``, writes the coverage
table (``docs/coverage.md`` in the repo is this command's output, float32); ``--dtype bfloat16`` / ``float16`` runs the
matrix in that dtype and its tier. Exit 1 on an unregistered FAIL or a FIXED?.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from cbverify.engines import ENGINE_NAMES, LOCAL_ENGINES
from cbverify.zoo.architectures import ARCHS, by_name


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", type=Path, default=None, help="write the coverage table (Markdown) here")
    parser.add_argument("--archs", nargs="+", default=[a.name for a in ARCHS], choices=[a.name for a in ARCHS],
                        help="architectures to run (default: the whole zoo)")  # fmt: skip
    parser.add_argument("--engines", nargs="+", default=list(LOCAL_ENGINES), choices=ENGINE_NAMES,
                        help="engines to run on each architecture (default: all but those in an environment of "
                        "their own, which start a worker per checkpoint)")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model dtype; the tier follows it (cbverify.tolerances.tier_for)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny models: 1 is fastest)")


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from cbverify.zoo.matrix import render_markdown, run_matrix

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # one line per architecture instead of loader bars
    with tempfile.TemporaryDirectory(prefix="cbverify-zoo-") as directory:
        cells = run_matrix(directory, [by_name(n) for n in args.archs], args.engines, progress=True, dtype=args.dtype)
    for c in cells:
        print(f"{c.arch:12s} {c.engine:16s} {c.status:40s} {c.detail}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(render_markdown(cells, args.engines, args.dtype))
    return 0 if all(c.ok for c in cells) else 1
