"""Options in pairs (``cbverify.pairs``, ``cbverify.fuzz.coverage``): the coverage counting on hand-built cases, the
covering design and value rows of every declared space, and the transformers CB fuzz's drawing over derandomised runs
of 40: every pair reached and every option value in its stated share, counted from what the calls resolved to (the
cases are drawn exactly as ``cbverify fuzz`` draws them; the engine is not run: a call's options are read off its
resolved ``GenerationConfig``, which does not depend on what the engine does with it). A pair left out of the plan is
named by the report.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz.batch_judge import intent
from cbverify.fuzz.case import FuzzCase, FuzzRequest, Step
from cbverify.fuzz.coverage import MIN_SHARE, batch_space, batch_units, entry_space, manager_space, manager_units
from cbverify.fuzz.run import Outcome
from cbverify.fuzz.search import explore, planned_cases
from cbverify.pairs import (
    Coverage,
    Group,
    Option,
    PairSpace,
    Plan,
    covering_rows,
    guaranteed_share,
    trainer_labels,
    trainer_space,
    value_rows,
)
from cbverify.upstream.scenario import TrainerScenario
from reference import tasks

TOY = PairSpace(
    "toy",
    (
        Group("q", (Option("a", ("off", "on"), ("on",)), Option("b", ("0", "1", "2"), ("1", "2")),
                    Option("c", ("no", "yes"), ("yes",), (("yes", (("s", "x"),)),)))),
        Group("r", (Option("d", ("0", "1"), ("1",)), Option("e", ("0", "1"), ("1",)))),
    ),
    singles=(Option("s", ("x", "y")),),
)  # fmt: skip
SPACES = (TOY, trainer_space(), manager_space(), batch_space())


def test_pairs_are_effective_values_of_two_options_of_one_group():
    """Listed by construction: a x b (1 x 2), a x c, b x c (2 x 1) in group q, d x e in r; none across groups,
    none with a value that is not effective, none of a single."""
    want = {("a=on", "b=1"), ("a=on", "b=2"), ("a=on", "c=yes"), ("b=1", "c=yes"), ("b=2", "c=yes"), ("d=1", "e=1")}
    assert set(TOY.pairs()) == want


def test_coverage_counts_pairs_within_a_unit_and_names_the_ones_never_reached():
    cov = Coverage(TOY)
    cov.add([{"a=on", "s=x"}, {"b=1", "s=x"}])  # a and b in two different units: no pair
    assert cov.reached == 0
    cov.add([{"a=on", "b=1", "c=yes", "s=x", "d=1", "e=0"}])
    assert set(TOY.pairs()) - set(cov.missing) == {("a=on", "b=1"), ("a=on", "c=yes"), ("b=1", "c=yes")}
    line = cov.line()
    assert line.startswith("pairs reached 3/6 (toy, 2 cases)")
    for a, b in cov.missing:
        assert f"{a} x {b}" in line
    assert cov.values["a=on"] == 2 and cov.values["s=x"] == 2 and cov.values["b=1"] == 2
    assert cov.shares()["e=0"] == 0.5 and "e=1" in cov.below(0.1)
    cov.add([{"a=on", "b=2", "c=yes", "d=1", "e=1"}])
    assert cov.missing == [] and "NOT REACHED" not in cov.line()
    with pytest.raises(ValueError, match="unknown labels"):
        cov.add([{"a=maybe"}])
    with pytest.raises(ValueError, match="effective"):
        Option("z", ("0",), ("1",))


@pytest.mark.parametrize("space", SPACES, ids=lambda s: s.name)
def test_the_covering_rows_set_every_pair_together_and_the_value_rows_force_every_value(space):
    """Checked by counting the rows as if they were cases (each row's labels one unit), and every row is consistent
    with what its values require."""
    for rows, want in ((covering_rows(space), "pairs"), (value_rows(space), "values")):
        cov = Coverage(space)
        for row in rows:
            for name, value in row.items():
                for need, wanted in space.option(name).needs(value):
                    assert row.get(need) == wanted, (row, name, value)
            cov.add([{space.option(n).label(v) for n, v in row.items()}])
        if want == "pairs":
            assert cov.missing == [], cov.line()
        else:
            assert not cov.below(1e-9), cov.below(1e-9)


@pytest.mark.parametrize("space", SPACES[1:], ids=lambda s: s.name)
def test_the_plan_forces_each_value_in_the_stated_share_of_any_run_of_40_or_more(space):
    plan = Plan.of(space)
    assert min(guaranteed_share(space, n, plan) for n in range(40, 401)) >= MIN_SHARE


# ------------------------------------------------------------------------------------------ what a case really did
def _record(completions, eos=(2,), error=None, losses=1):
    gen = SimpleNamespace(completion_ids=completions)
    return SimpleNamespace(generations=[gen], losses=[object()] * losses, eos_token_ids=eos, error=error)


def test_trainer_labels_count_a_masked_cut_only_where_rows_were_cut_and_others_were_not():
    s = TrainerScenario(path="rollout_func", rollout_backend="reference", num_generations=2, loss_type="dapo",
                        per_device_train_batch_size=3, steps_per_generation=2, gradient_accumulation_steps=1,
                        mask_truncated_completions=True, top_k=3, top_p=0.9, temperature=0.7)  # fmt: skip
    mixed = trainer_labels(s, _record([(5, 2), (5, 6, 7)]))
    assert {
        "mask_truncated_completions=true+cut",
        "loss_type=dapo",
        "steps_per_generation=above-gas",
        "top_k=cut",
        "top_p=below-1",
        "temperature=other",
        "min_p=0",
        "per_device_train_batch_size=splits-a-group",
    } <= mixed
    assert not any(lab.startswith("mask_truncated") for lab in trainer_labels(s, _record([(5, 6), (7, 8)])))
    assert not any(lab.startswith("mask_truncated") for lab in trainer_labels(s, _record([(5, 2), (6, 2)])))
    assert trainer_labels(s, _record([(5, 2), (5, 6)], error=RuntimeError("boom"))) == set()
    assert trainer_labels(s, _record([(5, 2), (5, 6)], losses=0)) == set()
    wide = replace(s, top_k=tasks.VOCAB_SIZE, per_device_train_batch_size=4, steps_per_generation=1)
    labels = trainer_labels(wide, _record([(5, 2)]))
    assert {"top_k=0", "per_device_train_batch_size=several-groups", "steps_per_generation=gas"} <= labels
    below = trainer_labels(replace(wide, gradient_accumulation_steps=3), _record([(5, 2)]))
    assert "steps_per_generation=below-gas" in below
    Coverage(trainer_space()).add([mixed, labels])  # every label is the space's


def _batch_case(generation, prompts=((1, 5, 6, 7),), config=None, options=None):
    reqs = tuple(FuzzRequest(f"c0-i{j}", p, 4, ()) for j, p in enumerate(prompts))
    step = Step("call", reqs, options=options or {"max_new_tokens": 4})
    return FuzzCase("transformers-cb", "tiny-llama-arith", False, config or {"max_batch_tokens": 64}, generation,
                    (step,), entry="generate_batch")  # fmt: skip


def _resolved(case, model_generation=None):
    return [intent(case.generation_of(s), s.options, model_generation or {}, compat.generation_defaults())
            for s in case.calls]  # fmt: skip


def test_batch_units_read_what_a_call_resolved_to_not_what_it_passed():
    greedy = _batch_case({"do_sample": False, "top_k": 3, "temperature": 0.7, "min_length": 2})
    (labels,) = batch_units(greedy, _resolved(greedy))
    assert not any(lab.split("=")[0] in ("top_k", "temperature", "top_p", "min_p") for lab in labels), labels
    assert "do_sample=false" in labels and "minimum_length=min_length" not in labels  # 2 < the 4-token prompt
    sampled = _batch_case({"do_sample": True, "top_k": tasks.VOCAB_SIZE + 7, "min_length": 30, "min_new_tokens": 2},
                          prompts=((1, 5, 6, 7), (1, 5, 6, 7), (1, 8)), config={"max_batch_tokens": 3},
                          options={"max_new_tokens": 4, "temperature": 1.5})  # fmt: skip
    (labels,) = batch_units(sampled, _resolved(sampled))
    assert {
        "top_k=beyond-vocab",
        "temperature=other",
        "minimum_length=min_new_tokens",
        "repeated_input=yes",
        "distinct_prompts=several",
        "max_batch_tokens=below-a-prompt",
    } <= labels  # a keyword wins over the config
    late = _batch_case({"do_sample": True, "top_k": 3, "min_length": 30})
    (labels,) = batch_units(late, _resolved(late))
    assert {"top_k=cut", "minimum_length=min_length"} <= labels
    with pytest.raises(ValueError, match="resolved configs"):
        batch_units(late, [])
    Coverage(batch_space()).add([labels])


def test_manager_units_are_per_request_and_sample_only_where_the_manager_samples():
    r = FuzzRequest("c0-p0-g0", (1, 5, 6), 3, (2,), temperature=0.7, top_k=3, top_p=0.8, seed=1)
    twin = replace(r, request_id="c0-p0-g1", top_k=None, temperature=1.0, top_p=None)
    case = FuzzCase("transformers-cb", "tiny-llama-arith", False,
                    {"per_request_processors": True, "max_batch_tokens": 64, "max_requests_per_batch": 1},
                    {"do_sample": True, "min_p": 0.1}, (Step("call", (r, twin)),))  # fmt: skip
    first, second = manager_units(case)
    assert {
        "temperature=other",
        "top_k=cut",
        "top_p=below-1",
        "min_p=above-0",
        "samples_per_prompt=several",
        "max_requests_per_batch=binding",
    } <= first
    assert {"temperature=1.0", "top_k=unset", "top_p=unset-or-1"} <= second
    greedy = replace(case, generation={"do_sample": False})
    assert not any(lab.startswith(("temperature", "top_k", "top_p", "min_p")) for u in manager_units(greedy)
                   for lab in u)  # fmt: skip
    assert manager_units(case, ran=0) == []
    Coverage(manager_space()).add(manager_units(case))


# ------------------------------------------------------------------------------- the fuzz's drawing, runs of 40
@pytest.fixture(scope="module")
def arith():
    from cbverify.checkpoint import load_checked

    return load_checked("tiny-llama-arith")


def _dry(model):
    """Run nothing: the outcome of a case is the options its calls resolve to (``run_case`` reads the same)."""
    from cbverify.fuzz.drivers import snapshot

    generation = snapshot(model)["generation_config"]

    def runner(model_, case, session_factory=None):
        if case.entry == "generate_batch":
            return Outcome(units=batch_units(case, _resolved(case, generation)))
        return Outcome(units=manager_units(case))

    return runner


@pytest.mark.parametrize("entry", ["manager", "generate_batch"])
def test_a_derandomised_run_of_40_reaches_every_pair_and_every_value_in_its_share(arith, entry):
    torch.manual_seed(0)
    report = explore(arith, "transformers-cb", model_name="tiny-llama-arith", examples=40, entry=entry,
                     runner=_dry(arith))  # fmt: skip
    cov = report.coverage
    assert cov.cases == 40
    assert cov.missing == [], cov.line()
    assert not cov.below(MIN_SHARE), {lab: cov.values[lab] for lab in cov.below(MIN_SHARE)}
    # what the issue saw on a plain draw: sampling, several sequences per input and a top-k cut, each in a share
    if entry == "generate_batch":
        for lab in ("do_sample=true", "num_return_sequences=2", "num_return_sequences=3", "top_k=cut"):
            assert cov.values[lab] >= MIN_SHARE * 40, (lab, cov.values[lab])


@pytest.mark.parametrize(
    ("entry", "pair"),
    [("manager", ("temperature=other", "top_k=cut")),
     ("generate_batch", ("num_return_sequences=2", "repeated_input=yes"))],
)  # fmt: skip
def test_a_pair_left_out_of_the_plan_is_named_by_the_report(arith, entry, pair):
    """The plan's cases alone (no free draws): with the pair, every pair is reached; without it, the line names
    it."""
    space = entry_space("transformers-cb", entry)
    runner = _dry(arith)

    def coverage(drop):
        cov = Coverage(space)
        for case in planned_cases("transformers-cb", entry, model_name="tiny-llama-arith", examples=40, drop=drop):
            cov.add(runner(arith, case).units)
        return cov

    assert coverage(()).missing == []
    dropped = coverage((pair,))
    assert pair in dropped.missing and f"{pair[0]} x {pair[1]}" in dropped.line()
    assert Plan.of(space, drop=(pair,)).cover != Plan.of(space).cover


# ------------------------------------------------------------------------------------------- the matrix table's rows
def test_the_matrix_reads_pair_coverage_as_a_row_and_an_unreached_pair_as_vacuous(tmp_path, monkeypatch):
    """``pair_row`` on coverage lines as ``Coverage.line`` writes them, and ``pytest_rows`` on a JUnit file whose suite
    carries the config-space test's ``pair_coverage`` property (as ``record_testsuite_property`` writes it)."""
    import io

    from cbverify.upstream import matrix_checks as mc

    cov = Coverage(TOY)
    cov.add([{"a=on", "b=1", "c=yes", "s=x", "d=1", "e=1"}])
    full = mc.pair_row("pairs", "p", cov.line())
    assert full["ok"] is False and full["label"] == "VACUOUS(4/6; not reached: a=on x b=2, b=2 x c=yes)"
    cov.add([{"a=on", "b=2", "c=yes", "s=x"}])
    assert mc.pair_row("pairs", "p", cov.line()) == mc._row("pairs", "p", "PASS(6/6)", True)
    assert mc.pair_row("pairs", "p", None) is None and not mc.pair_row("pairs", "p", "garbage")["ok"]
    assert mc._cell(["PASS", "VACUOUS(4/6; not reached: a=on x b=2)"]).startswith("VACUOUS")

    xml = tmp_path / "r.xml"
    line = "pairs reached 17/19 (trainer config space, 8 cases); NOT REACHED: x=1 x y=1, x=1 x z=1; not drawn here: p"

    def fake_run(cmd, log, timeout):
        xml.write_text(f"""<testsuites><testsuite name="pytest"><properties>
            <property name="pair_coverage" value="{line}"/></properties>
            <testcase classname="t" name="{mc.PAIRS_TEST}"><failure message="x"/></testcase>
            </testsuite></testsuites>""")  # fmt: skip
        return 1, "1 failed"

    monkeypatch.setattr(mc, "_run", fake_run)
    rows = mc.pytest_rows("python", SimpleNamespace(timeout=1), xml, io.StringIO())
    assert rows[-1] == mc._row("config-space pairs", "pytest", "VACUOUS(17/19; not reached: x=1 x y=1, x=1 x z=1)",
                               False)  # fmt: skip
