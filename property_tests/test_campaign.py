"""The campaign machinery's pure parts, without Ray: resume keys, the ledger, the exactly-once merge, attempt
counting, the local backend, the fuzz database and class merge, and ``--ray`` without Ray installed (one line, exit
2). The simulated-cluster runs are ``test_campaign_ray.py`` (marker ``ray``)."""

from __future__ import annotations

import builtins
import json
import sys

import pytest

import cbverify
from cbverify.campaign import fuzz as fuzz_campaign
from cbverify.campaign.core import AttemptCounter, Ledger, Task, merge, resume_key, run_campaign
from cbverify.campaign.local import LocalBackend


def _square(x: int) -> dict:
    return {"square": x * x}


def _boom(x: int) -> dict:
    raise ValueError(f"bad {x}")


def _tasks(n: int, fn=_square) -> list[Task]:
    return [Task(f"t{i}", {"x": i}, fn, {"x": i}) for i in range(n)]


def test_resume_key_changes_with_the_pins_the_kind_and_cbverify_version(monkeypatch):
    key = resume_key("matrix", {"transformers": "5.24.0", "trl": "1.16.0"})
    assert key == resume_key("matrix", {"trl": "1.16.0", "transformers": "5.24.0"}), "key order must not matter"
    assert key != resume_key("matrix", {"transformers": "5.24.0", "trl": "1.15.0"})
    assert key != resume_key("fuzz", {"transformers": "5.24.0", "trl": "1.16.0"})
    monkeypatch.setattr(cbverify, "__version__", "99.0")
    assert key != resume_key("matrix", {"transformers": "5.24.0", "trl": "1.16.0"}), "a new cbverify reruns all"


def test_ledger_keeps_finished_tasks_skips_errors_and_cut_lines(tmp_path):
    ledger, tasks = Ledger(tmp_path, "matrix"), _tasks(3)
    ledger.record(tasks[0], {"key": "t0", "attempt": 1, "result": {"square": 0}})
    ledger.record(tasks[1], {"key": "t1", "attempt": 1, "error": "ValueError: x"})
    with ledger.path.open("a") as file:
        file.write('{"resume": "cut sho')
    done = Ledger(tmp_path, "matrix").load()
    assert list(done) == [resume_key("matrix", tasks[0].pins)]
    assert Ledger(tmp_path, "fuzz").load() == {}


def test_merge_puts_every_task_exactly_once_in_task_order():
    tasks = _tasks(3)
    stored = {"t1": {"key": "t1", "attempt": 1}}
    fresh = [{"key": "t2", "attempt": 2}, {"key": "t0", "attempt": 1}]
    assert list(merge(tasks, stored, fresh)) == ["t0", "t1", "t2"]
    with pytest.raises(ValueError, match="a second one"):
        merge(tasks, stored, [*fresh, {"key": "t0", "attempt": 2}])
    with pytest.raises(ValueError, match="a second one"):
        merge(tasks, stored, [*fresh, {"key": "t1", "attempt": 1}])
    with pytest.raises(ValueError, match="no result"):
        merge(tasks, {}, fresh)
    with pytest.raises(ValueError, match="not a task"):
        merge(tasks, stored, [*fresh, {"key": "t9", "attempt": 1}])


def test_attempt_counter_numbers_each_start_of_a_key():
    counter = AttemptCounter()
    assert [counter.next("a"), counter.next("b"), counter.next("a"), counter.next("a")] == [1, 1, 2, 3]
    assert counter.counts() == {"a": 3, "b": 1}


def test_local_campaign_runs_each_task_once_and_a_rerun_skips_what_finished(tmp_path, capsys):
    first = run_campaign(LocalBackend(jobs=2), "demo", _tasks(3), tmp_path)
    assert {k: e["result"]["square"] for k, e in first.items()} == {"t0": 0, "t1": 1, "t2": 4}
    assert all(e["attempt"] == 1 and e["node"]["id"] == "local" for e in first.values())
    again = run_campaign(LocalBackend(jobs=2), "demo", _tasks(4), tmp_path)
    assert "resuming: 3 of 4 finished before, skipped: t0, t1, t2" in capsys.readouterr().out
    assert {k: e["result"]["square"] for k, e in again.items()} == {"t0": 0, "t1": 1, "t2": 4, "t3": 9}
    assert len(Ledger(tmp_path, "demo").path.read_text().splitlines()) == 4, "the skipped tasks ran once only"


