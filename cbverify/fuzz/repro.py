"""Writing a shrunk failure as a standalone Python script (the checkpoint by absolute path) and a JSON record
(versions, configuration, case). The script exits 1 while the failure is there, 0 once it is gone.

Scripts are written from one template per engine and entry point (:data:`TEMPLATES`): ``transformers-cb`` cases (the
fuzzer's upstream target; torch and transformers only, the oracle written out) through the manager's request API or
``model.generate_batch``, and ``cb_impl`` cases (our engine's ``LLMEngine`` with the case's ``EngineConfig``, judged
against the ``reference`` oracle as :mod:`cbverify.fuzz.judge` does; no import of cbverify). The JSON record is
written for every engine.
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
CB_IMPL_TEMPLATE = Path(__file__).with_name("repro_cb_impl_template.py.txt")
TEMPLATES = {("transformers-cb", "manager"): TEMPLATE, ("transformers-cb", "generate_batch"): BATCH_TEMPLATE,
             ("cb_impl", "manager"): CB_IMPL_TEMPLATE}  # fmt: skip


def versions() -> dict:
    import torch
    import transformers
    import trl

    import cbverify

    return {"cbverify": cbverify.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__,
            "python": platform.python_version()}  # fmt: skip


def script_text(case: FuzzCase, check: str, detail: str = "") -> str:
    """The repro script of ``case`` failing ``check`` (``detail``: what the fuzzer saw, quoted by the script)."""
    template = TEMPLATES.get((case.engine, case.entry))
    if template is None:
        raise ValueError(f"no repro script for {case.engine!r} cases (entry {case.entry!r}): only {sorted(TEMPLATES)}")
    return template.read_text().format(
        check=check,
        checkpoint=str(resolve(case.model).resolve()),
        case_json=case.dumps(),
        tol=FP32.logprob_max_abs,
        relax=BOUNDARY_RELAX,
        near_tie=FP32.near_tie_gap,
        detail=detail,
    )


def write(out: Path, case: FuzzCase, check: str, detail: str, finding: str | None) -> list[Path]:
    """``<out>/<engine>-<check>[-<finding>].json``, and ``.py`` where :data:`TEMPLATES` has the case's engine and
    entry point (transformers-cb, cb_impl); returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    entry = "-generate_batch" if case.entry == "generate_batch" else ""
    stem = f"{case.engine}{entry}-{check.replace(':', '-')}" + (f"-{finding}" if finding else "")
    record = {"check": check, "detail": detail, "finding": finding, "versions": versions(), "case": case.to_json()}
    paths = [out / f"{stem}.json"]
    paths[0].write_text(json.dumps(record, indent=1, sort_keys=True))
    if (case.engine, case.entry) in TEMPLATES:
        paths.append(out / f"{stem}.py")
        paths[1].write_text(script_text(case, check, detail))
    return paths
