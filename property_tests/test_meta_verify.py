"""``cbverify verify`` end to end on a tiny workload: a clean run exits 0 and writes its JSON / Markdown reports; an
engine swapped for a faulty adapter turns its row FAIL and the exit code non-zero (same checks as the tests), in
float32 and in bfloat16 (each in the tier of its dtype)."""

from __future__ import annotations

import json
import shutil

import pytest

from cbverify import engines as engines_module
from cbverify import report
from cbverify.cli import main
from reference import tasks
from reference.models import BUNDLED, DEFAULT_MODEL, MODELS_DIR


def _argv(tmp_path, *extra: str) -> list[str]:
    return ["verify", "--num-prompts", "1", "--max-new-tokens", "8", "--dist-samples", "60",
            "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"), *extra]  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_passes_every_engine_on_the_bundled_model_and_writes_both_reports(tmp_path, capsys, dtype):
    assert main(_argv(tmp_path, "--dtype", dtype)) == 0
    out = capsys.readouterr().out
    for field in ("torch=", "transformers=", "trl=", "device=cpu", f"dtype={dtype}"):
        assert field in out
    report = json.loads((tmp_path / "r.json").read_text())
    expected = ["reference", "cb_impl", "cb_impl[pressure]", "hf-generate", "transformers-cb"]
    assert [row["engine"] for row in report["engines"]] == [*expected, "transformers-cb[pressure]"]
    pressured = next(row for row in report["engines"] if row["engine"] == "cb_impl[pressure]")
    assert any("preemptions" in note and "chunked prefills" in note for note in pressured["notes"]), pressured
    assert all(row["status"] == "PASS" for row in report["engines"])
    assert "| reference | PASS |" in (tmp_path / "r.md").read_text()
    assert "\033[" not in out, "colour codes must only be written to a terminal"


@pytest.mark.parametrize("model", [m for m in BUNDLED if m != DEFAULT_MODEL])  # the default model: the test above
def test_verify_passes_cb_impl_under_pressure_on_every_other_bundled_checkpoint(tmp_path, model):
    """cb_impl and its pressure row (a KV cache for the longest request alone, a step budget of half the longest
    prompt) on each bundled checkpoint: tiny-qwen3-chat's chat template, two EOS ids and 2112-token vocabulary
    included; the pressure row must really chunk prompts and preempt requests."""
    argv = _argv(tmp_path, "--engines", "cb_impl", "--model", model, "--dist-samples", "0")
    assert main(argv) == 0, (tmp_path / "r.md").read_text()
    rows = {row["engine"]: row for row in json.loads((tmp_path / "r.json").read_text())["engines"]}
    assert [(row, rows[row]["status"]) for row in rows] == [("cb_impl", "PASS"), ("cb_impl[pressure]", "PASS")]
    events = dict(reversed(item.split(" ", 1)) for note in rows["cb_impl[pressure]"]["notes"] if "preemptions" in note
                  for item in note.split(", "))  # fmt: skip
    assert int(events["chunked prefills"]) > 0 and int(events["preemptions"]) > 0, rows["cb_impl[pressure]"]["notes"]


QWEN2_SMALL = ("--model", "tiny-qwen2-random", "--num-prompts", "2", "--seed", "5")


@pytest.mark.parametrize("fault", ["ShiftedLogprobs", "SharedRNG", "DroppedLastToken", "TopKAfterTopP",
                                   "CompletionOrder", "IgnoresTopK"])  # fmt: skip
def test_verify_exits_non_zero_when_an_engine_is_faulty(tmp_path, monkeypatch, fault):
    """Every faulty adapter of the pytest meta-tests is caught by the command too (own-RNG ones by its distribution
    test), on the random Qwen2, whose flatter distributions let a wrong seed or processor show in a few tokens;
    ``--seed 5`` puts the spread's combined top-k + top-p + min-p sampling on the first prompt."""
    monkeypatch.setitem(engines_module.ENGINE_MODULES, "hf-generate", ("property_tests.faulty", fault))
    assert main(_argv(tmp_path, "--engines", "hf-generate", *QWEN2_SMALL)) == 1
    rows = json.loads((tmp_path / "r.json").read_text())["engines"]
    assert [r["status"] for r in rows] == ["FAIL"], rows


