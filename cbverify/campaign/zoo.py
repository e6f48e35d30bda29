"""``cbverify zoo --ray``: one task per architecture or feature combination; each node builds the tiny checkpoint in
a temporary folder of its own, runs every engine on it and returns the cells. The driver prints them and writes the
coverage Markdown as the local run does, and ``<out>/zoo.json`` with every cell and the node and attempt of each
entry."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict

from cbverify.campaign.core import Task, run_campaign


def _entry(name: str, combination: bool):
    """The zoo entry ``name``: an architecture, or a verified feature combination (rebuilt from its family)."""
    from cbverify.zoo.architectures import by_name
    from cbverify.zoo.combinations import FAMILIES, combinations

    if not combination:
        return by_name(name)
    kept, _ = combinations([f for f in FAMILIES if f.name == name.split("+")[0]])
    return next(a for a in kept if a.name == name)


def run_on_node(name: str, combination: bool, engines: list[str], dtype: str, threads: int) -> dict:
    """Every engine on one zoo entry, on this node: ``{"cells": [Cell as a dict, ...]}``."""
    import torch
    import transformers

    from cbverify.zoo.matrix import run_matrix

    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="cbverify-zoo-") as directory:
        cells = run_matrix(directory, [_entry(name, combination)], engines, dtype=dtype)
    return {"cells": [asdict(c) for c in cells]}


def tasks(args, entries: list) -> list[Task]:
    options = {"engines": list(args.engines), "dtype": args.dtype, "threads": args.threads}
    return [Task(a.name, {"entry": a.name, **options}, run_on_node,
                 {"name": a.name, "combination": bool(a.family), **options}) for a in entries]  # fmt: skip


def cells_of(envelope: dict, engines: list[str]) -> list:
    """The entry's cells; a task that failed for good is one FAIL cell per engine carrying the error."""
    from cbverify.zoo.matrix import Cell

    if "error" in envelope:
        return [Cell(envelope["key"], engine, "FAIL", f"campaign: {envelope['error']}") for engine in engines]
    return [Cell(**c) for c in envelope["result"]["cells"]]


def run(args, entries: list, rejected: list, backend) -> int:
    """The campaign: the local run's lines and Markdown, plus ``<out>/zoo.json``; exit 1 on a FAIL or FIXED?."""
    from cbverify.zoo.matrix import render_markdown

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        envelopes = run_campaign(backend, "zoo", tasks(args, entries), args.out)
    finally:
        backend.close()
    cells = [c for e in envelopes.values() for c in cells_of(e, args.engines)]
    for c in cells:
        print(f"{c.arch:12s} {c.engine:16s} {c.status:40s} {c.detail}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(render_markdown(cells, args.engines, args.dtype, entries, rejected))
    payload = {"cells": [asdict(c) for c in cells], "nodes": {k: e["node"] for k, e in envelopes.items()},
               "attempts": {k: e["attempt"] for k, e in envelopes.items()},
               "seconds": {k: e["seconds"] for k, e in envelopes.items()}}  # fmt: skip
    (args.out / "zoo.json").write_text(json.dumps(payload, indent=2))
    return 0 if all(c.ok for c in cells) else 1
