"""``cbverify matrix --ray``: one task per (transformers, trl) combination.

On the node that runs it, a combination's venv is built or reused in that node's cache (``--venv-dir`` or the node's
own :func:`cbverify.data.workdir`), in a folder named from its pins (:func:`cbverify.upstream.matrix.combo_name`), with
uv where available and pip otherwise (:func:`~cbverify.upstream.matrix.ensure_venv`); the steps write into a temporary
folder whose files come back, with the log, in the task's return value. The driver writes them into ``--out`` as the
local backend would, then the same ``matrix.json`` / ``matrix.md`` plus each combination's ``nodes`` and
``attempts``.
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

from cbverify.campaign.core import InfrastructureError, Task, run_campaign
from cbverify.data import workdir
from cbverify.upstream.matrix import combo_name, ensure_venv
from cbverify.upstream.matrix_checks import install_failed, run_combo, write_report

OPTIONS = ("model", "random_model", "path", "fuzz", "timeout", "steps")  # the flags a combination's result depends on


def run_on_node(combo: list, options: dict, venv_dir: str | None) -> dict:
    """Build or reuse the combination's venv on this node and run the steps: ``{"payload", "log", "files"}``
    (``files``: name -> text of what the steps wrote). A cache folder that cannot be made is an
    :class:`InfrastructureError` (retried on another node)."""
    cache = Path(venv_dir) if venv_dir else workdir("matrix-venvs")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InfrastructureError(f"cannot make the venv cache {cache}: {err}") from err
    name, log = combo_name(*combo), io.StringIO()
    with tempfile.TemporaryDirectory(prefix="cbverify-matrix-") as tmp:
        error = ensure_venv(cache / name, combo[0], combo[1], log)
        args = argparse.Namespace(**options)
        payload = run_combo(cache / name, args, Path(tmp), name, log) if error is None else install_failed(error)
        files = {f.name: f.read_text(errors="replace") for f in Path(tmp).iterdir() if f.is_file()}
    return {"payload": payload, "log": log.getvalue(), "files": files}


def tasks(args, combos: list[tuple[str, str | None]]) -> list[Task]:
    """One task per combination; its pins: the two versions (or checkout paths) and the options of :data:`OPTIONS`."""
    options = {k: getattr(args, k) for k in OPTIONS}
    venv_dir = str(args.venv_dir) if args.venv_dir else None
    return [Task(combo_name(*c), {"transformers": c[0], "trl": c[1], "options": options}, run_on_node,
                 {"combo": list(c), "options": options, "venv_dir": venv_dir}) for c in combos]  # fmt: skip


def payload_of(envelope: dict) -> dict:
    """A combination's payload; a task that failed for good is one ``campaign`` row carrying the error."""
    if "error" in envelope:
        error = envelope["error"]
        return {"versions": {"error": error}, "results": [{"check": "campaign", "path": "-",
                                                           "label": f"ERROR({error})", "ok": False}]}  # fmt: skip
    return envelope["result"]["payload"]


def _announce(envelope: dict) -> None:
    from tqdm import tqdm

    results = payload_of(envelope)["results"]
    bad = [r["label"] if r["check"] == "venv" else r["check"] for r in results if not r["ok"]]
    node = (envelope.get("node") or {}).get("ip", "?")
    tqdm.write(f"[{envelope['key']}] {envelope['seconds']} s on {node}, attempt {envelope['attempt']}: "
               + (f"unexpected: {bad}" if bad else "as expected"))  # fmt: skip


def run(args, combos: list[tuple[str, str | None]], backend) -> int:
    """The campaign on ``backend``: outputs in ``args.out`` as the local run writes them, exit 1 on anything
    unexpected."""
    try:
        envelopes = run_campaign(backend, "matrix", tasks(args, combos), args.out, on_done=_announce)
    finally:
        backend.close()
    for name, envelope in envelopes.items():
        result = envelope.get("result", {})
        (args.out / f"{name}.log").write_text(result.get("log", envelope.get("error", "")))
        for file, text in result.get("files", {}).items():
            (args.out / file).write_text(text)
    columns = {name: payload_of(e) for name, e in envelopes.items()}
    timings = {name: e["seconds"] for name, e in envelopes.items()}
    text, ok = write_report(args.out, columns, timings, nodes={n: e["node"] for n, e in envelopes.items()},
                            attempts={n: e["attempt"] for n, e in envelopes.items()})  # fmt: skip
    print(text)
    print(f"wrote {args.out / 'matrix.json'} and {args.out / 'matrix.md'}")
    return 0 if ok else 1
