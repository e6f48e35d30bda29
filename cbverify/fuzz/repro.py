"""Writing a shrunk failure as a standalone Python script (torch + transformers only, the checkpoint by absolute
path) and a JSON record (versions, configuration, case). The script exits 1 while the failure is there.

Scripts are written for ``transformers-cb`` cases (the fuzzer's upstream target), from the template of the case's
entry point (the manager's request API, or ``model.generate_batch``); the JSON record is written for every engine.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from cbverify.fuzz.case import FuzzCase
from cbverify.tolerances import BOUNDARY_RELAX, FP32
from reference.models import resolve

TEMPLATE = Path(__file__).with_name("repro_template.py.txt")
BATCH_TEMPLATE = Path(__file__).with_name("repro_batch_template.py.txt")


def versions() -> dict:
    import torch
    import transformers
    import trl

    import cbverify

    return {"cbverify": cbverify.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__,
            "python": platform.python_version()}  # fmt: skip


def script_text(case: FuzzCase, check: str) -> str:
    template = BATCH_TEMPLATE if case.entry == "generate_batch" else TEMPLATE
    return template.read_text().format(
        check=check,
        checkpoint=str(resolve(case.model).resolve()),
        case_json=case.dumps(),
        tol=FP32.logprob_max_abs,
        relax=BOUNDARY_RELAX,
    )


def write(out: Path, case: FuzzCase, check: str, detail: str, finding: str | None) -> list[Path]:
    """``<out>/<engine>-<check>[-<finding>].py`` (transformers-cb) and ``.json``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    entry = "-generate_batch" if case.entry == "generate_batch" else ""
    stem = f"{case.engine}{entry}-{check.replace(':', '-')}" + (f"-{finding}" if finding else "")
    record = {"check": check, "detail": detail, "finding": finding, "versions": versions(), "case": case.to_json()}
    paths = [out / f"{stem}.json"]
    paths[0].write_text(json.dumps(record, indent=1, sort_keys=True))
    if case.engine == "transformers-cb":
        paths.append(out / f"{stem}.py")
        paths[1].write_text(script_text(case, check))
    return paths
