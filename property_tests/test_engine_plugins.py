"""Engines from outside the repository: found by entry point name or ``module:factory``, checked on the way in and
out, and judged like the built-in ones. The example engine (``examples/engine_plugin``) is installed as a package of
its own into a temporary venv and verified by name there; its deliberately broken copy fails with a readable row."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest

from cbverify.engines import Capabilities, EngineError, PluginError, get_engine, load_factory
from reference.spec import RolloutRequest, SamplingParams

REPO = Path(__file__).resolve().parents[1]
CAPS = Capabilities(spec_sampling=False, per_request_max_new_tokens=True, per_request_sampling=True,
                    per_request_eos=True, logprob_semantics="none", claims_batch_invariance=False)  # fmt: skip
REQUESTS = [RolloutRequest(f"r{i}", (1, 5, 6), SamplingParams(temperature=0.0, max_new_tokens=2)) for i in range(2)]


class _Returns:
    name, capabilities = "returns", CAPS

    def __init__(self, value) -> None:
        self.value = value

    def generate(self, requests):
        return self.value


def not_an_engine(model, **options):
    return object()


def one_rollout_short(model, **options):
    from reference.generate import generate

    return _Returns(generate(model, REQUESTS)[:1])


def dicts_not_rollouts(model, **options):
    return _Returns([{"completion_ids": [4]}] * len(REQUESTS))


def test_bad_plugins_get_errors_that_name_the_plugin_and_the_fault(llama):
    here = "property_tests.test_engine_plugins"
    with pytest.raises(ValueError, match="unknown engine 'nope'.*module:factory"):
        load_factory("nope")
    with pytest.raises(PluginError, match="could not be loaded: ModuleNotFoundError"):
        load_factory("no_such_package.engines:make")
    with pytest.raises(PluginError, match="could not be loaded: AttributeError"):
        load_factory(f"{here}:no_such_factory")
    with pytest.raises(PluginError, match="returned a object, which has no name, capabilities, generate"):
        get_engine(f"{here}:not_an_engine", llama.model)
    with pytest.raises(EngineError, match="returned 1 rollouts for 2 requests"):
        get_engine(f"{here}:one_rollout_short", llama.model).generate(REQUESTS)
    with pytest.raises(EngineError, match="returned a dict at position 0, not a reference.spec.Rollout"):
        get_engine(f"{here}:dicts_not_rollouts", llama.model).generate(REQUESTS)


class _Claims:
    """cb_impl with other claims (``capabilities``): what an engine that over-claims looks like to the suite."""

    def __init__(self, engine, **claims) -> None:
        self.name, self._engine = engine.name, engine
        self.capabilities = replace(engine.capabilities, **claims)

    def generate(self, requests):
        return self._engine.generate(requests)


def stale_snapshot(model, **options):
    """Claims to follow weight updates but samples a copy of the weights taken when it was built."""
    return _Claims(get_engine("cb_impl", copy.deepcopy(model), **options), follows_weight_updates=True)


def phantom_deviation(model, **options):
    """Declares vLLM's processor order but follows the spec's: the declaration only hides requests."""
    return _Claims(get_engine("cb_impl", model, **options), deviations=("min-p-before-top-p",))


@pytest.mark.slow  # ~30 s: a conformance run of its own in a subprocess
def test_the_suite_holds_weight_update_and_deviation_claims_to_being_true(tmp_path):
    """An engine that samples stale weights after an in-place update, and one whose declared deviation is not real,
    each FAIL the property that holds that claim, naming it (through ``cbverify conformance``, which exits 1)."""
    here = "property_tests.test_engine_plugins"
    report = tmp_path / "conformance.md"
    proc = subprocess.run([sys.executable, "-m", "cbverify", "conformance", "--engines", f"{here}:stale_snapshot",
                           f"{here}:phantom_deviation", "-k", "weight_update or declared_deviations", "--examples",
                           "5", "--markdown", str(report)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    text = report.read_text()
    assert "| after an in place weight update the next call follows the new weights | FAIL | PASS |" in text, text
    assert "| declared deviations are real | NOT-APPLICABLE | FAIL |" in text, text
    assert "declares the deviation 'min-p-before-top-p' but follows the spec there" in text, text


@pytest.fixture(scope="module")
def plugin_venv(tmp_path_factory) -> Path:
    """A venv of its own that sees our packages (a .pth file: no second torch) with the example engine installed
    into it as a package, entry points and all."""
    venv = tmp_path_factory.mktemp("plugin-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "cbverify-main.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n{REPO}\n")
    source = shutil.copytree(REPO / "examples" / "engine_plugin", venv / "src")  # the build leaves files beside it
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--no-deps", "--no-build-isolation", "--no-index", str(source)], check=True)  # fmt: skip
    return venv


def test_the_example_engine_installed_as_a_package_is_verified_by_name_and_its_broken_copy_fails(
    plugin_venv, tmp_path
):
    out = tmp_path / "report.json"
    proc = subprocess.run([str(plugin_venv / "bin" / "python"), "-m", "cbverify", "verify", "--engines",
                           "example-generate", "example-generate-broken", "--num-prompts", "2", "--max-new-tokens",
                           "8", "--json", str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row["engine"]: row for row in json.loads(out.read_text())["engines"]}
    assert rows["example-generate"]["status"] == "PASS", rows["example-generate"]
    broken = rows["example-generate-broken"]
    assert broken["status"] == "FAIL" and any("finish_reason 'length'" in p for p in broken["problems"]), broken


@pytest.mark.slow  # ~75 s: both engines through every property, 400 samples each for the distribution test
def test_the_example_engine_passes_the_conformance_suite_and_its_broken_copy_fails_readably(plugin_venv, tmp_path):
    """As another project's CI would run it: pytest's plugin from the installed cbverify, the engines by name."""
    report = tmp_path / "conformance.md"
    proc = subprocess.run([str(plugin_venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--pyargs", "cbverify.conformance", "--cbverify-engine", "example-generate",
                           "--cbverify-engine", "example-generate-broken", "--cbverify-examples", "3",
                           "--cbverify-report", str(report)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in report.read_text().splitlines() if line.startswith("| ") and "---" not in line}  # fmt: skip
    header = table.pop("property")
    assert header == ["`example-generate`", "`example-generate-broken`"], header
    good, broken = zip(*table.values(), strict=True)
    assert "FAIL" not in good and "FAIL" in broken, table
    # it claims batch invariance (one request at a time) and samples with its own RNG: both held, both hold
    for row in ("a request gives the same rollout alone and in any crowd where batch invariance is claimed",
                "own rng samples follow the processed distribution"):  # fmt: skip
        assert table[row][0] == "PASS", table
    text = report.read_text()
    assert "finish_reason 'length'" in text and "repro: `pytest --pyargs cbverify.conformance" in text, text
    assert "## Decisiveness" in text and "(judged by no engine)" not in text, text
