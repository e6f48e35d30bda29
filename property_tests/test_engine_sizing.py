"""Engines declare the options that size their memory and their steps (``Capabilities.sizing``), and the conformance
suite draws them: the declaration is validated and survives JSON; the drawn values stay in the declared ranges and
reach each range's tight end; on cb_impl those values really chunk prompts and preempt requests; and an engine that
crashes only under chunked prefill is FAIL in the conformance suite, which it passes at its factory's own sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from cbverify.conformance import suite_argv
from cbverify.conformance.strategies import request_groups, sizings
from cbverify.engines import Capabilities, SizingOption, get_engine, pressure_sizes
from cbverify.engines.cb_impl_engine import CbImplEngine
from cbverify.engines.transformers_cb import TransformersCBEngine

REPO = Path(__file__).resolve().parent.parent
BASE = dict(spec_sampling=True, per_request_max_new_tokens=True, per_request_sampling=True, per_request_eos=True,
            logprob_semantics="processed", claims_batch_invariance=True)  # fmt: skip
DECLARING = (CbImplEngine, TransformersCBEngine)
FAULTY = "property_tests.faulty:PrefillOnlyStepCrashes"


@pytest.mark.parametrize("engine", DECLARING, ids=lambda e: e.name)
def test_a_sizing_declaration_survives_a_json_round_trip(engine):
    """What the worker protocol does to capabilities (``asdict``, JSON, ``Capabilities(**)``) gives them back."""
    caps = engine.capabilities
    assert caps.sizing and Capabilities(**json.loads(json.dumps(asdict(caps)))) == caps


@pytest.mark.parametrize(("sizing", "match"), [
    ([SizingOption("pages", "kv_blocks", 1, 8)], "without a block_size option"),
    ([SizingOption("a", "batch_tokens", 1, 8), SizingOption("a", "num_seqs", 1, 8)], "each option and each role once"),
    ([SizingOption("a", "batch_tokens", 1, 8), SizingOption("b", "batch_tokens", 1, 8)], "each option and each role"),
    ([("block_size", "block_size", 1, 8)], "not a SizingOption"),
    ("block_size", "sequence of SizingOption"),
    ([{"name": "block_size", "role": "pages", "min": 1, "max": 8}], "role must be one of"),
    ([{"name": "block_size", "role": "block_size", "min": 9, "max": 8}], "min 9 > max 8"),
    ([{"name": "block_size", "role": "block_size", "min": 0, "max": 8}], "ints >= 1"),
    ([{"name": "block_size", "role": "block_size", "min": True, "max": 8}], "ints >= 1"),
    ([{"name": "block size", "role": "block_size", "min": 1, "max": 8}], "keyword argument's name"),
])  # fmt: skip
def test_a_wrong_sizing_declaration_is_refused_naming_what_is_wrong(sizing, match):
    with pytest.raises(ValueError, match=match):
        Capabilities(**BASE, sizing=sizing)


@settings(max_examples=60)
@given(engine=st.sampled_from(DECLARING), requests=request_groups(), data=st.data())
def test_drawn_sizes_are_inside_the_declared_ranges_and_fixed_options_are_not_drawn(engine, requests, data):
    declared = {o.name: o for o in engine.capabilities.sizing}
    fixed_name = data.draw(st.sampled_from([None, *declared]), label="fixed")
    fixed = {} if fixed_name is None else {fixed_name: declared[fixed_name].min}
    drawn = data.draw(sizings(engine.capabilities.sizing, requests, fixed), label="sizing")
    assert set(drawn) == set(declared) - set(fixed)
    assert all(declared[name].min <= value <= declared[name].max for name, value in drawn.items()), drawn


def test_each_declared_option_is_drawn_at_its_tight_end_and_away_from_it():
    """Over 100 derandomised draws for cb_impl: one-token blocks, KV blocks for the longest request alone
    (:func:`pressure_sizes`), a one-token step budget and one sequence at a time each come up, and so do roomier
    values of each."""
    caps = CbImplEngine.capabilities
    seen: dict[str, set[bool]] = {o.name: set() for o in caps.sizing}

    @settings(max_examples=100, database=None, derandomize=True)
    @given(requests=request_groups(), data=st.data())
    def draw(requests, data):
        drawn = data.draw(sizings(caps.sizing, requests))
        blocks, _ = pressure_sizes(requests, drawn["block_size"])
        for name, value in drawn.items():
            seen[name].add(value == {"num_blocks": blocks}.get(name, 1))

    draw()
    assert all(hits == {True, False} for hits in seen.values()), seen


def test_drawn_sizes_make_cb_impl_chunk_prompts_and_preempt_requests(llama):
    """The draw is decisive: over the conformance suite's own request groups, cb_impl built with the drawn sizes runs
    steps of partial prefills and preempts requests, each in at least a third of the examples (counted by the engine;
    no oracle needed)."""
    counts = {"num_partial_prefills": 0, "num_preemptions": 0, "examples": 0}

    @settings(max_examples=30, database=None, derandomize=True)
    @given(requests=request_groups(), data=st.data())
    def run(requests, data):
        engine = get_engine("cb_impl", llama.model, **data.draw(sizings(CbImplEngine.capabilities.sizing, requests)))
        engine.generate(requests)
        counts["examples"] += 1
        for key in ("num_partial_prefills", "num_preemptions"):
            counts[key] += engine.stats[key] > 0

    run()
    third = counts["examples"] // 3
    assert counts["num_partial_prefills"] >= third and counts["num_preemptions"] >= third, counts


@settings(max_examples=10, database=None, derandomize=True)
@given(requests=request_groups())
def test_the_prefill_only_crash_is_invisible_at_the_factorys_own_sizes(llama, requests):
    """The control for the test below: at cb_impl's default sizes (a 512-token step budget) every drawn prompt is
    prefilled at once, so the faulty engine answers like cb_impl."""
    from property_tests.faulty import PrefillOnlyStepCrashes

    faulty, engine = PrefillOnlyStepCrashes(llama.model), get_engine("cb_impl", llama.model)
    assert faulty.generate(requests) == engine.generate(requests)


def test_the_conformance_properties_draw_sizes_that_catch_an_engine_crashing_only_on_partial_prefills(llama):
    """``faulty.PrefillOnlyStepCrashes`` (cb_impl's old zero-row sampler crash, on any vocabulary), run through a
    conformance property as the plugin builds it (``Builder``, ``SizedEngines``, ``sized_runner``): the property
    must draw the engine's declared ``max_batch_tokens`` down to its tight end and crash it. A property that ran
    the engine at its factory's sizes would pass (the control above)."""
    from cb_impl.engine import EngineStepError
    from cbverify.conformance import plugin
    from cbverify.conformance import test_conformance as suite

    prop = suite.test_results_are_complete_in_request_order_and_follow_the_eos_and_length_conventions.hypothesis
    build = plugin.Builder({})

    # the property's own body and strategies, 5 examples, no shrinking (a crash shrinks through ~200 more examples)
    @settings(max_examples=5, phases=[Phase.generate], database=None, derandomize=True)
    @given(requests=request_groups(), data=st.data())
    def run(requests, data):
        prop.inner_test(sized=sized, conformance_model=llama.model, requests=requests, data=data)

    try:
        sized = suite.sized_runner(build(FAULTY, llama.model), FAULTY, plugin.SizedEngines(build), llama.model, {})
        with pytest.raises(EngineStepError, match="cannot reshape tensor of 0 elements"):
            run()
    finally:
        build.close()


@pytest.mark.slow  # ~20 s: the suite in a pytest process of its own
def test_the_conformance_suite_fails_an_engine_that_crashes_only_on_partial_prefills(tmp_path):
    """The same end to end, through pytest's plugin as another project runs it: FAIL in the report, with the error
    and the sizing the engine declares."""
    report = tmp_path / "report.md"
    argv = suite_argv(tmp_path, "tiny-llama-arith", 3, [FAULTY], [], "results_are_complete", report)
    proc = subprocess.run([sys.executable, "-m", "pytest", *argv, "--hypothesis-seed", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    text = report.read_text()
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "| results are complete in request order and follow the eos and length conventions | FAIL |" in text, text
    assert "cannot reshape tensor of 0 elements" in text and "declares its sizing: `block_size`" in text, text
