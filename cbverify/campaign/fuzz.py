"""``cbverify fuzz --shards K`` (and ``--ray``): K searches, seeds ``--seed`` to ``--seed + K - 1``, sharing one
example database.

The database is held by the driver: ``<out>/fuzz-examples.json``, key ``engine:entry:model`` -> the JSON of every
failing case found so far (the first case of each failure class, shrunk when ``--shrink-runs`` allows). A shard is
handed the database's cases for its key when it is submitted and replays them first (Hypothesis explicit examples,
:func:`cbverify.fuzz.search.explore`'s ``replay``), so what one shard found, every later shard (and every later
campaign on the same ``--out``) runs again; the cases a shard found come back in its return value and are merged in.
Shards running at the same time start from the same database. The merged ``--json`` has the local run's fields, the
classes merged across shards by (check, finding, how unexplained), plus ``shards`` (seed, node, attempt, seconds).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from cbverify.campaign.core import Task, run_campaign

DATABASE = "fuzz-examples.json"


def run_on_node(options: dict, seed: int, known: list[str]) -> dict:
    """One shard on this node: ``{"summary", "found", "files"}`` (``found``: JSON of each class's case, shrunk when
    ``shrink_runs`` allows; ``files``: the repro scripts and records, name -> text)."""
    import torch

    from cbverify.checkpoint import load_checked
    from cbverify.fuzz import repro
    from cbverify.fuzz.case import FuzzCase
    from cbverify.fuzz.search import explore, shrink, summary

    torch.set_num_threads(1)
    model = load_checked(options["model"])
    replay = tuple(FuzzCase.from_json(json.loads(text)) for text in known)
    report = explore(model, options["engine"], model_name=options["model"], examples=options["examples"], seed=seed,
                     entry=options["entry"], replay=replay)  # fmt: skip
    found, files = [], {}
    with tempfile.TemporaryDirectory(prefix="cbverify-fuzz-") as tmp:
        for cls in report.classes.values():
            cls = shrink(model, cls, budget=options["shrink_runs"])
            found.append(cls.case.dumps())
            for path in repro.write(Path(tmp), cls.case, cls.check, cls.detail, cls.finding):
                files[path.name] = path.read_text()
    return {"summary": summary(report, options["engine"], options["entry"]), "found": found, "files": files}


class Database:
    """The driver's example database: key -> case JSON texts, loaded from and saved to ``<out>/``:data:`DATABASE`."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / DATABASE
        self.cases: dict[str, list[str]] = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def fetch(self, key: str) -> list[str]:
        return list(self.cases.get(key, []))

    def merge(self, key: str, found: list[str]) -> None:
        """Add ``found`` (new cases only, in order) and save."""
        known = self.cases.setdefault(key, [])
        known += [case for case in dict.fromkeys(found) if case not in known]
        self.path.write_text(json.dumps(self.cases, indent=1, sort_keys=True))


def merge_summaries(summaries: list[dict]) -> dict:
    """One summary of several shards: counts added, classes merged by (check, finding, not) with their examples
    added (the first shard's detail kept)."""
    merged = {**summaries[0], "examples": 0, "seconds": 0.0, "explored": {}, "classes": [], "decisive": {},
              "failed": {}}  # fmt: skip
    classes: dict[tuple, dict] = {}
    for s in summaries:
        merged["examples"] += s["examples"]
        merged["seconds"] = round(merged["seconds"] + s["seconds"], 1)
        for field in ("explored", "decisive", "failed"):
            for k, v in s[field].items():
                merged[field][k] = merged[field].get(k, 0) + v
        for c in s["classes"]:
            key = (c["check"], c["finding"], c["not"])
            classes.setdefault(key, {**c, "examples": 0})["examples"] += c["examples"]
    merged["classes"] = list(classes.values())
    return merged


def verdict(cls: dict) -> str:
    """A merged class's verdict, as :attr:`cbverify.fuzz.search.FailureClass.verdict` writes it."""
    return f"XFAIL({cls['finding']})" if cls["finding"] else f"FAIL({cls['not']})" if cls["not"] else "FAIL"


def tasks(args) -> list[Task]:
    options = {k: getattr(args, k) for k in ("engine", "entry", "model", "examples", "shrink_runs")}
    return [Task(f"seed-{seed}", {**options, "seed": seed}, run_on_node, {"options": options, "seed": seed})
            for seed in range(args.seed, args.seed + args.shards)]  # fmt: skip


def run(args, backend) -> int:
    """The campaign: merged classes printed as ``cbverify fuzz`` prints them, repro files and the database in
    ``--out``, the merged summary in ``--json``; exit 1 on an unregistered failure class (or a shard that failed)."""
    args.out.mkdir(parents=True, exist_ok=True)
    database, key = Database(args.out), f"{args.engine}:{args.entry}:{args.model}"

    def prepare(task: Task) -> dict:
        return {**task.kwargs, "known": database.fetch(key)}

    def done(envelope: dict) -> None:
        if "result" in envelope:
            database.merge(key, envelope["result"]["found"])

    try:
        envelopes = run_campaign(backend, "fuzz", tasks(args), args.out, prepare=prepare, on_done=done)
    finally:
        backend.close()
    failed = {k: e["error"] for k, e in envelopes.items() if "error" in e}
    results = [e["result"] for e in envelopes.values() if "result" in e]
    for result in results:
        for name, text in result["files"].items():
            (args.out / name).write_text(text)
    merged = merge_summaries([r["summary"] for r in results]) if results else {"examples": 0, "classes": []}
    merged["shards"] = [{"seed": int(k.removeprefix("seed-")), "node": e["node"], "attempt": e["attempt"],
                         "seconds": e["seconds"], **({"error": e["error"]} if "error" in e else {})}
                        for k, e in envelopes.items()]  # fmt: skip
    print(f"cbverify fuzz --engine {args.engine} ({args.entry}): {merged['examples']} examples over "
          f"{len(envelopes)} shards, {len(database.fetch(key))} cases in {args.out / DATABASE}")  # fmt: skip
    for cls in merged["classes"]:
        print(f"  {verdict(cls):45s} {cls['check']}: {cls['examples']} times; e.g. {cls['detail'][:160]}")
    if not merged["classes"]:
        print("  no failures")
    for k, error in failed.items():
        print(f"  shard {k}: ERROR {error}")
    if args.json is not None:
        args.json.write_text(json.dumps(merged, indent=2))
    unregistered = [c for c in merged["classes"] if c["finding"] is None]
    print(f"{len(unregistered)} unregistered failure classes")
    return 1 if unregistered or failed else 0