def test_a_task_that_raises_is_one_error_envelope_and_is_not_recorded(tmp_path):
    envelopes = run_campaign(LocalBackend(), "demo", _tasks(1, _boom), tmp_path)
    assert envelopes["t0"]["error"] == "ValueError: bad 0"
    assert Ledger(tmp_path, "demo").load() == {}, "a failed task must run again on resume"


def test_fuzz_database_hands_a_later_shard_what_an_earlier_one_found(tmp_path):
    db = fuzz_campaign.Database(tmp_path)
    assert db.fetch("k") == []
    db.merge("k", ["case-a", "case-b", "case-a"])
    db.merge("k", ["case-b", "case-c"])
    assert fuzz_campaign.Database(tmp_path).fetch("k") == ["case-a", "case-b", "case-c"]


def test_fuzz_summaries_merge_classes_by_check_and_finding():
    def summary(examples, classes):
        return {"engine": "e", "entry": "manager", "examples": examples, "seconds": 1.0, "explored": {"x": examples},
                "classes": classes, "decisive": {}, "failed": {}}  # fmt: skip

    rng = {"check": "state:global-rng", "finding": "f1", "not": None, "examples": 2, "detail": "d"}
    new = {"check": "tokens", "finding": None, "not": None, "examples": 1, "detail": "d"}
    merged = fuzz_campaign.merge_summaries([summary(2, [rng]), summary(3, [{**rng, "examples": 3}, new])])
    assert merged["examples"] == 5 and merged["explored"] == {"x": 5}
    assert [(c["check"], c["examples"], fuzz_campaign.verdict(c)) for c in merged["classes"]] == [
        ("state:global-rng", 5, "XFAIL(f1)"), ("tokens", 1, "FAIL")]  # fmt: skip


@pytest.mark.parametrize("argv", [
    ["matrix", "--trl", "1.16.0", "--ray", "auto"],
    ["fuzz", "--shards", "2", "--ray", "auto", "--out", "OUT"],
    ["zoo", "--archs", "llama", "--engines", "cb_impl", "--ray", "auto"],
    ["conformance", "--engines", "cb_impl", "--ray", "auto"],
])  # fmt: skip
def test_ray_flag_without_ray_installed_is_one_line_and_exit_2(argv, tmp_path, monkeypatch, capsys):
    from cbverify.cli import main

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    monkeypatch.chdir(tmp_path)
    argv = [str(tmp_path / a) if a == "OUT" else a for a in argv]
    out_flags = [] if "--out" in argv or argv[0] == "fuzz" else ["--out", str(tmp_path / "out")]
    code = main(argv + out_flags + (["--markdown", str(tmp_path / "c.md")] if argv[0] == "conformance" else []))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"cbverify {argv[0]}: error: --ray needs Ray: pip install 'cbverify[ray]'"], err


def test_fuzz_campaign_needs_an_output_folder(capsys):
    from cbverify.cli import main

    assert main(["fuzz", "--shards", "2"]) == 2
    assert "--shards / --ray need --out" in capsys.readouterr().err


def test_resume_ledger_lines_are_json_with_the_envelope(tmp_path):
    run_campaign(LocalBackend(), "demo", _tasks(1), tmp_path)
    (line,) = Ledger(tmp_path, "demo").path.read_text().splitlines()
    entry = json.loads(line)
    assert entry["resume"] == resume_key("demo", {"x": 0}) and entry["envelope"]["result"] == {"square": 0}


def test_a_shard_replays_the_databases_cases_first_and_counts_them():
    """``explore(replay=...)``: each known case runs (Hypothesis explicit examples) before the drawn ones."""
    from cbverify.checkpoint import load_checked
    from cbverify.fuzz.findings import FUZZ_FINDINGS
    from cbverify.fuzz.search import explore

    finding = next(f for f in FUZZ_FINDINGS if f.id == "cb-leaves-model-in-eval-mode")
    model = load_checked("tiny-llama-arith")
    report = explore(model, "transformers-cb", model_name="tiny-llama-arith", examples=1, replay=(finding.repro,))
    assert report.examples == 2, "the replayed case and the one drawn"
    assert "cb-leaves-model-in-eval-mode" in {c.finding for c in report.classes.values()}
