"""A bench run leaves a record per case the moment the case ends, time-boxes every case, survives SIGTERM with a
report, and its report can be rebuilt from the logs at any time (``cbverify.bench.timebox``).

The end-to-end tests run ``cbverify bench`` itself on the CPU bench model with the smallest sizes (``--n 1 2 3`` of the
gsm8k-like workload: 2 to 6 requests, one engine) and slow one case down with the worker's test hook
(``CBVERIFY_BENCH_SLOW_FORWARD``: a sleep before each model forward of that case's timed run), so the case really
makes progress and really outlives its box, whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cbverify.bench import report
from cbverify.bench.timebox import DEFAULTS, MIN_BOX_S, Budget, TimeBoxes, cut_text

REPO = Path(__file__).resolve().parents[1]
REPORT_FILES = ("results.json", "results.md", "throughput.png", "memory.png")
CLI = "import sys; from cbverify.cli import main; sys.exit(main())"  # `cbverify` in this interpreter
BENCH = [sys.executable, "-c", CLI, "bench", "--workload", "gsm8k-like", "--engines", "cb_impl", "--rounds", "1",
         "--no-grpo", "--threads", "1"]  # fmt: skip


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_case_s_box_is_its_fair_share_of_the_budget_capped_by_the_case_timeout_and_none_when_it_is_spent():
    clock = FakeClock()
    budget = Budget(TimeBoxes(30.0, 20.0, 100.0), cases=10, workers=2, clock=clock, stream=open(os.devnull, "w"))
    # 100 s for 10 cases and 2 worker starts not yet measured (10 s each): (100 - 20) / 10 = 8 s, under the 30 s cap
    assert budget.case_box() == pytest.approx(8.0)
    assert budget.start_box() == pytest.approx(20.0), "a start gets its own box while the budget has it"
    budget.spawning()
    budget.started(4.0)  # measured starts replace the guess: one left at 4 s
    clock.now = 10.0
    for _ in range(5):
        budget.case_done("case", "ok")
    assert budget.case_box() == pytest.approx((90.0 - 4.0) / 5)
    budget.restart()  # a fresh worker for the cases after a cut one: its start is reserved too
    assert budget.case_box() == pytest.approx((90.0 - 2 * 4.0) / 5)
    budget.spawning()
    assert budget.workers_left == 1
    clock.now = 99.5  # half a second left: not enough for a case, nor a start
    assert budget.case_box() is None and budget.start_box() is None
    clock.now = 98.0  # 2 s left for 5 cases: each gets at least MIN_BOX_S, never more than what is left
    assert MIN_BOX_S <= budget.case_box() <= 2.0
    uncapped = Budget(TimeBoxes(None, None, None), cases=3, workers=1, clock=clock)
    assert uncapped.case_box() == float("inf") and uncapped.worst_case_s() == float("inf")


def test_the_default_cuda_run_is_bounded_at_8_minutes_and_its_bound_is_printed():
    """``cbverify bench --device cuda`` with every default: the matrix (3 workloads x 4 N x 3 engines, one round on
    CUDA) and the GRPO step (2 workloads x 3 paths x 3 N, one round) in 15 worker processes, 54 cases. Every case at
    its box after a fresh start would take hours; the default time budget bounds the run, and the bound printed at
    its start (from the parent's clock) leaves 30 s of the 8 minutes for the parent's own start-up."""
    from cbverify.bench import grpo_suite, suite
    from cbverify.bench.grpo_step import DEFAULT_PATHS, GrpoConfig
    from cbverify.cli import build_parser
    from cbverify.cli.bench import GRPO_NS, ROUNDS

    args = build_parser().parse_args(["bench", "--device", "cuda"])
    assert args.rounds is None and args.grpo_rounds is None and args.case_timeout is None and args.grpo
    rounds, grpo_rounds = ROUNDS["cuda"]
    matrix = suite.SuiteConfig(device="cuda", workloads=tuple(args.workload), ns=tuple(args.n),
                               engines=tuple(args.engines), rounds=rounds)  # fmt: skip
    grpo = GrpoConfig(device="cuda", ns=GRPO_NS, rounds=grpo_rounds, paths=DEFAULT_PATHS)
    (m_cases, m_workers), (g_cases, g_workers) = suite.matrix_size(matrix), grpo_suite.grpo_size(grpo)
    assert (m_cases, m_workers, g_cases, g_workers) == (36, 9, 18, 6)
    boxes = TimeBoxes.for_device("cuda")
    assert boxes == TimeBoxes(**DEFAULTS["cuda"])
    budget = Budget(boxes, cases=m_cases + g_cases, workers=m_workers + g_workers)
    every_box = (m_cases + g_cases) * (boxes.start_timeout_s + boxes.case_timeout_s)
    assert every_box > 2 * 3600, "without the budget the case boxes alone could not bound the run"
    assert budget.worst_case_s() <= 8 * 60 - 30
    assert "worst case at most 7m30s from now" in budget.plan_line("x")
    assert TimeBoxes.for_device("cpu").time_budget_s is None, "on CPU no budget: the committed runs are whole"
    assert TimeBoxes.for_device("cuda", case_timeout_s=0, time_budget_s=90).case_timeout_s is None


def test_a_cut_case_reads_as_what_it_had_done():
    timeout = {"status": "timeout", "elapsed_s": 8.04, "phase": "timed", "requests_done": 3, "num_requests": 4,
               "tokens_per_s_so_far": 30.5}  # fmt: skip
    assert cut_text(timeout) == "timeout after 8s: 3/4 requests, 30 tok/s so far"
    assert cut_text(timeout | {"phase": "warmup", "requests_done": None, "tokens_per_s_so_far": None}) == (
        "timeout after 8s: ?/4 requests, 0 tok/s so far (still in the warm-up)"
    )
    start = cut_text({"status": "timeout", "elapsed_s": 120, "phase": "start"})
    assert start == "timeout after 120s: in the worker's start (imports, model load)"
    assert cut_text({"status": "missing"}).startswith("missing: no record")
    skipped = cut_text({"status": "skipped", "reason": "the time budget was spent before this case"})
    assert skipped == "skipped: the time budget was spent before this case"
    grpo = {"status": "timeout", "elapsed_s": 30.0, "steps_done": 2, "steps": 5, "phase": "steps"}
    assert cut_text(grpo) == "timeout after 30s: 2/5 trainer steps"


def test_grpo_rows_cut_in_one_round_pool_the_rounds_that_ran_and_a_row_cut_in_every_round_shows_its_progress():
    from cbverify.bench.grpo_suite import pool_rounds

    ran = {"workload": "arith", "path": "cb_impl", "n": 8, "step_times_s": [9.0, 1.0, 2.0], "generation_s": None,
           "peak_memory_mb": 1.0}  # fmt: skip
    cut = {"workload": "arith", "path": "cb_impl", "n": 8, "status": "timeout", "elapsed_s": 30.0, "steps_done": 1,
           "steps": 3}  # fmt: skip
    (row,) = pool_rounds([ran, cut])
    assert row["step_s"] == 1.5 and row["cut_rounds"] == ["timeout"]
    (alone,) = pool_rounds([cut, cut | {"steps_done": 2}])
    assert alone["steps_done"] == 2
    md = report.grpo_markdown({"setup": "s", "rows": [alone | {"path": "generate"}, row]})
    assert "| 8 | generate | timeout after 30s: 2/3 trainer steps |" in md
    assert "| 8 | cb_impl | 1.50 |" in md, "no measured generate() row: no speedup, still the row"


def test_the_committed_results_rebuild_from_their_logs_byte_for_byte(tmp_path):
    """``--from-logs`` on a copy of ``bench/results/logs`` (records written before time boxes: no plan, no status)
    writes the committed ``results.json`` / ``results.md`` / PNGs again, unchanged."""
    from cbverify.cli import main

    shutil.copytree(REPO / "bench" / "results" / "logs", tmp_path / "logs")
    assert main(["bench", "--from-logs", str(tmp_path), "--threads", "1"]) == 0
    for name in REPORT_FILES:
        assert (tmp_path / name).read_bytes() == (REPO / "bench" / "results" / name).read_bytes(), name


@pytest.mark.parametrize("engine", ["hf-generate", "transformers-cb", "cb_impl"])
def test_each_engine_s_progress_counts_every_request_and_token_by_the_end_of_its_run(engine):
    """The counters a timed-out case reports: at the end of a run, every request finished and every completion token
    counted (so a count stopped midway is a count of what was done)."""
    import argparse

    from cbverify.bench.models import load_bench_model
    from cbverify.bench.worker import _CURRENT, CaseProgress, configure, counting_manager_results, run_case
    from cbverify.bench.workloads import make_requests, make_workload

    model, info = load_bench_model("random")
    workload = make_workload("gsm8k-like", 2)
    requests = make_requests(workload, vocab_size=info["vocab_size"])
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--engine", engine, "--workload", "gsm8k-like", "--n", "2", "--out", os.devnull])
    _CURRENT[:] = [progress := CaseProgress(engine, 2, requests, natural_eos=False)]
    try:
        with counting_manager_results():
            record = run_case(model, info["vocab_size"], workload, engine, args, progress)
    finally:
        _CURRENT.clear()
    snapshot = progress.snapshot()
    assert snapshot["phase"] == "timed" and snapshot["num_requests"] == len(requests) == 4
    assert snapshot["tokens_done"] == record["completion_tokens"] == sum(r.sampling.max_new_tokens for r in requests)
    assert snapshot["requests_done"] == len(requests)


# ------------------------------------------------------------------------------------------- end to end: the CLI
def _start(out: Path, *args: str, slow: str) -> tuple[subprocess.Popen, Path]:
    env = os.environ | {"CBVERIFY_BENCH_SLOW_FORWARD": slow, "PYTHONPATH": str(REPO)}
    err = out.parent / f"{out.name}.stderr"
    with open(err, "w") as stream:
        proc = subprocess.Popen([*BENCH, "--out", str(out), *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=stream)  # fmt: skip
    return proc, err


def _records(out: Path) -> list[dict]:
    path = out / "logs" / "gsm8k-like-cb_impl-r0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _rebuilds_identically(out: Path, tmp_path: Path) -> None:
    """``cbverify bench --from-logs OUT`` writes the report the run wrote, byte for byte."""
    from cbverify.cli import main

    written = {name: (out / name).read_bytes() for name in REPORT_FILES}
    for name in REPORT_FILES:
        (out / name).unlink()
    assert main(["bench", "--from-logs", str(out)]) == 0
    for name in REPORT_FILES:
        assert (out / name).read_bytes() == written[name], f"{name} rebuilt from the logs differs from the run's"


@pytest.fixture(scope="module")
def timed_out_run(tmp_path_factory):
    """``--n 1 2 3 --case-timeout 5`` with N=2 slowed (50 ms before each forward; its 4 requests need 51, 60, 61 and
    192 tokens: ~10 s): N=1 runs, N=2 is cut at 5 s with some requests done, N=3 runs in a fresh worker. The record
    count is sampled while the run goes on."""
    out = tmp_path_factory.mktemp("timed-out") / "out"
    proc, err = _start(out, "--n", "1", "2", "3", "--case-timeout", "5", slow="cb_impl:2:0.05")
    seen: list[tuple[int, bool]] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        running = proc.poll() is None
        seen.append((len(_records(out)), running))
        if not running:
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the bench run did not end in 240 s")
    return out, proc.returncode, seen, err.read_text()


def test_records_appear_one_per_finished_case_while_the_run_is_in_progress(timed_out_run):
    out, code, seen, stderr = timed_out_run
    assert code == 0, stderr[-2000:]
    counts_while_running = {count for count, running in seen if running}
    assert {1, 2} <= counts_while_running, f"records seen while running: {sorted(counts_while_running)}"
    assert all(b - a in (0, 1) for (a, _), (b, _) in zip(seen, seen[1:], strict=False)), "more than one record at once"
    assert [r["n"] for r in _records(out)] == [1, 2, 3], "one record per case, in the order they ended"
    for i in (1, 2, 3):
        assert f"bench [{i}/3] gsm8k-like / cb_impl / N=" in stderr, "a progress line per case on stderr"
    assert "worst case at most" in stderr.splitlines()[0], "the bound is printed first"


def test_a_case_past_its_box_is_recorded_as_a_timeout_with_its_progress_and_the_run_goes_on(timed_out_run):
    out, code, _, _ = timed_out_run
    one, two, three = _records(out)
    assert one["status"] == "ok" and three["status"] == "ok", "the cases before and after the cut one are measured"
    assert two["status"] == "timeout" and two["timeout_s"] == 5.0 and 5.0 <= two["elapsed_s"] < 8.0
    assert two["phase"] == "timed" and 0 < two["requests_done"] < two["num_requests"] == 4
    assert 0 < two["tokens_done"] < 51 + 60 + 61 + 192 and two["tokens_per_s_so_far"] > 0
    md = (out / "results.md").read_text()
    cell = f"| 2 | cb_impl | timeout after {two['elapsed_s']:.0f}s: {two['requests_done']}/4 requests, "
    assert cell in md and "tok/s so far |" in md
    result = json.loads((out / "results.json").read_text())
    assert [c.get("status") for c in sorted(result["cases"], key=lambda c: c["n"])] == ["ok", "timeout", "ok"]
    assert result["time_boxes"]["case_timeout_s"] == 5.0


def test_from_logs_rebuilds_the_report_the_run_wrote(timed_out_run, tmp_path):
    out, *_ = timed_out_run
    _rebuilds_identically(out, tmp_path)


def test_a_run_stopped_by_sigterm_keeps_its_finished_cases_and_leaves_a_rebuildable_report(tmp_path):
    """SIGTERM while N=2 (slowed: ~75 s) is in its timed run: the parent kills the worker, records N=2 as
    interrupted with its progress, writes the report and exits 143."""
    out = tmp_path / "out"
    proc, err = _start(out, "--n", "1", "2", slow="cb_impl:2:0.2")
    deadline, pid = time.monotonic() + 180, None
    while time.monotonic() < deadline and proc.poll() is None:
        progress = out / "logs" / "gsm8k-like-cb_impl-r0.progress"
        events = [json.loads(line) for line in progress.read_text().splitlines()] if progress.exists() else []
        timed = [e for e in events if e.get("n") == 2 and e.get("tokens_done")]
        if [r["n"] for r in _records(out)] == [1] and timed:
            pid = next(e["pid"] for e in events if e["event"] == "start")
            break
        time.sleep(0.1)
    assert pid is not None, f"N=2 never got under way: {err.read_text()[-2000:]}"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, err.read_text()[-2000:]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker is gone with its run
    one, two = _records(out)
    assert one["status"] == "ok" and two["status"] == "interrupted" and two["tokens_done"] > 0
    md = (out / "results.md").read_text()
    assert "| 1 | cb_impl |" in md and "| 2 | cb_impl | interrupted after" in md
    _rebuilds_identically(out, tmp_path)
