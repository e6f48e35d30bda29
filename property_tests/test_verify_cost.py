"""What ``cbverify verify`` costs and says while it runs.

- Each engine's rollout set is teacher-forced once: a counting hook on the model's forward sees exactly one forward
  per rollout (with a completion) while a row is judged, whatever the tier (bf16 also reads units and processor cuts
  off the teacher-forced logits) and the log-prob semantics, where reading every comparison off its own forward took
  two per rollout in float32 and three in bf16.
- The golden check teacher-forces the golden tokens once per case, for the reference and every engine alike.
- Progress, the estimate and the timing table go to stderr and never to stdout (the table and ``--json`` stay
  clean); ``--quiet`` shows none of them; ``--json`` carries the seconds per engine and phase; ``--profile`` dumps.
- The estimate's arithmetic, and the linear-time chi-square bins of the distribution test against their definition.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from cbverify import compare, report
from cbverify.cli import main
from cbverify.cli.verify import estimate_run, step_cost
from cbverify.distribution import MIN_EXPECTED, chi_square_bins
from cbverify.engines.reference_engine import ReferenceEngine
from cbverify.golden.cases import all_cases
from cbverify.golden.check import check_case, load_record
from cbverify.tolerances import BF16, FP32
from reference import generate as ref_gen
from reference import tasks
from reference.models import load
from reference.spec import RolloutRequest, SamplingParams


@contextlib.contextmanager
def counted_forwards(model):
    """Every forward of ``model`` while the block runs, as the list of its input lengths."""
    lengths: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[-1]), with_kwargs=True
    )
    try:
        yield lengths
    finally:
        handle.remove()


class Replay:
    """The oracle's own rollouts returned as an engine with the given log-prob semantics: generating costs no
    forward and every token equals the reference's, so every forward while its row is judged is teacher forcing."""

    name = "replay"

    def __init__(self, rollouts, semantics: str) -> None:
        self.rollouts = rollouts
        self.capabilities = replace(ReferenceEngine.capabilities, logprob_semantics=semantics)

    def generate(self, requests):
        return self.rollouts


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def workload(request):
    """The bundled Llama in one dtype, its tier, and the oracle's rollouts of a small greedy + sampled workload
    (a top-k / top-p request, so the processed semantics and bf16's processor cuts are exercised)."""
    model = load("tiny-llama-arith", dtype=request.param)[0]
    samplings = (SamplingParams(temperature=0.0, max_new_tokens=10),
                 SamplingParams(temperature=1.0, top_k=10, top_p=0.9, max_new_tokens=10))  # fmt: skip
    requests = [RolloutRequest(f"r{i}-{k}", tasks.prompt_ids(p), s, seed=i, eos_token_ids=(tasks.EOS_ID,))
                for i, p in enumerate(tasks.make_problems(3, seed=7)) for k, s in enumerate(samplings)]  # fmt: skip
    tier = FP32 if request.param == "float32" else BF16
    return model, tier, requests, ref_gen.generate(model, requests)


@pytest.mark.parametrize("semantics", ["processed", "raw"])
def test_each_rollout_set_is_teacher_forced_once_per_rollout_whatever_the_tier_and_semantics(workload, semantics):
    model, tier, requests, reference = workload
    rollouts = reference + [replace(reference[0], request_id="empty", completion_ids=(), logprobs=())]
    requests = requests + [replace(requests[0], request_id="empty")]  # an empty completion needs no forward
    with counted_forwards(model) as lengths:
        row = report.evaluate_engine(Replay(rollouts, semantics), model, requests, reference + [rollouts[-1]], tier)
    expected = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts if r.completion_ids]  # one per rollout
    assert sorted(lengths) == sorted(expected), f"{len(lengths)} forwards for {len(expected)} rollouts"
    assert row.teacher_forced_forwards == len(expected)
    assert row.phase_s.keys() >= {"generate", "tokens", "teacher forcing", "judge"}


