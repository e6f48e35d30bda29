"""``cbverify validate``: the classification of (release, checkout) verdicts as a property, the command end to end on a
synthetic "trl" (a release tree installed in a bare venv, a patched checkout beside it, fake findings with repros and
a fake upstream-checks step: no network, a few seconds), its refusals of bad input, and (slow) the real case: trl
1.9.2's sources with the luspo fix of 1.10 applied by hand, validated against 1.9.2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cbverify import data
from cbverify.cli import main
from cbverify.upstream import validate as v
from cbverify.upstream.bisect import BAD, ERROR, GOOD

REPO = Path(__file__).resolve().parents[1]
FAILING = {BAD, v.KNOWN}  # failing on the release: the behaviour is there (explained or not)
verdicts = st.sampled_from(v.VERDICTS)


@given(verdicts, verdicts)
def test_classification_of_every_pair_of_verdicts(release, checkout):
    category = v.classify(release, checkout)
    # the brief's definitions, stated independently of classify's branches
    assert (category == v.FIXED) == (release in FAILING and checkout == GOOD)
    assert (category == v.STILL) == (release in FAILING and checkout in FAILING)
    newly = (checkout == BAD and release not in FAILING) or (checkout == ERROR and release != ERROR)
    assert (category == v.NEW) == newly
    assert (category == v.UNCHANGED) == ({release, checkout} <= {GOOD, v.ABSENT})
    assert category in v.CATEGORIES


@given(st.sampled_from((GOOD, BAD)), st.sampled_from((GOOD, BAD)))
def test_a_fix_read_backwards_is_a_regression(a, b):
    assert (v.classify(a, b) == v.FIXED) == (v.classify(b, a) == v.NEW)


@given(st.lists(st.tuples(verdicts, verdicts), max_size=8))
def test_exit_code_and_report_list_exactly_the_newly_failing(pairs):
    items = [v.Item("finding", f"f{i}", v.Outcome(r), v.Outcome(c), {"checkout": f"rerun f{i}"})
             for i, (r, c) in enumerate(pairs)]  # fmt: skip
    new = [f"f{i}" for i, (r, c) in enumerate(pairs) if v.classify(r, c) == v.NEW]
    assert v.exit_code(items) == (1 if new else 0)
    text = v.render(items, ["header"])
    section = text.split("NEWLY FAILING")[1].split("NOT APPLICABLE")[0]
    listed = [ln.split()[1].rstrip(":") for ln in section.splitlines() if ln.startswith("  finding ")]
    assert listed == new
    assert v.payload(items)["counts"][v.NEW] == len(new)


def test_unknown_verdicts_are_refused():
    with pytest.raises(ValueError, match="verdicts are"):
        v.classify("pass", GOOD)


# ---------------------------------------------------------------------------------------------------- end to end
INIT = """__version__ = "{version}"
LOSS_OK = {loss_ok}
STILL_BUG = True
NEW_BUG = {new_bug}
{api}
"""
REPROS = {  # name -> (script, the finding's trl range)
    "fake-fixed": ("import sys, trl\nsys.exit(0 if trl.LOSS_OK else 1)\n", ""),
    "fake-still": ("import sys, trl\nsys.exit(1 if trl.STILL_BUG else 0)\n", ""),
    "fake-regressed": ("import sys, trl\nsys.exit(1 if trl.NEW_BUG else 0)\n", "<9"),  # outside on the release
    "fake-crashes": ("import sys, trl\nsys.exit(0 if trl.api() else 1)\n", ""),  # the checkout dropped trl.api
    "fake-transformers-only": ("import sys, transformers\nsys.exit(1)\n", ""),
}
CHECKS = """import json, sys, trl
rows = [("loss_matches_reference", "generate", "XFAIL(fake-fixed)" if not trl.LOSS_OK else "PASS"),
        ("sampler_ok", "cb", "FAIL" if trl.NEW_BUG else "PASS"),
        ("only_on_vllm", "cb", "NOT-APPLICABLE")]
out = sys.argv[sys.argv.index("--json") + 1]
json.dump({"results": [{"check": c, "path": p, "scenario": "s", "label": l, "reason": "r " + l} for c, p, l in rows]},
          open(out, "w"))
