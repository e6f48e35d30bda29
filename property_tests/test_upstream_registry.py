"""Fast tests of the upstream machinery itself (no trainer runs): the findings registry, the judging rule, scenario
validation, the ``cbverify upstream`` listing and the matrix table."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cbverify.cli import upstream
from cbverify.upstream import matrix_checks as matrix
from cbverify.upstream.distributed import DISTRIBUTED_SCENARIOS
from cbverify.upstream.findings import FAIL, FINDINGS, NA, PASS, SCRIPTS, CheckResult, by_id, flat_groups_seen
from cbverify.upstream.rank_checks import RANK_CHECKS
from cbverify.upstream.scenario import PATHS, TrainerScenario
from cbverify.upstream.steps import CHECKS as STEP_CHECKS
from cbverify.upstream.suite import CHECKS, DEFAULT_SCENARIOS, VLLM_SCENARIOS, judge

pytestmark = pytest.mark.upstream


def test_every_finding_names_known_checks_a_path_and_one_line_of_evidence():
    ids = [f.id for f in FINDINGS]
    assert len(ids) == len(set(ids)), "finding ids must be unique"
    for f in FINDINGS:
        known = set(STEP_CHECKS) if f.step_checks else set(CHECKS) | set(RANK_CHECKS)
        assert set(f.checks) & known, f"{f.id}: its repro runs none of {f.checks}"
        unknown = set(f.checks) - set(CHECKS) - set(STEP_CHECKS) - set(RANK_CHECKS)
        assert not unknown, f"{f.id}: unknown checks {unknown}"
        assert f.path in (*PATHS, "*"), f.id
        assert f.evidence and "\n" not in f.evidence and f.affected, f.id
        assert f.applies(f.repro), f"{f.id}: its own repro scenario does not meet its condition"
        # `upstream --run` (--nproc 2) replays the default (multi-process) scenarios; the step checks' findings are
        # replayed by their own tests
        runs_it = f.step_checks or f.repro in (*DEFAULT_SCENARIOS, *VLLM_SCENARIOS, *DISTRIBUTED_SCENARIOS)
        assert f.data_dependent or runs_it, f"{f.id}: repro not a default"
        assert not f.script or (SCRIPTS / f.script).is_file(), f"{f.id}: no script {f.script}"


def test_a_registered_failure_is_expected_and_an_unregistered_one_is_not():
    finding = by_id("cb-discards-sampler-logprobs")
    scenario = finding.repro
    said = "the engine returned log-probs for 4 rows; the trainer received logprobs=None"
    failing = CheckResult("sampler_logprobs_reach_trainer", "cb", FAIL, said)
    assert judge(failing, scenario, "llama") == (True, "XFAIL(cb-discards-sampler-logprobs)")
    # the same check failing under the same configuration in another way is not the finding's failure
    other = CheckResult(
        "sampler_logprobs_reach_trainer", "cb", FAIL, "row 0: sampling_per_token_logps != the rollout's"
    )
    ok, label = judge(other, scenario, "llama")
    assert not ok and label.startswith("FAIL(not cb-discards-sampler-logprobs: its reason does not match"), label
    assert judge(CheckResult("sampler_logprobs_reach_trainer", "generate", FAIL, "x"), scenario, "llama")[0] is False
    assert judge(CheckResult("loss_matches_reference", "cb", FAIL, "x"), scenario, "llama") == (False, "FAIL")


def test_a_registered_check_that_passes_again_is_flagged_as_possibly_fixed():
    scenario = by_id("cb-reseeds-global-rng").repro
    passing = CheckResult("generation_keeps_rng", "cb", PASS, "unchanged")
    assert judge(passing, scenario, "qwen2") == (False, "FIXED?(cb-reseeds-global-rng)")
    assert judge(CheckResult("generation_keeps_rng", "cb", NA, "n/a"), scenario, "qwen2")[0] is True


def test_architecture_scoped_findings_do_not_cover_other_architectures():
    scenario = by_id("cb-bf16-generation-crashes").repro
    crash = CheckResult("run_completes", "cb", FAIL, "trainer raised IndexError: list index out of range")
    assert judge(crash, scenario, "llama") == (True, "XFAIL(cb-bf16-generation-crashes)")
    assert judge(crash, scenario, "qwen2") == (False, "FAIL")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(path="sglang"),
        dict(num_generations=1),
        dict(temperature=0.0),
        dict(loss_type="ppo"),
        dict(reward="x"),
        dict(sampler_noise=0.1),
        dict(sampler_dtype="float32"),
    ],
)
def test_trainer_scenarios_reject_invalid_settings_with_a_clear_error(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        TrainerScenario(**kwargs)


def test_cbverify_upstream_lists_every_finding_with_its_evidence(capsys):
    parser = argparse.ArgumentParser()
    upstream.configure(parser)
    assert upstream.run(parser.parse_args([])) == 0
    out = capsys.readouterr().out
    for f in FINDINGS:
        assert f"[{f.id}]" in out and f.evidence.split()[0] in out


def test_matrix_table_keeps_the_worst_label_per_check_and_names_a_failed_install():
    def payload(labels):
        return {"versions": {}, "results": [{"check": "c", "path": "cb", "label": lab, "ok": True} for lab in labels]}

    failed = matrix.install_failed("pip install trl==9.9: ResolutionImpossible")
    columns = {"a": payload(["PASS", "XFAIL(f1)", "NOT-APPLICABLE"]), "b": payload(["PASS", "FAIL"]), "c": failed}
    header, rows = matrix.table(columns)
    assert header == ["check", "path", "a", "b", "c"]
    assert rows == [["c", "cb", "xfail(f1)", "FAIL", "-"],
                    ["venv", "-", "-", "-", "ERROR(pip install trl==9.9: ResolutionImpossible)"]]  # fmt: skip
    assert "| c | cb | xfail(f1) | FAIL | - |" in matrix.render_markdown(header, rows)
    json.dumps(rows)  # the JSON output is plain data


def test_the_matrix_says_per_column_what_changed_against_the_previous_release():
    header = ["check", "path", "0.24", "0.27", "0.28"]
    rows = [["a", "*", "pass", "FAIL", "pass"], ["b", "*", "xfail(f)", "xfail(f)", "pass"],
            ["c", "*", "n/a", "VACUOUS", "VACUOUS"]]  # fmt: skip
    lines = matrix.column_changes(header, rows)
    assert lines == [
        "0.24: 1 N/A, 1 PASS, 1 XFAIL",
        "0.27: 1 FAIL, 1 VACUOUS, 1 XFAIL",
        "  against 0.24: newly failing 2: a (pass -> FAIL); c (n/a -> VACUOUS); fixed 0",
        "0.28: 2 PASS, 1 VACUOUS",
        "  against 0.27: newly failing 0; fixed 2: a (FAIL -> pass); b (xfail(f) -> pass)",
    ]


def test_the_matrix_probe_names_the_module_an_import_lacks(monkeypatch):
    import io
    import sys
    from pathlib import Path

    from cbverify.upstream import matrix as venvs

    log = io.StringIO()
    monkeypatch.setattr(venvs, "PROBE", "import json")
    assert venvs._probe(Path(sys.executable), log) is None
    monkeypatch.setattr(venvs, "PROBE", "import cbverify_no_such_module.sub")
    assert venvs._probe(Path(sys.executable), log) == (
        "cbverify_no_such_module",
        "ModuleNotFoundError: No module named 'cbverify_no_such_module'",
    )
    monkeypatch.setattr(venvs, "PROBE", "raise ImportError('cannot import name X')")
    assert venvs._probe(Path(sys.executable), log) == (None, "ImportError: cannot import name X")
    assert "import json" in log.getvalue(), "every probe is logged"


def _trl_float32_advantages(rewards: torch.Tensor, n: int, scale: str) -> torch.Tensor:
    """TRL's advantages as its releases compute them, in float32: group mean, Bessel std + 1e-4 (written here from
    TRL's documented formula, independently of the finding's model)."""
    grouped = rewards.float().view(-1, n)
    centred = (grouped - grouped.mean(1, keepdim=True)).flatten()
    if scale == "none":
        return centred
    std = grouped.std(1).repeat_interleave(n) if scale == "group" else rewards.float().std().expand(len(rewards))
    return centred / (std + 1e-4)


@given(
    value=st.floats(-50, 50, allow_nan=False, width=32).filter(lambda v: abs(v) > 1e-6),
    n=st.integers(2, 8),
    groups=st.integers(1, 3),
    scale=st.sampled_from(["group", "none"]),
    off=st.floats(0.1, 0.9),
)
def test_the_float32_group_mean_model_accepts_trls_rounding_and_nothing_else(value, n, groups, scale, off):
    """The finding's model says what TRL computes for equal-reward groups: it accepts TRL's float32 advantages for
    any drawn reward, group size and scaling where rounding made them nonzero, and refuses them moved by a fraction of
    a rounding unit, or made unequal within a group."""
    import math

    from cbverify.upstream.predictions import float32_mean_rounding

    scenario = TrainerScenario(num_generations=n, scale_rewards=scale)
    rewards = torch.full((n * groups,), value, dtype=torch.float32)
    got = _trl_float32_advantages(rewards, n, scale).double()

    def seen(adv: torch.Tensor) -> dict:
        parts = [slice(g * n, (g + 1) * n) for g in range(groups)]
        return dict(flat_groups_seen([(rewards[p].tolist(), adv[p].tolist()) for p in parts]))

    if bool((got == 0).any()):  # the mean rounded exactly for some group: nothing for the finding to explain there
        return
    assert float32_mean_rounding(scenario, seen(got)) is None
    unit = 2.0 ** (math.frexp(abs(value))[1] - 25) / (1.0 if scale == "none" else 1e-4)
    assert float32_mean_rounding(scenario, seen(got + off * unit)) is not None
    unequal = got.clone()
    unequal[0] += unit
    assert float32_mean_rounding(scenario, seen(unequal)) is not None


@given(
    rewards=st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=3, max_size=3),
    missing=st.integers(0, 2),
)
def test_the_unscorable_model_accepts_nansum_advantages_and_refuses_the_reference_ones(rewards, missing):
    """TRL before 1.6 scores a None reward as 0 inside its group's statistics: the model accepts exactly that (TRL's
    float32 formula on the rewards with 0 in place of NaN) and refuses the correct advantages (NaN row left out,
    its advantage 0) wherever the two differ."""
    from cbverify.upstream.predictions import unscorable_as_zero
    from reference.advantages import compute_advantages

    scenario = TrainerScenario(num_generations=3, reward="unscorable")
    with_nan = torch.tensor(rewards, dtype=torch.float64)
    with_nan[missing] = float("nan")
    buggy = _trl_float32_advantages(with_nan.nan_to_num(0.0), 3, "group").double()
    assert (
        unscorable_as_zero(scenario, {"rewards": tuple(with_nan.tolist()), "advantages": tuple(buggy.tolist())})
        is None
    )
    right = compute_advantages(with_nan, 3, "group")
    if not torch.allclose(right, buggy, rtol=1e-3, atol=1e-3):
        assert unscorable_as_zero(scenario, {"rewards": tuple(with_nan.tolist()), "advantages": tuple(right.tolist())})


def _launch_with(rows_per_rank: list[list[tuple[int, ...]]], prompt: tuple[int, ...]):
    """A finished 2-rank launch whose ranks generated ``rows_per_rank`` for one prompt (distinct RNG states)."""
    from cbverify.upstream.capture import Capture, GenerationRecord
    from cbverify.upstream.distributed import Launch

    ranks = []
    for r, rows in enumerate(rows_per_rank):
        completions = [list(c) for c in rows]
        record = GenerationRecord("train", ["p"] * len(rows), None, None, [list(prompt)] * len(rows), completions)
        ranks.append({"rng_at_generation": [torch.tensor([r])], "capture": Capture(generations=[record])})
    return Launch(2, ranks, 0, "")


def _greedy(model, prompt, n):
    from reference.generate import generate
    from reference.spec import RolloutRequest, SamplingParams

    request = RolloutRequest("g", prompt, SamplingParams(temperature=0.0, max_new_tokens=n), eos_token_ids=())
    return generate(model, [request])[0].completion_ids


def test_the_stream_check_fails_identical_draws_only_where_chance_cannot_explain_them(qwen2):
    """Independent streams draw one completion on both ranks with probability p(completion), computed from the
    model: on the random Qwen2 (near-uniform, 6 tokens) identical pairs are a shared stream (FAIL), differing pairs
    PASS, and where the model makes agreement certain (a top-1 cut) it is NOT-APPLICABLE, naming the chance."""
    from cbverify.upstream.rank_checks import distinct_streams

    prompt, rows = (1, 6, 5, 16), [(4, 7, 9, 3, 12, 8), (5, 5, 10, 2, 7, 7)]
    flat = TrainerScenario(num_generations=4, num_prompts=1, nproc=2, max_completion_length=6)
    same = distinct_streams(flat, _launch_with([rows, rows], prompt), qwen2.model)
    assert same.status == FAIL and "share a sampling stream" in same.reason, same.reason
    other = distinct_streams(flat, _launch_with([rows, rows[::-1]], prompt), qwen2.model)
    assert other.status == PASS, other.reason
    argmax = [tuple(_greedy(qwen2.model, prompt, 6))] * 2
    certain = distinct_streams(replace(flat, top_k=1), _launch_with([argmax, argmax], prompt), qwen2.model)
    assert certain.status == NA and "underpowered" in certain.reason, certain.reason
