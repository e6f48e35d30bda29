"""``cbverify report`` and the standalone repro of every registered upstream finding.

Default run (cheap): every finding of ``FINDINGS`` and ``ENV_FINDINGS`` has a script that imports nothing but torch,
transformers, trl, datasets (vLLM where vLLM is the subject) and the standard library, reads no file of the
repository, and has the shape a regression test is generated from; a report has every section, pastes what the repro
printed and says plainly when it was not run; the CLI writes it and refuses bad input; one cheap repro runs for real.

Slow (``-m slow``): every repro runs, copied into a scratch folder, with the interpreter of a stack its typed range
includes (the pinned venv, else a matching ``.matrix-venvs/`` venv, else the vLLM environment; skipped with the reason
where none exists) and must exit 1; two generated regression tests (TRL's style and transformers') run under pytest on
the pinned stack and must fail.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cbverify.cli import main as cli_main
from cbverify.upstream import issue_report
from cbverify.upstream.env_findings import ENV_FINDINGS
from cbverify.upstream.findings import FINDINGS, SCRIPTS

REPO = Path(__file__).resolve().parents[1]
ALLOWED = {"torch", "transformers", "trl", "datasets"}
SECTIONS = ("## Environment", "## What the documentation / contract says", "## What happens instead",
            "## Expected vs observed (from running the repro)", "## Affected and unaffected releases",
            "## Standalone repro", "## Proposed regression test")  # fmt: skip
ALL = [*FINDINGS, *ENV_FINDINGS]
# what may point a script at the checkout: the old bundled-model lookup and any path built from the script's place
REPO_READS = re.compile(r"golden|_models|\.parents\b|Path\(__file__\)|os\.path\.dirname\(__file__\)|cbverify")


def _allowed_roots(finding) -> set[str]:
    vllm_subject = getattr(finding, "env", "") == "vllm" or getattr(finding, "path", "") == "vllm"
    return ALLOWED | set(sys.stdlib_module_names) | ({"vllm"} if vllm_subject else set())


def _code_without_docstrings(tree: ast.Module) -> str:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            body[0] = ast.Pass()
    return ast.unparse(tree)


@pytest.mark.parametrize("finding", ALL, ids=lambda f: f.id)
def test_every_finding_has_a_standalone_script(finding):
    assert finding.script, f"{finding.id} has no standalone repro (script=)"
    path = SCRIPTS / finding.script
    assert path.is_file(), f"{finding.id}: {path} is missing"
    tree = ast.parse(path.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{finding.id}: a relative import"
            roots.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
            pytest.fail(f"{finding.id}: __import__ hides what the script imports")
    assert not roots - _allowed_roots(finding), f"{finding.id} imports {sorted(roots - _allowed_roots(finding))}"
    assert ast.get_docstring(tree), f"{finding.id}: the script states its contract in a module docstring"
    code = _code_without_docstrings(tree)
    assert not REPO_READS.search(code), f"{finding.id} reads the checkout: {REPO_READS.search(code).group(0)!r}"
    # the shape the report's regression test is generated from (main() ending in its verdict)
    where, test = issue_report.regression_test(issue_report.subject(finding.id))
    ast.parse(test)
    assert where.startswith("tests/")


def test_the_static_check_catches_a_script_that_reads_the_bundled_model():
    """The old scripts' lookup (a path built from the script's place into golden/models) is what the check refuses."""
    old = 'MODEL = Path(__file__).resolve().parents[3] / "golden" / "models" / "tiny-llama-arith"'
    assert REPO_READS.search(_code_without_docstrings(ast.parse(old)))
    assert not REPO_READS.search(_code_without_docstrings(ast.parse('"""golden: only in a docstring"""\nx = 1')))


def _tiny_subject(**overrides) -> issue_report.Subject:
    script = (SCRIPTS / "cb_reseeds_global_rng.py").read_text()
    fields = dict(id="cb-reseeds-global-rng", kind="upstream", project=issue_report.TRANSFORMERS, title="T",
                  contract="the contract", evidence="what happens", affected="5.9 to 5.24", script=script,
                  script_name="cb_reseeds_global_rng.py", typed={"transformers": ">=5.9", "trl": ""})  # fmt: skip
    return issue_report.Subject(**(fields | overrides))


def test_a_report_has_every_section_and_pastes_the_run():
    run = issue_report.RunResult(1, "expected: A\nobserved: B\n", "", 1.5, sys.executable, {"python": "3.x"})
    text = issue_report.render(_tiny_subject(), run)
    for section in SECTIONS:
        assert section in text, section
    assert "expected: A\nobserved: B" in text and "exit code **1**" in text
    assert _tiny_subject().script.strip() in text  # the repro in full
    assert "class ContinuousBatchingRegressionTest(unittest.TestCase)" in text and "@require_torch" in text
    not_run = issue_report.render(_tiny_subject(), None, python=sys.executable)
    assert "NOT run" in not_run and "exit code **" not in not_run


def test_the_releases_come_from_a_recorded_bisection_with_its_date_else_the_typed_range():
    from cbverify.upstream.bisect import recorded

    luspo = recorded()["luspo-token-level-loss-counts-padding"]["trl"]
    lines = "\n".join(issue_report.releases(issue_report.subject("luspo-token-level-loss-counts-padding")))
    assert f"measured {luspo['measured']}" in lines and f"first good {luspo['after']}" in lines
    typed = "\n".join(issue_report.releases(issue_report.subject("cb-reseeds-global-rng")))
    assert "typed range (no bisection recorded): `>=5.9`" in typed
    unscorable = recorded()["unscorable-completion-scored-as-zero"]["trl"]["commit"]  # a real TRL checkout's
    lines = "\n".join(issue_report.releases(issue_report.subject("unscorable-completion-scored-as-zero")))
    assert f"fixed by `{unscorable['sha']}` ({unscorable['subject']})" in lines, lines


def test_the_regression_test_asserts_the_repro_s_own_verdict():
    """TRL's style: a TrlTestCase method whose assertion is the negation of the repro's `return 1 if BAD else 0`."""
    item = issue_report.subject("cb-discards-sampler-logprobs")
    main = next(n for n in ast.parse(item.script).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    bad = ast.unparse(main.body[-1].value.test)
    where, test = issue_report.regression_test(item)
    assert where == "tests/test_grpo_trainer.py"
    assert "class TestGRPOTrainer(TrlTestCase):" in test and "from .testing_utils import TrlTestCase" in test
    assert f"assert not ({bad})" in test
    assert "_TMP" not in test and "sys.exit" not in test and "self.tmp_dir" in test


def test_a_script_without_the_verdict_shape_is_refused():
    with pytest.raises(issue_report.NotGeneratable, match="must end in"):
        issue_report.regression_test(_tiny_subject(script="def main() -> int:\n    x = 1\n    return x\n"))


def test_the_cli_writes_the_report_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "r.md"
    assert cli_main(["report", "cb-forces-train-mode", "--no-run", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# [trl] ") and all(s in text for s in SECTIONS) and "NOT run" in text
    assert cli_main(["report", "no-such-finding", "--no-run"]) == 2
    assert "no upstream finding 'no-such-finding'" in capsys.readouterr().err
    assert cli_main(["report", "--no-run"]) == 2
    assert cli_main(["report", "--from-fail", str(tmp_path / "missing.json"), "run_completes"]) == 2
    assert "no file" in capsys.readouterr().err


def test_a_fuzz_finding_gets_its_script_from_the_fuzz_package_or_a_clear_refusal(tmp_path, capsys):
    from cbverify.fuzz.findings import BATCH_FINDINGS, FUZZ_FINDINGS

    finding = (*FUZZ_FINDINGS, *BATCH_FINDINGS)[0]
    code = cli_main(["report", finding.id, "--no-run", "--out", str(tmp_path / "f.md")])
    if code == 0:
        text = (tmp_path / "f.md").read_text()
        assert "# [transformers] " in text and "## Standalone repro" in text
        # its script has no main() to lift: the generated test runs it and asserts exit 0
        assert "## Proposed regression test (`tests/generation/test_continuous_batching.py`)" in text
        assert "self.assertEqual(proc.returncode, 0" in text
    else:
        assert code == 2 and f"no standalone repro for fuzz finding {finding.id}" in capsys.readouterr().err


def test_one_cheap_repro_runs_from_a_scratch_folder_and_reports_the_behaviour():
    """transformers' greedy generate_batch reseeds the global RNG on the pinned 5.24 (typed >=5.9): exit 1."""
    finding = next(f for f in FINDINGS if f.id == "cb-reseeds-global-rng")
    assert finding.on_installed_version()
    run = issue_report.run_repro(issue_report.subject(finding.id), timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr[-2000:]
    assert "expected:" in run.stdout and "observed: the global torch RNG state is replaced" in run.stdout


# ---------------------------------------------------------------------------------------------------- slow: run all
def _venvs() -> dict[str, tuple[str, str]]:
    """``.matrix-venvs/`` pythons by (transformers, trl) version ('pinned' trl = 1.16.0)."""
    found = {}
    for folder in sorted((REPO / ".matrix-venvs").glob("transformers-*_trl-*")):
        m = re.fullmatch(r"transformers-(.+)_trl-(.+)", folder.name)
        python = folder / "bin" / "python"
        if m and python.is_file():
            found[str(python)] = (m.group(1), "1.16.0" if m.group(2) == "pinned" else m.group(2))
    return found


def _python_for(finding) -> tuple[str | None, str]:
    """An interpreter whose stack the finding's typed range includes, and where it comes from."""
    from packaging.specifiers import SpecifierSet

    if getattr(finding, "env", ""):
        python = issue_report.default_python(issue_report.subject(finding.id))
        return (python, f"the {finding.env} environment") if Path(python).is_file() else (None, "")
    if getattr(finding, "path", "") == "vllm":
        python = REPO / ".engine-envs" / "vllm" / "bin" / "python"
        return (str(python), "the vllm environment") if python.is_file() else (None, "")
    if finding.on_installed_version():
        return sys.executable, "the pinned venv"
    from packaging.version import Version

    tf_range, trl_range = SpecifierSet(finding.transformers or ">=0"), SpecifierSet(finding.trl or ">=0")
    inside = [(python, tf, trl) for python, (tf, trl) in _venvs().items() if tf in tf_range and trl in trl_range]
    if not inside:
        return None, ""
    # the pinned transformers first, then the newest releases: the stack nearest the pinned one
    python, tf, trl = max(inside, key=lambda c: (c[1] == "5.24.0", Version(c[1]), Version(c[2])))
    return python, f".matrix-venvs transformers {tf} + trl {trl}"


@pytest.mark.slow
@pytest.mark.parametrize("finding", ALL, ids=lambda f: f.id)
def test_every_repro_exits_1_on_a_stack_its_range_includes(finding):
    python, where = _python_for(finding)
    if python is None:
        pytest.skip(f"{finding.id}: no interpreter here on a stack in its range (transformers "
                    f"{getattr(finding, 'transformers', '') or 'any'}, trl {getattr(finding, 'trl', '') or 'any'}; "
                    f"{finding.affected})")  # fmt: skip
    run = issue_report.run_repro(issue_report.subject(finding.id), python, timeout=900)
    assert run.returncode == 1, f"{finding.id} on {where}: exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    assert "expected:" in run.stdout and "observed:" in run.stdout


TRL_TESTING_UTILS = """import pytest


class TrlTestCase:
    @pytest.fixture(autouse=True)
    def set_tmp_dir(self, tmp_path):
        self.tmp_dir = str(tmp_path)
"""  # TRL's tests/testing_utils.py TrlTestCase, as TRL writes it


@pytest.mark.slow
@pytest.mark.parametrize("finding_id", ["cb-discards-sampler-logprobs", "cb-reseeds-global-rng"])
def test_the_generated_regression_test_fails_on_the_affected_release(finding_id, tmp_path):
    where, source = issue_report.regression_test(issue_report.subject(finding_id))
    package = tmp_path / "tests"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "testing_utils.py").write_text(TRL_TESTING_UTILS)
    (package / Path(where).name).write_text(source)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           str(package / Path(where).name)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 1 and "1 failed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "observed:" in proc.stdout  # the failure message is the repro's observation
