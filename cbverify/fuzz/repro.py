"""Writing a shrunk failure as a standalone Python script and a JSON record (versions, configuration, case). The
script exits 1 while the failure is there, 0 once it is gone, 2 on an unexpected error.

Scripts are written from one template per engine and entry point (:data:`TEMPLATES`):

- ``transformers-cb`` cases (the fuzzer's upstream target) through the manager's request API or
  ``model.generate_batch``: torch, transformers and the standard library only, and no file read, so a transformers
  maintainer can run them as they are. The model is built in the script (:data:`MODEL_TEMPLATE`): the bundled
  checkpoint's ``config.json`` and ``generation_config.json`` written out, every weight drawn from
  :data:`WEIGHT_SEED` (N(0, :data:`WEIGHT_STD`), norms at 1); the oracle is written out too. Each registered fuzz
  finding's script (:func:`standalone_script`) reproduces with these weights (property_tests/test_fuzz_repros.py); a
  new failure the fuzzer found with the bundled weights may need them (the JSON record names the checkpoint).
- ``cb_impl`` cases: our engine's ``LLMEngine`` with the case's ``EngineConfig``, judged against the ``reference``
  oracle as :mod:`cbverify.fuzz.judge` does; it imports ``cb_impl`` and ``reference`` (the engine under test and its
  oracle), nothing of cbverify, and loads the checkpoint by absolute path.

The JSON record is written for every engine.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cbverify.fuzz.case import PER_REQUEST_PLACEHOLDERS, FuzzCase
from cbverify.tolerances import BOUNDARY_RELAX, FP32
from reference.models import resolve

if TYPE_CHECKING:
    from cbverify.fuzz.findings import FuzzFinding

TEMPLATE = Path(__file__).with_name("repro_template.py.txt")
BATCH_TEMPLATE = Path(__file__).with_name("repro_batch_template.py.txt")
CB_IMPL_TEMPLATE = Path(__file__).with_name("repro_cb_impl_template.py.txt")
TEMPLATES = {("transformers-cb", "manager"): TEMPLATE, ("transformers-cb", "generate_batch"): BATCH_TEMPLATE,
             ("cb_impl", "manager"): CB_IMPL_TEMPLATE}  # fmt: skip
MODEL_TEMPLATE = Path(__file__).with_name("repro_model_template.py.txt")  # the model built in transformers-cb scripts
# The seeded weights of every transformers-cb script. Random weights at transformers' 0.02 leave near-uniform logits
# (greedy near-ties); at 0.14 (golden/build_models' QWEN2_INIT_STD) they are decisive. Two registered findings need the
# model to say EOS (2) within 8 greedy tokens of their repro's prompt (cb-unset-eos-disables-eos,
# cb-persistent-manager-keeps-the-first-generation-config: seeds 0 and 1 do not, and their scripts exit 0); 184 does,
# and also says the EOS cb-drops-min-new-tokens and cb-drops-min-length hold back (their log-prob checks fail with any
# seed), every greedy step on those prompts with a top-2 gap above 0.1. property_tests/test_fuzz_repros.py runs every
# finding's script.
WEIGHT_SEED, WEIGHT_STD = 184, 0.14


def versions() -> dict:
    import torch
    import transformers
    import trl

    import cbverify

    return {"cbverify": cbverify.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__,
            "python": platform.python_version()}  # fmt: skip


def model_code(name: str) -> str:
    """The script lines that build checkpoint ``name``'s architecture with the seeded weights (:data:`MODEL_TEMPLATE`):
    its config and generation config read here, at writing time, and written out as literals."""
    path = resolve(name)
    config = json.loads((path / "config.json").read_text())
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):  # float32, whatever was saved
        config.pop(key, None)
    generation = json.loads((path / "generation_config.json").read_text())
    generation.pop("transformers_version", None)
    return MODEL_TEMPLATE.read_text().format(
        model=Path(name).name,
        config_json=json.dumps(config, sort_keys=True),
        generation_json=json.dumps(generation, sort_keys=True),
        seed=WEIGHT_SEED,
        std=WEIGHT_STD,
    )


def script_text(case: FuzzCase, check: str | Sequence[str], detail: str = "") -> str:
    """The repro script of ``case`` failing ``check`` (or any of several checks: a finding's; ``detail``: what the
    fuzzer saw, quoted by the script). It exits 1 while one of the checks fails, 0 when none does, 2 when the case
    cannot be run."""
    template = TEMPLATES.get((case.engine, case.entry))
    if template is None:
        raise ValueError(f"no repro script for {case.engine!r} cases (entry {case.entry!r}): only {sorted(TEMPLATES)}")
    checks = (check,) if isinstance(check, str) else tuple(check)
    if not checks or (template == CB_IMPL_TEMPLATE and len(checks) != 1):
        raise ValueError(f"a {case.engine} repro script looks for {'one check' if checks else 'a check'}: {checks}")
    return template.read_text().format(
        build_model=model_code(case.model) if template != CB_IMPL_TEMPLATE else "",
        checks=checks,
        check=checks[0],
        checkpoint=str(resolve(case.model).resolve()),
        case_json=case.dumps(),
        tol=FP32.logprob_max_abs,
        relax=BOUNDARY_RELAX,
        near_tie=FP32.near_tie_gap,
        placeholders=PER_REQUEST_PLACEHOLDERS,
        detail=detail,
    )


def standalone_script(finding: FuzzFinding) -> str:
    """The repro script of a registered transformers-cb fuzz finding: its ``repro`` case, judged as the fuzzer does,
    exiting 1 while any of its checks fails (0 once none does, 2 on an unexpected error); it needs only torch,
    transformers and the standard library, and reads no file."""
    if finding.repro.engine != "transformers-cb":
        raise ValueError(f"finding {finding.id!r}: only transformers-cb repros are standalone, not "
                         f"{finding.repro.engine!r} ones")  # fmt: skip
    return script_text(finding.repro, finding.checks, finding.evidence)


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
