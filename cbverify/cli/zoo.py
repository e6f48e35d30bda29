"""``cbverify zoo``: every engine on tiny random checkpoints of many transformers architectures (coverage table).

Builds the architecture zoo (:mod:`cbverify.zoo.architectures`) in a temporary folder, runs every engine on every
architecture (:mod:`cbverify.zoo.matrix`), prints one line per cell and, with ``--markdown``, writes the coverage
table (``docs/coverage.md`` in the repo is this command's output, float32, with ``--combinations``); ``--dtype
bfloat16`` / ``float16`` runs the matrix in that dtype and its tier. ``--combinations`` also runs the feature
combinations (:mod:`cbverify.zoo.combinations`: a family's config with feature switches, verified to reach the
model), all of them or those named (a family name selects its combinations); ``--archs`` with no name runs none of
the architectures, e.g. ``cbverify zoo --archs --combinations qwen2_moe+win-alt --engines cb_impl``. Exit 1 on an
unregistered FAIL or a FIXED?.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from cbverify.cli import integer, ray_backend, ray_option, refuse
from cbverify.data import workdir
from cbverify.engines import ENGINE_NAMES, LOCAL_ENGINES
from cbverify.zoo.architectures import ARCHS, by_name


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", type=Path, default=None, help="write the coverage table (Markdown) here")
    parser.add_argument("--archs", nargs="*", default=[a.name for a in ARCHS], choices=[a.name for a in ARCHS],
                        help="architectures to run (default: the whole zoo; none with no name)")  # fmt: skip
    parser.add_argument("--combinations", nargs="*", default=None, metavar="NAME",
                        help="also run the feature combinations: all of them, or those named (a combination, or a "
                        "family for all of its combinations)")  # fmt: skip
    parser.add_argument("--engines", nargs="+", default=list(LOCAL_ENGINES), choices=ENGINE_NAMES,
                        help="engines to run on each architecture (default: all but those in an environment of "
                        "their own, which start a worker per checkpoint)")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model dtype; the tier follows it (cbverify.tolerances.tier_for)")  # fmt: skip
    parser.add_argument("--threads", type=integer(1, 1024), default=1,
                        help="torch CPU threads, 1 to 1024 (tiny models: 1 is fastest)")  # fmt: skip
    ray_option(parser, "architectures and combinations")
    parser.add_argument("--out", type=Path, default=workdir("campaigns") / "zoo",
                        help="with --ray: the campaign's results file (resume) and zoo.json "
                        "(default: %(default)s)")  # fmt: skip


def select(names: list[str]) -> tuple[list, list[tuple[str, str]]]:
    """The verified combinations named (a combination, or a family for all of its combinations; none named: all)
    and the rejected candidates among them; ``ValueError`` naming the known families for a name that is neither."""
    from cbverify.zoo.combinations import FAMILIES, combinations

    known, asked = {f.name for f in FAMILIES}, {n.split("+")[0] for n in names}
    if asked - known:
        raise ValueError(f"unknown combination family {sorted(asked - known)}; known: {', '.join(sorted(known))}")
    kept, rejected = combinations([f for f in FAMILIES if not names or f.name in asked])
    if names:

        def chosen(name: str) -> bool:
            return name in names or name.split("+")[0] in names

        kept, rejected = [a for a in kept if chosen(a.name)], [r for r in rejected if chosen(r[0])]
        missing = sorted(set(names) - known - {a.name for a in kept})
        if missing:
            raise ValueError(f"not a verified combination: {missing}; rejected: {dict(rejected)}")
    return kept, rejected


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from cbverify.zoo.matrix import render_markdown, run_matrix

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # one line per architecture instead of loader bars
    archs = [by_name(n) for n in args.archs]
    try:
        combos, rejected = select(args.combinations) if args.combinations is not None else ([], [])
    except ValueError as err:
        return refuse("zoo", err)
    if args.markdown is not None and (args.markdown.is_dir() or args.markdown.parent.is_file()):
        return refuse("zoo", f"--markdown {args.markdown}: a folder, or inside a file")
    if combos:
        print(f"{len(combos)} feature combinations ({len(rejected)} candidates rejected)", flush=True)
    if args.ray is not None:
        from cbverify.campaign import zoo as campaign

        backend = ray_backend("zoo", args.ray)
        return backend if isinstance(backend, int) else campaign.run(args, archs + combos, rejected, backend)
    with tempfile.TemporaryDirectory(prefix="cbverify-zoo-") as directory:
        cells = run_matrix(directory, archs + combos, args.engines, progress=True, dtype=args.dtype)
    for c in cells:
        print(f"{c.arch:12s} {c.engine:16s} {c.status:40s} {c.detail}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(render_markdown(cells, args.engines, args.dtype, archs + combos, rejected))
    return 0 if all(c.ok for c in cells) else 1