@pytest.mark.parametrize("fault", ["ShiftedLogprobs", "DroppedLastToken", "CompletionOrder"])
def test_verify_catches_faulty_engines_in_bfloat16_too(tmp_path, monkeypatch, fault):
    monkeypatch.setitem(engines_module.ENGINE_MODULES, "cb_impl", ("property_tests.faulty", fault))
    argv = _argv(tmp_path, "--engines", "cb_impl", "--dist-samples", "0", "--no-pressure", "--dtype", "bfloat16")
    assert main(argv) == 1
    rows = json.loads((tmp_path / "r.json").read_text())["engines"]
    assert [r["status"] for r in rows] == ["FAIL"], rows


def test_verify_passes_a_correct_own_rng_engine(tmp_path, monkeypatch):
    monkeypatch.setitem(engines_module.ENGINE_MODULES, "hf-generate", ("property_tests.faulty", "OwnRNG"))
    assert main(_argv(tmp_path, "--engines", "hf-generate", *QWEN2_SMALL)) == 0


def _verdicts(tmp_path, fault: str, monkeypatch, *extra: str) -> dict[str, str]:
    monkeypatch.setitem(engines_module.ENGINE_MODULES, "cb_impl", ("property_tests.faulty", fault))
    main(["verify", "--engines", "cb_impl", "--num-prompts", "3", "--max-new-tokens", "32", "--dist-samples", "0",
          "--json", str(tmp_path / "r.json"), *extra])  # fmt: skip
    return {r["engine"]: r["status"] for r in json.loads((tmp_path / "r.json").read_text())["engines"]}


@pytest.mark.parametrize(
    ("fault", "options"),
    [("IgnoresTemperature", ["--no-pressure"]), ("IgnoresMinP", ["--no-pressure", "--seed", "4"]),
     ("OverrunsLimit", ["--no-pressure"]), ("GroupSharesSeed", ["--no-pressure"])],
)  # fmt: skip
def test_each_workload_dimension_catches_the_fault_only_it_exposes(tmp_path, monkeypatch, fault, options):
    """Temperatures away from 1, min-p (``--seed 4`` rotates the sampling spread onto it), completion budgets that are
    hit, GRPO groups of distinct seeds: each turns the row FAIL."""
    assert set(_verdicts(tmp_path, fault, monkeypatch, *options).values()) == {"FAIL"}


def test_without_groups_an_engine_that_shares_a_groups_seed_goes_unseen(tmp_path, monkeypatch):
    """The control for the group dimension: one sample per prompt, and no probe groups, cannot tell the seeds apart;
    the probes' groups alone can."""
    assert _verdicts(tmp_path, "GroupSharesSeed", monkeypatch, "--no-pressure", "--group-size", "1",
                     "--no-probes") == {"faulty:GroupSharesSeed": "PASS"}  # fmt: skip
    assert _verdicts(tmp_path, "GroupSharesSeed", monkeypatch, "--no-pressure", "--group-size", "1") == {
        "faulty:GroupSharesSeed": "FAIL"}  # fmt: skip


def test_several_eos_ids_catch_an_engine_that_stops_on_the_first_only(tmp_path, monkeypatch):
    two_eos = tmp_path / "two-eos"
    shutil.copytree(MODELS_DIR / "tiny-llama-arith", two_eos)
    newline = tasks.VOCAB["\n"]  # every reasoning line ends with it: a second EOS that fires early
    (two_eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [tasks.EOS_ID, newline]}))
    verdicts = _verdicts(tmp_path, "OnlyFirstEos", monkeypatch, "--no-pressure", "--no-probes", "--model",
                         str(two_eos))  # fmt: skip
    assert set(verdicts.values()) == {"FAIL"}
    assert set(_verdicts(tmp_path, "OnlyFirstEos", monkeypatch, "--no-pressure", "--no-probes").values()) == {"PASS"}
    assert set(_verdicts(tmp_path, "OnlyFirstEos", monkeypatch, "--no-pressure").values()) == {"FAIL"}  # the probes


@pytest.mark.parametrize(("fault", "mechanism"), [("CbOnlyFirstEos", "eos-later-id"),
                                                  ("CowSkippedAtTwoSharers", "cow-2-sharers"),
                                                  ("FollowerParentSeed", "follower-own-seed")])  # fmt: skip