def test_the_teacher_forcing_that_judges_a_row_is_the_oracles_own_for_each_use(workload):
    """The quantities read off the one forward equal what each use computes by itself (same forward, same math)."""
    model, tier, requests, reference = workload
    forced = compare.teacher_force(model, requests, reference, "processed", tier)
    alone = compare.teacher_forced_logprobs(model, requests, reference, "processed")
    positions = compare.noise_positions(model, requests, reference, "processed", tier)
    for k in range(len(requests)):
        assert forced.expected[k].cpu().tolist() == alone[k].cpu().tolist()
        assert forced.positions.units[k].tolist() == positions.units[k].tolist()
        assert forced.positions.at_cut[k].tolist() == positions.at_cut[k].tolist()
    judged = compare.judge_logprobs(model, requests, reference, "processed", tier, forced=forced)
    assert judged == compare.logprob_diffs(reference, alone, requests, positions)
    with pytest.raises(ValueError):  # another rollout set's teacher forcing is refused
        compare.mismatch(model, requests[1:], reference[1:], forced=forced)


def _verify(tmp_path, *extra: str) -> list[str]:
    return ["verify", "--engines", "cb_impl", "--num-prompts", "1", "--max-new-tokens", "8", "--dist-samples", "0",
            "--no-pressure", "--json", str(tmp_path / "r.json"), *extra]  # fmt: skip


PROGRESS_MARKS = ("reference: generate", "cb_impl: generate", "cb_impl: teacher forcing", "it/s]", "%|")


def test_progress_estimate_and_timings_go_to_stderr_and_never_to_stdout(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report.Phases, "DELAY", 0.0)  # every bar, however short its phase
    assert main(_verify(tmp_path)) == 0
    out, err = capsys.readouterr()
    for mark in PROGRESS_MARKS:
        assert mark in err, f"no {mark!r} on stderr:\n{err}"
        assert mark not in out, f"{mark!r} on stdout:\n{out}"
    assert "verify: estimated ~" in err and "parameters" in err and "forward(s) of its first request" in err
    assert "verify: oracle done in" in err and "to go" in err and "estimated" not in out
    table = err[err.index("wall seconds per engine and phase") :]
    assert "reference" in table and "cb_impl" in table and "teacher forcing" in table
    assert "wall seconds" not in out and out.startswith("cbverify=")
    timing = json.loads((tmp_path / "r.json").read_text())["timing"]
    assert timing["estimated_s"] > 0 and timing["total_s"] > 0
    assert {(p["engine"], p["phase"]) for p in timing["phases"]} >= {("reference", "generate"),
                                                                    ("cb_impl", "teacher forcing")}  # fmt: skip
    rows = json.loads((tmp_path / "r.json").read_text())["engines"]
    assert all(row["phase_s"]["generate"] >= 0 for row in rows)


def test_quiet_shows_no_progress_estimate_or_timings(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report.Phases, "DELAY", 0.0)
    assert main(_verify(tmp_path, "--quiet")) == 0
    out, err = capsys.readouterr()
    for mark in (*PROGRESS_MARKS, "estimated", "wall seconds"):
        assert mark not in err and mark not in out, mark
    assert json.loads((tmp_path / "r.json").read_text())["timing"]["phases"]  # the timings stay in the JSON


def test_profile_writes_a_cprofile_dump_per_phase(tmp_path, capsys):
    assert main(_verify(tmp_path, "--quiet", "--profile", str(tmp_path / "prof"))) == 0
    dumps = sorted(p.name for p in (tmp_path / "prof").glob("*.prof"))
    assert any("reference-generate" in d for d in dumps) and any("cb_impl-teacher_forcing" in d for d in dumps)
    assert "===== cb_impl: teacher forcing" in (tmp_path / "prof" / "summary.txt").read_text()