"""


def _tree(folder: Path, *, loss_ok: bool, new_bug: bool, api: bool, version: str = "9.0.0") -> Path:
    (folder / "trl").mkdir(parents=True)
    text = INIT.format(version=version, loss_ok=loss_ok, new_bug=new_bug, api="def api():\n    return True" * api)
    (folder / "trl" / "__init__.py").write_text(text)
    return folder


@pytest.fixture
def synthetic(tmp_path, monkeypatch):
    """A bare venv whose ``trl`` is a release tree (9.0.0, with metadata), a checkout that fixes one bug, adds one
    and drops an API, the fake findings and checks step wired into validate, its work folder in ``tmp_path``."""
    release = _tree(tmp_path / "release", loss_ok=False, new_bug=False, api=True)
    meta = release / "trl-9.0.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: trl\nVersion: 9.0.0\n")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "release.pth").write_text(f"{release}\n")
    checkout = _tree(tmp_path / "checkout", loss_ok=True, new_bug=True, api=False)
    scripts = tmp_path / "repros"
    scripts.mkdir()
    found = []
    for name, (text, trl_range) in REPROS.items():
        (scripts / f"{name}.py").write_text(text)
        found.append(
            (SimpleNamespace(id=name, trl=trl_range, transformers=""), "upstream", scripts / f"{name}.py", "")
        )
    found.append(
        (SimpleNamespace(id="fake-no-repro", trl="", transformers=""), "upstream", None, "no standalone repro")
    )
    monkeypatch.setattr(v, "findings_with_scripts", lambda work: iter(found))
    (tmp_path / "checks.py").write_text(CHECKS)
    monkeypatch.setattr(v, "CHECKS_COMMAND", [str(tmp_path / "checks.py")])
    monkeypatch.setattr(data, "workdir", lambda name: tmp_path / "work" / name)
    monkeypatch.setenv("PYTHONPATH", str(release))  # the caller's PYTHONPATH has the release: the checkout goes first
    return SimpleNamespace(venv=venv, checkout=checkout, tmp=tmp_path)


def test_the_command_lists_fixed_still_and_newly_failing_and_exits_1(synthetic, capsys):
    out = synthetic.tmp / "validate.json"
    code = main(["validate", "--trl", str(synthetic.checkout), "--against", str(synthetic.venv), "--json", str(out)])
    text, err = capsys.readouterr()
    assert code == 1, text + err
    got = {item["id"]: item["category"] for item in json.loads(out.read_text())["items"]}
    assert got == {
        "fake-fixed": v.FIXED,
        "fake-still": v.STILL,
        "fake-regressed": v.NEW,  # passes on the release, exits 1 on the checkout
        "fake-crashes": v.NEW,  # an error on the checkout
        "fake-transformers-only": v.NA,  # its repro does not import trl: not run
        "fake-no-repro": v.NA,
        "loss_matches_reference [generate] s": v.FIXED,  # XFAIL on the release, PASS on the checkout
        "sampler_ok [cb] s": v.NEW,  # a FAIL no finding explains
        "only_on_vllm [cb] s": v.UNCHANGED,
    }
    assert "FIXED by the change (2):" in text and "STILL PRESENT (1):" in text and "NEWLY FAILING (3):" in text
    assert "outside its range (trl <9) on the release" in text
    assert f"rerun: PYTHONPATH={synthetic.checkout}" in text and "fake-regressed.py" in text
    assert "its repro does not import trl" in text and "no standalone repro" in text
    assert "[1/8] fake-fixed on the release: bad" in err and "ETA ~" in err  # progress on stderr, 4 repros x 2


def test_a_checkout_that_only_fixes_exits_0(synthetic, capsys):
    shutil.rmtree(synthetic.checkout)
    _tree(synthetic.checkout, loss_ok=True, new_bug=False, api=True)
    code = main(["validate", "--trl", str(synthetic.checkout), "--against", str(synthetic.venv)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "NEWLY FAILING (0):\n  none" in text and "finding fake-fixed: release bad, checkout good" in text


def test_a_crashed_checks_step_on_the_checkout_is_newly_failing(synthetic, capsys, monkeypatch):
    (synthetic.tmp / "checks.py").write_text(
        "import sys, trl\nif trl.NEW_BUG:\n    raise SystemExit('boom')\n" + CHECKS
    )
    code = main(["validate", "--trl", str(synthetic.checkout), "--against", str(synthetic.venv)])
    text = capsys.readouterr().out
    assert code == 1
    assert "check upstream checks: release 3 results, checkout ERROR" in text


@pytest.mark.parametrize(
    "layout, message",
    [
        (None, "does not exist"),
        ("file", "is not a folder"),
        ("transformers", "is a transformers checkout, not a trl one: use --transformers"),
        ("empty", "is not a trl source checkout"),
    ],
)
def test_a_path_that_is_not_a_trl_checkout_is_refused(tmp_path, capsys, layout, message):
    path = tmp_path / "src-tree"
    if layout == "file":
        path.write_text("")
    elif layout == "transformers":
        (path / "src" / "transformers").mkdir(parents=True)
        (path / "src" / "transformers" / "__init__.py").write_text("")
    elif layout == "empty":
        path.mkdir()
    assert main(["validate", "--trl", str(path), "--no-checks"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cbverify validate: error: ") and message in err[0]


def test_an_against_that_is_neither_a_version_nor_a_venv_is_refused(synthetic, capsys):
    assert main(["validate", "--trl", str(synthetic.checkout), "--against", "not-a-version"]) == 2
    assert main(["validate", "--trl", str(synthetic.checkout), "--against", str(synthetic.tmp)]) == 2
    err = capsys.readouterr().err
    assert "neither a version nor a venv folder" in err and "must be a venv" in err


def test_a_checkout_shadowed_by_another_copy_is_refused(synthetic, capsys, monkeypatch):
    # a checkout whose trl is not what gets imported (here: the release's tree first on the path) is bad input
    monkeypatch.setattr(v, "checkout_env", lambda root, env: {**env, "PYTHONPATH": str(synthetic.tmp / "release")})
    assert main(["validate", "--trl", str(synthetic.checkout), "--against", str(synthetic.venv)]) == 2
    assert "not from the checkout" in capsys.readouterr().err


def test_every_registered_finding_is_listed_and_runs_only_where_its_repro_imports_the_package(tmp_path):
    # the real registries: nothing is dropped, and a repro is run exactly when its script imports the package
    listed = {t.id for t in v.targets("trl", tmp_path)}
    from cbverify.fuzz.findings import BATCH_FINDINGS, FUZZ_FINDINGS
    from cbverify.upstream.env_findings import ENV_FINDINGS
    from cbverify.upstream.findings import FINDINGS

    assert listed == {f.id for f in (*FINDINGS, *ENV_FINDINGS, *FUZZ_FINDINGS, *BATCH_FINDINGS)}
    for package in ("trl", "transformers"):
        for t in v.targets(package, tmp_path):
            if t.script is not None:
                assert package in v.imports(t.script)
    trl_run = {t.id for t in v.targets("trl", tmp_path) if t.script is not None}
    assert "luspo-token-level-loss-counts-padding" in trl_run
    assert not trl_run & {f.id for f in FUZZ_FINDINGS}  # the fuzz repros use transformers alone
    transformers_run = {t.id for t in v.targets("transformers", tmp_path) if t.script is not None}
    assert {f.id for f in FUZZ_FINDINGS} <= transformers_run


# ---------------------------------------------------------------------------------------------------- the real case
VENV_192 = REPO / ".matrix-venvs" / "transformers-5.24.0_trl-1.9.2"
LUSPO_BUG = "            loss = (per_token_loss * mask.sum(1, keepdim=True)).mean()\n"
LUSPO_FIX = "            loss = (per_token_loss * mask).sum(-1).mean()\n"  # what trl 1.10.0 does


@pytest.mark.slow
@pytest.mark.skipif(not (VENV_192 / "bin" / "python").exists(), reason="needs the matrix venv of trl 1.9.2")
def test_trl_1_9_2_with_the_luspo_fix_applied_by_hand_lists_the_finding_as_fixed(tmp_path, capsys, monkeypatch):
    # three findings' repros (the whole registry's twice is the command's documented run, ~20 min here): the one fixed,
    # one the patch leaves (dapo), one outside its range on both sides (unscorable, trl < 1.6)
    kept = {"luspo-token-level-loss-counts-padding", "dapo-normaliser-is-not-the-accumulated-batch",
            "unscorable-completion-scored-as-zero"}  # fmt: skip
    every = v.findings_with_scripts
    monkeypatch.setattr(v, "findings_with_scripts", lambda work: (f for f in every(work) if f[0].id in kept))
    installed = next(VENV_192.glob("lib/python*/site-packages/trl"))
    checkout = tmp_path / "trl-1.9.2-patched"
    shutil.copytree(installed, checkout / "trl", ignore=shutil.ignore_patterns("__pycache__"))
    trainer = checkout / "trl" / "trainer" / "grpo_trainer.py"
    source = trainer.read_text()
    assert source.count(LUSPO_BUG) == 1
    trainer.write_text(source.replace(LUSPO_BUG, LUSPO_FIX))
    out = tmp_path / "validate.json"
    code = main(["validate", "--trl", str(checkout), "--against", "1.9.2", "--no-checks", "--json", str(out)])
    text = capsys.readouterr().out
    got = {item["id"]: item["category"] for item in json.loads(out.read_text())["items"]}
    assert got["luspo-token-level-loss-counts-padding"] == v.FIXED, text
    assert [i for i, c in got.items() if c == v.NEW] == [] and code == 0, text
    assert got["dapo-normaliser-is-not-the-accumulated-batch"] == v.STILL  # untouched by the patch
    assert got["unscorable-completion-scored-as-zero"] == v.NA and "outside its range (trl <1.6)" in text


def test_repro_detail_lines_skip_warnings():
    assert v._last("result 1\n  warnings.warn('x')\nFutureWarning: y") == "result 1"
    assert v._last("") == ""