def test_the_mechanism_probes_catch_faults_inside_cb_impl_that_the_plain_workload_misses(tmp_path, monkeypatch,
                                                                                        fault, mechanism):  # fmt: skip
    """Three faults planted in cb_impl's own mechanisms (several EOS ids, copy on write at two sharers, a group
    follower's first draw): on the trained arithmetic model the plain workload reaches none of them decisively (its
    group members draw alike, its rollouts stop on the one EOS id) and the run passes; with the probes it fails,
    and a failing request is named with the mechanism it exercised."""
    assert _verdicts(tmp_path, fault, monkeypatch, "--no-pressure", "--no-probes") == {"cb_impl": "PASS"}
    assert _verdicts(tmp_path, fault, monkeypatch, "--no-pressure") == {"cb_impl": "FAIL"}
    row = json.loads((tmp_path / "r.json").read_text())["engines"][0]
    named = [p for p in row["problems"] if p.startswith(("request ", "log-probs off")) and mechanism in p]
    assert named, row["problems"]


def test_a_mechanism_an_engine_claims_and_the_run_never_reaches_fails_the_run_and_is_named(tmp_path, capsys,
                                                                                         monkeypatch):  # fmt: skip
    """cb_impl with prefix sharing off still claims it: every row passes, the run fails on the mechanism table. Without
    the probes their mechanisms are 'not asked', and so are the pressure mechanisms without the pressure row."""
    from cbverify.cli import verify

    monkeypatch.setitem(verify.DEFAULT_ENGINE_OPTIONS, "cb_impl", verify.DEFAULT_ENGINE_OPTIONS["cb_impl"] | {
        "enable_prefix_sharing": False})  # fmt: skip
    argv = ["verify", "--engines", "cb_impl", "--num-prompts", "2", "--max-new-tokens", "8", "--dist-samples", "0",
            "--no-pressure", "--json", str(tmp_path / "r.json")]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["status"] for r in report["engines"]] == ["PASS"]
    table = {m["mechanism"]: m["status"] for m in report["mechanisms"]}
    assert table["prefix-sharing"] == "NOT REACHED by cb_impl" and table["preemption"] == "not asked: --no-pressure"
    assert "FAIL: " in out and "claimed and never reached: prefix-sharing" in out
    assert main([*argv, "--no-probes"]) == 1
    table = {m["mechanism"]: m["status"] for m in json.loads((tmp_path / "r.json").read_text())["mechanisms"]}
    assert table["group-of-2"] == "not asked: --no-probes" and table["prefix-sharing"] == "NOT REACHED by cb_impl"


def test_memory_pressure_catches_a_preemption_bug_the_roomy_cache_never_triggers(tmp_path, monkeypatch):
    verdicts = _verdicts(tmp_path, "PreemptionKeepsComputed", monkeypatch)
    assert verdicts == {"cb_impl": "PASS", "cb_impl[pressure]": "FAIL"}, verdicts


def test_a_check_that_judges_no_engine_fails_the_run_and_is_named(tmp_path, capsys, monkeypatch):
    """A distribution test with no node seen often enough for a chi-square test (a model that ends every sample at
    once would give that) judges nothing: reported as NOT-APPLICABLE with the reason, never as a PASS, and a run
    where it judged no engine exits 1 naming it. The same engine with its real test is judged and passes."""
    from cbverify.distribution import DistributionResult

    assert main(_argv(tmp_path, "--engines", "hf-generate")) == 0
    assert "every one of the 5 checks judged at least once" in capsys.readouterr().out
    monkeypatch.setattr(report, "distribution_test", lambda *a, **k: DistributionResult(1e-3, (), ()))
    assert main(_argv(tmp_path, "--engines", "hf-generate")) == 1
    out = capsys.readouterr().out
    assert "VACUOUS (judged nothing, a failure of the run): distribution" in out, out[-1500:]
    row = next(r for r in json.loads((tmp_path / "r.json").read_text())["engines"] if r["engine"] == "hf-generate")
    assert ["distribution", "NOT-APPLICABLE"] in [c[:2] for c in row["checks"]], row["checks"]
