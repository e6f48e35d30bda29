"""``cbverify conformance --ray``: one task per engine; each node runs the suite on its engine in a fresh pytest
process (``python -m pytest``, the same arguments as the local run plus ``--cbverify-outcomes``) and returns the
outcomes as JSON. The driver renders the merged property x engine report with the plugin's own
:func:`~cbverify.conformance.plugin.render_report` and writes ``<out>/conformance.json`` (the outcomes, each engine's
node and attempt)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from cbverify.campaign.core import Task, run_campaign


def run_on_node(engine: str, model: str, examples: int, options: list[str], keyword: str | None) -> dict:
    """The suite on one engine, on this node: ``{"rc": pytest's exit code, "outcomes": the plugin's JSON, "tail"}``."""
    from cbverify.conformance import suite_argv

    with tempfile.TemporaryDirectory(prefix="cbverify-conformance-") as tmp:
        folder = Path(tmp)
        argv = suite_argv(folder, model, examples, [engine], options, keyword, folder / "report.md")
        outcomes = folder / "outcomes.json"
        proc = subprocess.run([sys.executable, "-m", "pytest", *argv, "--cbverify-outcomes", str(outcomes)],
                              capture_output=True, text=True)  # fmt: skip
        payload = json.loads(outcomes.read_text()) if outcomes.is_file() else None
    tail = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1:] or ["no output"]
    return {"rc": proc.returncode, "outcomes": payload, "tail": tail[0][:300]}


def tasks(args) -> list[Task]:
    options = {"model": args.model, "examples": args.examples, "options": list(args.option), "keyword": args.keyword}
    return [Task(engine, {"engine": engine, **options}, run_on_node, {"engine": engine, **options})
            for engine in dict.fromkeys(args.engines)]  # fmt: skip


def outcomes_of(envelope: dict) -> dict:
    """An engine's outcomes; a task that failed for good, or a pytest run that wrote none, is one FAIL row."""
    result = envelope.get("result") or {}
    if result.get("outcomes") is not None:
        return result["outcomes"]
    why = envelope.get("error") or f"pytest exit {result.get('rc')}: {result.get('tail')}"
    return {"outcomes": [["test_campaign_task", envelope["key"], "FAIL", why]], "declared": {}, "versions": ""}


def run(args, backend) -> int:
    """The campaign: the merged report in ``--markdown``, ``<out>/conformance.json``; exit 0 when no property
    fails and every engine's pytest run succeeded."""
    from cbverify.conformance.plugin import render_report

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        envelopes = run_campaign(backend, "conformance", tasks(args), args.out)
    finally:
        backend.close()
    parts = [outcomes_of(e) for e in envelopes.values()]
    outcomes = [row for p in parts for row in p["outcomes"]]
    declared = {engine: ds for p in parts for engine, ds in p["declared"].items()}
    versions = "; ".join(dict.fromkeys(p["versions"] for p in parts if p["versions"]))
    args.markdown.write_text(render_report(outcomes, declared, versions, args.model))
    payload = {"outcomes": outcomes, "nodes": {k: e["node"] for k, e in envelopes.items()},
               "attempts": {k: e["attempt"] for k, e in envelopes.items()},
               "seconds": {k: e["seconds"] for k, e in envelopes.items()}}  # fmt: skip
    (args.out / "conformance.json").write_text(json.dumps(payload, indent=2))
    print(f"conformance report: {args.markdown}")
    ok = all((e.get("result") or {}).get("rc") == 0 for e in envelopes.values())
    return 0 if ok and all(row[2] != "FAIL" for row in outcomes) else 1
