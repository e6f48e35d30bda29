"""Checks, ratios, targets and the written report, on synthetic suite records (default run; no model, no timing)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from cbverify.bench import report
from cbverify.bench.grpo_suite import pool_rounds
from cbverify.bench.suite import (
    SuiteConfig,
    check_case,
    evaluate_targets,
    pool_matrix_rounds,
    ratios,
    read_logs,
    token_agreement,
)  # fmt: skip
from cbverify.bench.timed import ENGINES
from cbverify.bench.workloads import make_requests, make_workload

ENV = {"torch": "T", "transformers": "X", "trl": "R", "python": "3", "cpu": "cpu", "cpu_count": 2,
       "torch_threads": 2, "ram_gb": 8, "platform": "P", "device": "cpu"}  # fmt: skip
MODEL = {"model": "m", "parameters": 1, "dtype": "float32", "attn_implementation": "sdpa", "vocab_size": 4096}


def record(engine: str, n: int, tokens_per_s: float, kv: int, workload: str = "gsm8k-like") -> dict:
    requests = make_requests(make_workload(workload, n), vocab_size=4096)
    lengths = [r.sampling.max_new_tokens for r in requests]
    return {"engine": engine, "workload": workload, "n": n, "tokens_per_s": tokens_per_s, "wall_s": 1.0,
            "ttft_s": 0.1, "kv_reserved_bytes": kv, "peak_memory_mb": 100.0 + kv / 2**20, "wasted_share": 0.5,
            "overhead_per_step_ms": 1.0, "steps": 10, "completion_lengths": lengths, "memory_kind": "peak RSS",
            "finish_reasons": ["length"] * len(lengths), "model": MODEL, "env": ENV, "check_problems": []}  # fmt: skip


def test_a_sound_case_passes_its_checks_and_a_short_or_miscounted_one_does_not():
    config = SuiteConfig()
    good = record("cb_impl", 8, 1.0, 1)
    assert check_case(good, config) == []
    short = good | {"completion_lengths": [good["completion_lengths"][0] - 1] + good["completion_lengths"][1:]}
    assert any("expected" in p for p in check_case(short, config))
    stopped = good | {"finish_reasons": ["stop"] + good["finish_reasons"][1:]}
    assert check_case(stopped, config)
    missing = good | {"completion_lengths": good["completion_lengths"][1:]}
    assert "completions for" in check_case(missing, config)[0]
    assert "engine error" in check_case({"error": "boom", "engine": "hf-generate", "workload": "uniform", "n": 8},
                                        config)[0]  # fmt: skip


def test_natural_eos_cases_accept_stops_but_not_an_early_length_finish():
    config = SuiteConfig()
    case = record("hf-generate", 2, 1.0, 1, workload="arith")
    case |= {"completion_lengths": [5] * len(case["completion_lengths"]), "finish_reasons": ["stop"] * 8}
    assert check_case(case, config) == []
    case["finish_reasons"] = ["length"] + ["stop"] * 7
    assert check_case(case, config), "a 'length' finish below the cap is a broken contract"


def test_ratios_and_targets_compare_engines_of_the_same_workload_and_n():
    records = [
        record("hf-generate", 64, 100.0, 1000),
        record("transformers-cb", 64, 40.0, 2000),
        record("cb_impl", 64, 200.0, 300),
        record("hf-generate", 8, 50.0, 100),
        record("cb_impl", 8, 40.0, 50),
    ]
    rows = {(r["n"], r["engine"]): r for r in ratios(records)}
    assert rows[(64, "cb_impl")]["throughput_vs_hf-generate"] == pytest.approx(2.0)
    assert rows[(64, "cb_impl")]["throughput_vs_transformers-cb"] == pytest.approx(5.0)
    assert rows[(64, "cb_impl")]["kv_vs_hf-generate"] == pytest.approx(0.3)
    assert "throughput_vs_transformers-cb" not in rows[(8, "cb_impl")], "no peer at N=8: no ratio"
    met = {t["target"]: t for t in evaluate_targets(records)}
    assert met["gsm8k-like N=64: cb_impl tokens_per_s / hf-generate >= 1.0"]["met"] is True
    assert met["gsm8k-like N=64: cb_impl tokens_per_s / hf-generate >= 3.0"]["met"] is False
    assert met["gsm8k-like N=64: cb_impl tokens_per_s / transformers-cb >= 4.0"]["met"] is True
    assert met["gsm8k-like N=64: cb_impl kv_reserved_bytes / hf-generate <= 0.4"]["met"] is True
    assert met["gsm8k-like N=8: cb_impl tokens_per_s / hf-generate >= 1.0"]["value"] == pytest.approx(0.8)
    assert met["gsm8k-like N=8: cb_impl tokens_per_s / hf-generate >= 1.0"]["met"] is False
    assert met["uniform N=8: cb_impl tokens_per_s / hf-generate >= 1.0"]["met"] is None, "no records: not judged"


def test_greedy_token_agreement_is_measured_against_cb_impl():
    a = record("cb_impl", 2, 1.0, 1) | {"completions": [[1, 2], [3]] * 4}
    b = record("hf-generate", 2, 1.0, 1) | {"completions": [[1, 2], [3, 4]] * 4}
    token_agreement([a, b])
    assert b["tokens_equal_to_cb_impl"] == pytest.approx(0.5)
    assert "tokens_equal_to_cb_impl" not in a


def test_the_report_writes_json_markdown_and_plots_with_the_environment_in_each(tmp_path):
    records = [record(e, n, 10.0 * n, 1000 * n) for n in (8, 32) for e in ENGINES]
    records.append({"engine": "cb_impl", "workload": "uniform", "n": 8, "error": "RuntimeError: boom",
                    "check_problems": ["engine error: boom"]})  # fmt: skip
    lengths = {"mean_length": [9.0, 80.0, 100.0], "max_length": [20.0, 256.0, 200.0], "clipped_ratio": [0, 0.1, 0.0]}
    grpo = {"setup": {"reasoning": "s"}, "rows": pool_rounds([
        {"workload": "reasoning", "path": "generate", "n": 8, "step_times_s": [9.0, 2.0, 3.0],
         "generation_s": [5.0, 1.0, 1.5], "peak_memory_mb": 500.0, "completion_lengths": lengths},
        {"workload": "reasoning", "path": "generate", "n": 8, "step_times_s": [9.0, 1.0], "generation_s": [5.0, 0.5],
         "peak_memory_mb": 510.0},
        {"workload": "reasoning", "path": "cb_impl", "n": 8, "step_times_s": [9.0, 1.0, 1.0, 5.0],
         "generation_s": None, "peak_memory_mb": 460.0},
    ])}  # fmt: skip
    result = {"config": {}, "cases": records, "ratios": ratios(records), "targets": evaluate_targets(records),
              "grpo": grpo}  # fmt: skip
    paths = report.write(result, tmp_path)
    assert {p.name for p in paths} == {"results.json", "results.md", "throughput.png", "memory.png"}
    assert all(p.stat().st_size > 0 for p in paths)
    md = (tmp_path / "results.md").read_text()
    assert report.env_line(ENV) in md and "ERROR: RuntimeError: boom" in md
    # pooled without each round's warm-up: generate 2, 3, 1 (median 2, share 3 / 6), cb_impl 1, 1, 5 (median 1);
    # paired step by step: 2/1, 3/1, 1/5 (median 2); no generation times for cb_impl, so no generation speedup
    # the lengths column: the mean of the logged means, the longest, the mean share cut (over every round's records)
    row = "| 8 | generate | 2.00 | 1.00 - 3.00 | 1.00 | 1.00 (1.00 - 1.00) | 1.00 | 50% | 63 (256, 3%) | 510 | +0 |"
    assert row in md
    assert "| 8 | cb_impl | 1.00 | 1.00 - 5.00 | 2.00 | 2.00 (0.20 - 3.00) | n/a | n/a | n/a | 460 | -50 |" in md
    assert "## GRPO step (TRL GRPOTrainer): reasoning" in md
    assert "| GRPO step (reasoning) N=8: cb_impl speedup vs generate() >= 1.0 | 2.000 | yes |" in md
    assert json.loads((tmp_path / "results.json").read_text())["env"] == ENV
    with Image.open(tmp_path / "throughput.png") as png:
        assert png.text["Description"] == report.env_line(ENV)


def test_logs_written_under_the_old_engine_name_generate_are_read_back_as_hf_generate(tmp_path):
    (tmp_path / "logs").mkdir()
    old = record("generate", 8, 10.0, 1)
    (tmp_path / "logs" / "gsm8k-like-generate.jsonl").write_text(json.dumps(old) + "\n")
    (tmp_path / "logs" / "grpo-generate.jsonl").write_text(json.dumps({"path": "generate", "n": 8}) + "\n")
    assert [(r["engine"], r["n"]) for r in read_logs(tmp_path)] == [("hf-generate", 8)]
    new = record("hf-generate", 8, 20.0, 1)
    (tmp_path / "logs" / "gsm8k-like-hf-generate.jsonl").write_text(json.dumps(new) + "\n")
    assert [r["tokens_per_s"] for r in read_logs(tmp_path)] == [20.0], "a rerun's record replaces the old-named one"


def test_matrix_rounds_pool_to_the_median_run_with_its_spread_and_every_round_s_problems(tmp_path):
    """Three rounds of a case: the fastest round with the min and max beside it, and a problem of any round kept; an
    error in one round is the case's result. The report shows the spread, and round files are read back from the
    logs (a file without a round is round 0)."""
    runs = [record("cb_impl", 8, v, 1) | {"round": k, "wall_s": 1 / v} for k, v in enumerate((30.0, 10.0, 20.0))]
    runs[0]["check_problems"] = ["p0-g1: short"]
    (pooled,) = pool_matrix_rounds(runs)
    assert (pooled["tokens_per_s"], pooled["round"], pooled["rounds"]) == (30.0, 0, 3)
    assert (pooled["tokens_per_s_min"], pooled["tokens_per_s_max"]) == (10.0, 30.0)
    assert pooled["check_problems"] == ["p0-g1: short"], "a problem of another round is not dropped"
    failed = runs[:2] + [{"engine": "cb_impl", "workload": "gsm8k-like", "n": 8, "error": "boom", "round": 2}]
    assert pool_matrix_rounds(failed)[0]["error"] == "boom"
    assert "| 8 | cb_impl | 30 (10-30) |" in report.markdown(
        {"config": {}, "cases": [pooled], "ratios": [], "targets": [], "env": ENV}
    )
    (tmp_path / "logs").mkdir()
    for r in runs:  # as a worker writes them: the round is in the file name only
        record_only = {k: v for k, v in r.items() if k != "round"}
        (tmp_path / "logs" / f"gsm8k-like-cb_impl-r{r['round']}.jsonl").write_text(json.dumps(record_only) + "\n")
    (tmp_path / "logs" / "uniform-cb_impl.jsonl").write_text(
        json.dumps(record("cb_impl", 8, 5.0, 1, "uniform")) + "\n"
    )
    assert sorted((r["workload"], r["round"]) for r in read_logs(tmp_path)) == [
        ("gsm8k-like", 0), ("gsm8k-like", 1), ("gsm8k-like", 2), ("uniform", 0)
    ]  # fmt: skip


def test_paired_speedups_divide_step_by_step_and_only_when_both_paths_timed_the_same_steps():
    from cbverify.bench.grpo_suite import paired_speedups

    assert paired_speedups([2.0, 3.0, 1.0], [1.0, 1.5, 4.0]) == [2.0, 2.0, 0.25]
    assert paired_speedups([2.0, 3.0], [1.0]) is None, "a path with a missing step is not paired"
    assert paired_speedups([], []) is None and paired_speedups(None, [1.0]) is None


@given(share=st.floats(0.0, 1.0), target=st.floats(1.0, 4.0), over=st.floats(1.001, 10.0))
def test_the_generation_speedup_a_step_target_needs_is_amdahls_bound(share, target, over):
    """With generation ``share`` of the step and the rest unchanged, generation ``needed`` times faster makes the step
    exactly ``target`` times faster; faster still beats the target, slower misses it; and when the rest alone is more
    than ``1 / target`` of the step no generation speed is enough."""
    needed = report.generation_speedup_needed(share, target)

    def step_speedup(x: float) -> float:
        return 1.0 / ((1.0 - share) + share / x)

    if math.isinf(needed):
        assert step_speedup(1e12) <= target * (1 + 1e-9)
    else:
        assert step_speedup(needed) == pytest.approx(target, rel=1e-9)
        assert step_speedup(needed * over) > target and step_speedup(needed / over) < target


def test_the_grpo_targets_say_which_generation_speedup_each_needs_and_which_was_measured():
    # generate(): steps 2, 2 with generation 1, 1 (share 50%); cb_impl: steps 1.6, 1.6 with generation 0.6, 0.6.
    # Target 1.25 at N=32 needs 0.5 / (0.8 - 0.5) = 5/3 generation speedup; measured 1 / 0.6 = 5/3 as well.
    rows = pool_rounds([
        {"path": "generate", "n": 32, "step_times_s": [9.0, 2.0, 2.0], "generation_s": [5.0, 1.0, 1.0],
         "peak_memory_mb": 1.0},
        {"path": "cb_impl", "n": 32, "step_times_s": [9.0, 1.6, 1.6], "generation_s": [5.0, 0.6, 0.6],
         "peak_memory_mb": 1.0},
        {"path": "generate", "n": 64, "step_times_s": [9.0, 2.0], "generation_s": [5.0, 0.2], "peak_memory_mb": 1.0},
        {"path": "cb_impl", "n": 64, "step_times_s": [9.0, 1.9], "generation_s": [5.0, 0.1], "peak_memory_mb": 1.0},
    ])  # fmt: skip
    assert report.grpo_targets(rows) == [], "the targets bear on the reasoning workload; these rows are arithmetic"
    rows = [r | {"workload": "reasoning"} for r in rows]
    by_n = {int(t["target"].split("N=")[1].split(":")[0]): t for t in report.grpo_targets(rows)}
    assert by_n[32]["generation_speedup_needed"] == pytest.approx(5 / 3)
    assert by_n[32]["generation_speedup"] == pytest.approx(5 / 3) and by_n[32]["met"] is True
    assert math.isinf(by_n[64]["generation_speedup_needed"]), "generation 10% of the step cannot make it 1.25x"
    md = report.grpo_markdown({"setup": "s", "rows": rows})
    target = "| GRPO step (reasoning) N={}: cb_impl speedup vs generate() >= 1.25 | {} |"
    assert target.format(32, "1.250 | yes | 1.67 (50%) | 1.67") in md
    assert target.format(64, "1.053 | **no** | unreachable (10%) | 2.00") in md


def test_a_generation_share_outside_zero_to_one_or_a_non_positive_target_is_refused():
    for share, target in ((-0.1, 1.25), (1.5, 1.25), (0.5, 0.0)):
        with pytest.raises(ValueError, match="share"):
            report.generation_speedup_needed(share, target)


def test_bench_from_logs_names_every_missed_target_the_grpo_step_s_included_and_strict_targets_exit_1(
    tmp_path, capsys
):
    from cbverify.cli import main

    (tmp_path / "logs").mkdir()
    for engine, tokens_per_s in (("hf-generate", 10.0), ("cb_impl", 5.0)):  # cb_impl at half generate()'s speed
        (tmp_path / "logs" / f"gsm8k-like-{engine}.jsonl").write_text(json.dumps(record(engine, 8, tokens_per_s, 1)))
    for path, step in (("generate", 1.0), ("cb_impl", 2.0)):  # and at half its GRPO step speed
        line = {"workload": "reasoning", "path": path, "n": 8, "step_times_s": [9.0, step],
                "generation_s": [5.0, step / 2], "peak_memory_mb": 1.0}  # fmt: skip
        (tmp_path / "logs" / f"grpo-reasoning-{path}-r0.jsonl").write_text(json.dumps(line))
    args = ["bench", "--from-logs", "--out", str(tmp_path), "--workload", "gsm8k-like", "--n", "8", "--grpo-n", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "NOTE: 2 target(s) missed: gsm8k-like N=8: cb_impl tokens_per_s / hf-generate >= 1.0; " in out
    assert "GRPO step (reasoning) N=8: cb_impl speedup vs generate() >= 1.0" in out.split("NOTE:")[1]
    assert main([*args, "--strict-targets"]) == 1 and "FAIL: 2 target(s) missed" in capsys.readouterr().out


def test_cb_impl_s_step_breakdown_splits_its_wall_time_per_step_into_parts_that_add_up():
    """Timers of 10 steps: schedule 0.1 s, model runner 0.5 s of which forwards 0.4 s, sampling 0.2 s, wall 1.0 s:
    10 / 10 / 40 / 20 ms per step and 20 ms unaccounted (adapter, hooks); overhead = all but the forward = 60 ms, the
    same as the case's own overhead per step; generate()'s overhead stands beside it."""
    stats = {"schedule_s": 0.1, "model_s": 0.5, "sample_s": 0.2}
    cb = {"engine": "cb_impl", "workload": "arith", "n": 32, "steps": 10, "wall_s": 1.0, "forward_s": 0.4,
          "overhead_per_step_ms": 60.0, "extra": {"stats": stats}}  # fmt: skip
    hf = {"engine": "hf-generate", "workload": "arith", "n": 32, "overhead_per_step_ms": 45.0}
    parts = report.step_breakdown(cb)
    assert parts == pytest.approx({"schedule": 10.0, "runner": 10.0, "forward": 40.0, "sample": 20.0, "rest": 20.0})
    assert sum(parts.values()) == pytest.approx(1e3 * cb["wall_s"] / cb["steps"])
    table = report.breakdown_markdown({"cases": [cb, hf]})
    assert "| arith | 32 | 10.00 | 10.00 | 40.00 | 20.00 | 20.00 | 60.00 | 45.00 |" in table
    assert report.step_breakdown(cb | {"forward_s": None}) is None  # untimed forwards: no breakdown
    assert report.breakdown_markdown({"cases": [hf, cb | {"extra": {}}]}) == []  # no engine timers: no table


def test_throughput_against_vllm_is_a_target_of_every_cell_where_vllm_ran_and_of_none_where_it_did_not():
    pair = [record("cb_impl", 32, 96.0, 1), record("hf-generate", 32, 50.0, 1)]
    assert not [t for t in evaluate_targets(pair) if "/ vllm" in t["target"]], "vLLM is opt-in: no run, no target"
    targets = {t["target"]: t for t in evaluate_targets([*pair, record("vllm", 32, 100.0, 1)])}
    against = targets["gsm8k-like N=32: cb_impl tokens_per_s / vllm >= 1.0"]
    assert against["value"] == pytest.approx(0.96) and against["met"] is False
    assert targets["gsm8k-like N=8: cb_impl tokens_per_s / vllm >= 1.0"]["met"] is None  # a cell vLLM did not run
