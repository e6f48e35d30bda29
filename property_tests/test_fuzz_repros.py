"""Every registered transformers-CB fuzz finding has a standalone repro script (``repro.standalone_script``) that a
transformers maintainer can run as it is: it imports only torch, transformers and the standard library, reads no file
(the model is built in it), and exits 1 while the finding is there, 0 once it is gone, 2 on an unexpected error.

The static checks and one script run are in the default run (~10 s); every finding's script run on the installed
transformers (exit 1 exactly inside the finding's typed range) and in the newest cached venv of an affected older
release (``.matrix-venvs/``, exit 1) are slow."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from cbverify import data
from cbverify.fuzz import repro
from cbverify.fuzz.case import FuzzCase, FuzzRequest, Step
from cbverify.fuzz.findings import FUZZ_FINDINGS
from cbverify.upstream.findings import transformers_in

ALLOWED = {"torch", "transformers"}  # and the standard library, less what reaches files, processes or the network
NO_FILES = {"os", "pathlib", "io", "shutil", "glob", "tempfile", "pickle", "shelve", "marshal", "subprocess",
            "importlib", "runpy", "pkgutil", "zipfile", "tarfile", "urllib", "http", "socket", "ctypes", "mmap",
            "fileinput", "linecache", "sqlite3", "dbm", "codecs", "builtins"}  # fmt: skip
# calls that read a file (or run code that could): by name, or as an attribute (``x.from_pretrained``)
READS = {"open", "exec", "eval", "compile", "__import__", "from_pretrained", "from_json_file", "read_text",
         "read_bytes", "load", "load_file", "safe_open", "fromfile", "loadtxt", "listdir", "scandir", "iterdir",
         "import_module", "get_data"}  # fmt: skip
BY_ID = {f.id: f for f in FUZZ_FINDINGS}
CHEAP = "cb-leaves-model-in-eval-mode"  # one greedy call of 2 tokens: the default run's real script run


def outside_the_standalone_set(source: str) -> list[str]:
    """Why ``source`` is not standalone: every import of a module other than torch, transformers or the standard
    library (less :data:`NO_FILES`), every call of a name in :data:`READS`, and every string constant naming a path
    that exists here (a checkpoint by absolute path)."""
    why = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["." * node.level + (node.module or "")]
        for name in names:
            top = name.split(".")[0]
            if not (top in ALLOWED or (top in sys.stdlib_module_names and top not in NO_FILES)):
                why.append(f"line {node.lineno}: imports {name}")
        if isinstance(node, ast.Call):
            called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if called in READS:
                why.append(f"line {node.lineno}: calls {called}()")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "/" in node.value:
            if len(node.value) < 4096 and "\n" not in node.value and _exists(node.value):
                why.append(f"line {node.lineno}: names the path {node.value!r}")
    return why


def _exists(text: str) -> bool:
    """``text`` names a path on disk (a text with a component longer than the file system allows names none: a
    finding's evidence quoted by its script, ``continuous_batching/scheduler.py`` in a long sentence)."""
    try:
        return Path(text).exists()
    except OSError:
        return False


def test_the_static_check_catches_an_import_a_file_read_and_a_path_on_disk():
    clean = "import json, sys\nimport torch\nfrom transformers import AutoConfig\nx = json.loads('{}')\n"
    assert outside_the_standalone_set(clean) == []
    here = str(Path(__file__).resolve())
    planted = {"import cbverify": "imports cbverify", "from reference.spec import X": "imports reference.spec",
               "import os": "imports os", "from . import x": "imports .", "open('x')": "calls open()",
               "m = AutoModelForCausalLM.from_pretrained(P)": "calls from_pretrained()",
               f"P = {here!r}": "names the path"}  # fmt: skip
    for line, why in planted.items():
        found = outside_the_standalone_set(clean + line + "\n")
        assert len(found) == 1 and why in found[0], (line, found)


@pytest.mark.parametrize("finding", FUZZ_FINDINGS, ids=lambda f: f.id)
def test_every_fuzz_findings_script_needs_only_torch_and_transformers_and_reads_no_file(finding):
    script = repro.standalone_script(finding)
    assert outside_the_standalone_set(script) == [], finding.id
    assert re.search(r"^CASE = json\.loads\((.+)\)$", script, re.M), "the case is not written out"
    written = json.loads(ast.literal_eval(re.search(r"^CASE = json\.loads\((.+)\)$", script, re.M)[1]))
    assert FuzzCase.from_json(written) == finding.repro, "the script runs another case than the finding's repro"
    assert f"CHECKS = {finding.checks!r}" in script


def test_every_transformers_cb_fuzz_script_is_standalone_the_fuzzer_written_ones_too():
    """``cbverify fuzz`` writes its new failures through the same templates: a manager and a generate_batch case on
    each bundled checkpoint's architecture are standalone too."""
    from reference.models import BUNDLED

    request = FuzzRequest("r", (1, 5, 7), 2, (2,))
    for model in BUNDLED:
        for entry in ("manager", "generate_batch"):
            case = FuzzCase("transformers-cb", model, False, {"page_size": 4}, {"do_sample": False},
                            (Step("call", (request,)),), entry=entry)  # fmt: skip
            assert outside_the_standalone_set(repro.script_text(case, "tokens")) == [], (model, entry)


def run_script(python: str, script: str, tmp_path: Path) -> tuple[int, str, float]:
    path = tmp_path / "repro.py"
    path.write_text(script)
    start = time.perf_counter()
    done = subprocess.run([python, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - start


def reproduced(finding, output: str) -> list[str]:
    return [c for c in finding.checks if f"\n{c}: REPRODUCED" in output]


def test_a_fuzz_findings_script_reproduces_it_in_a_bare_process(tmp_path):
    """One script for real in the default run, in another folder with a bare environment."""
    finding = BY_ID[CHEAP]
    code, out, _ = run_script(sys.executable, repro.standalone_script(finding), tmp_path)
    assert (code, reproduced(finding, out)) == (1, ["state:training-mode"]), out


@pytest.mark.slow
def test_a_script_that_cannot_build_its_model_exits_2_not_1(tmp_path):
    """An error of the script's own (here an architecture the installed transformers does not know, as an older
    release would lack a newer one) is exit 2, never read as the failure (Python's own exit code for it is 1)."""
    finding = BY_ID[CHEAP]
    script = repro.standalone_script(finding)
    broken = script.replace('"model_type": "llama"', '"model_type": "no-such-architecture"', 1)
    assert broken != script
    code, out, _ = run_script(sys.executable, broken, tmp_path)
    assert code == 2 and "unexpected error" in out and "no-such-architecture" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("finding", FUZZ_FINDINGS, ids=lambda f: f.id)
def test_every_fuzz_findings_script_fails_exactly_inside_its_range(finding, tmp_path):
    """On the installed transformers (the pinned 5.24.0): exit 1 where the finding's typed range includes it, naming
    one of its checks, else 0 (the fixed side)."""
    import transformers

    code, out, seconds = run_script(sys.executable, repro.standalone_script(finding), tmp_path)
    expected = 1 if transformers_in(finding.transformers) else 0
    seen = f"transformers {transformers.__version__}: exit {code}, expected {expected} ({seconds:.0f} s)"
    assert code == expected, f"{seen}\n{out}"
    assert bool(reproduced(finding, out)) == bool(expected), out


def affected_venv(finding) -> Path | None:
    """The newest cached venv (``.matrix-venvs/transformers-X_trl-pinned``) whose transformers is older than the
    installed one and inside the finding's range, or ``None``."""
    import transformers

    found = []
    for venv in data.workdir("matrix-venvs").glob("transformers-*_trl-pinned"):
        version = Version(venv.name.removeprefix("transformers-").removesuffix("_trl-pinned"))
        if (venv / "bin" / "python").exists() and version < Version(transformers.__version__):
            if version in SpecifierSet(finding.transformers):
                found.append((version, venv))
    return max(found)[1] if found else None


@pytest.mark.slow
@pytest.mark.parametrize("finding", FUZZ_FINDINGS, ids=lambda f: f.id)
def test_every_fuzz_findings_script_reproduces_on_an_affected_older_release(finding, tmp_path):
    venv = affected_venv(finding)
    if venv is None:
        pytest.skip(f"no cached venv of a release in {finding.transformers!r} older than the installed one")
    code, out, seconds = run_script(str(venv / "bin" / "python"), repro.standalone_script(finding), tmp_path)
    assert code == 1 and reproduced(finding, out), f"{venv.name}: exit {code} ({seconds:.0f} s)\n{out}"