def test_the_estimate_is_the_measured_step_cost_times_the_forwards_the_workload_asks_for():
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    requests = [RolloutRequest(f"r{i}", (1,) * 6, greedy) for i in range(3)]
    a, b = step_cost([(100, 9.0), (6, 0.016), (7, 0.017), (8, 0.018)])  # the first (warm-up) step is left out
    assert (a, b) == (pytest.approx(0.01), pytest.approx(0.001))
    spiky = [(5, 1.0), (6, 0.01), (7, 0.01), (8, 0.5), (9, 0.01), (10, 0.01)]  # an accelerator's slow first kernels
    assert step_cost(spiky) == (pytest.approx(0.01), 0.0)
    one = estimate_run(TinyParams(), requests, [(6, 0.02), (6, 0.02), (6, 0.02)], ["e"], 0, [])
    two = estimate_run(TinyParams(), requests, [(6, 0.02), (6, 0.02), (6, 0.02)], ["e", "e"], 0, [])
    # a flat 0.02 s per forward: 3 x 4 oracle steps, then per engine run a prefill, 4 decode steps and 3 teacher-forced
    # forwards, and the reference's 3
    assert one.seconds == pytest.approx(0.02 * (12 + 3 + (1 + 4 + 3)))
    assert two.seconds - one.seconds == pytest.approx(0.02 * (1 + 4 + 3))
    assert "3 requests x <= 4 new tokens" in one.basis and "1 engine run(s)" in one.basis
    rest = estimate_run(TinyParams(), requests, [(6, 0.02)] * 3, ["e"], 0, [], lengths=[2, 1, 2])
    assert rest.seconds == pytest.approx(0.02 * (3 + (1 + 2 + 3)))  # after the oracle, at its completion lengths
    assert "the oracle's 5 completion tokens" in rest.basis


class TinyParams:
    def parameters(self):
        return iter([torch.zeros(10)])


@pytest.mark.parametrize(
    "name", ["tiny-qwen2-random.bfloat16.sampled.arith4", "tiny-llama-arith.float32.greedy.arith4"]
)
def test_a_golden_check_teacher_forces_the_golden_tokens_once_for_the_reference_and_every_engine(name):
    """Rule 1 reads the trainer, processed and top-5 log-probs and the bf16 cut allowances off one forward per golden
    rollout; rule 2 reads the allowances again from it for each engine: with the oracle as the engine, the only other
    forwards are its regeneration's, one per golden token."""

    case = next(c for c in all_cases() if c.name == name)
    golden = load_record(case, "cpu")["rollouts"]
    model = load(case.model, dtype=case.dtype)[0]
    with counted_forwards(model) as alone:
        assert check_case(case, engines=[], model=model, trajectory=False).ok
    assert len(alone) == sum(1 for g in golden if g["completion_ids"])
    with counted_forwards(model) as with_engine:
        assert check_case(case, engines=["reference"], model=model, trajectory=False).ok
    assert len(with_engine) == len(alone) + sum(len(g["completion_ids"]) for g in golden)


def _bins_by_definition(expected):
    """``distribution.chi_square_bins`` as first written: a torch sum of the open bin before each token."""
    support = sorted((t for t in range(len(expected)) if expected[t] > 0), key=lambda t: -float(expected[t]))
    bins = [[]]
    for t in support:
        if float(expected[bins[-1]].sum()) >= MIN_EXPECTED:
            bins.append([])
        bins[-1].append(t)
    if len(bins) > 1 and float(expected[bins[-1]].sum()) < MIN_EXPECTED:
        last = bins.pop()
        bins[-1] += last
    return support, bins


@given(
    counts=st.lists(
        st.sampled_from([0.0, 0.1, 0.7, 1.0, 1.25, 2.5, 5.0, 1 / 3, 2 / 3, 4.999999999, 7.0]), max_size=60
    ),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1.0, 200.0, 1 / 3]),
)
@example(
    counts=[0.1] * 101, seed=0, scale=1.0
)  # 50 x 0.1: 4.999999999999998 summed in order, 5.000000000000001 by torch
@example(counts=[1 / 6] * 61, seed=0, scale=1.0)  # 30 x 1/6: 5.0 in order, 4.999999999999999 by torch
def test_the_linear_chi_square_bins_are_the_definitions_bins(counts, seed, scale):
    """Bins whose sums land on the threshold exactly or within rounding of it included (sums of thirds, 2.5 + 2.5, and
    sums that the running order and torch's round to either side of it)."""
    generator = torch.Generator().manual_seed(seed)
    expected = torch.tensor(counts, dtype=torch.float64) * scale  # (V,)
    expected = expected + torch.rand(len(counts), generator=generator, dtype=torch.float64) * (seed % 2) * 1e-12
    assert chi_square_bins(expected) == _bins_by_definition(expected)
