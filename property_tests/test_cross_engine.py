"""vLLM against the reference oracle on drawn workloads (bundled arithmetic Llama, float32, CPU), marked ``vllm``.

The built-in engines are held to the same properties by the conformance suite (``cbverify/conformance``, run on them
by every ``pytest`` here through ``addopts``): one suite, the one a third party runs. vLLM stays here because its
draws must avoid a registered finding's domain (min-p before top-p) and it runs in an environment of its own. Each
property draws requests (``property_tests.strategies.rollout_requests``) and judges with :mod:`cbverify.compare` and
the float32 tier; after the module, batch invariance is *measured* (not claimed) on the engines that do not claim it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cbverify import compare
from cbverify.cli.verify import DEFAULT_ENGINE_OPTIONS
from cbverify.engines import EngineError, get_engine
from cbverify.engines.remote import RemoteEngine
from cbverify.tolerances import FP32, logprob_scale
from cbverify.upstream.env_findings import env_finding
from property_tests.helpers import SUMMARY, assert_matches_reference, needs_vllm
from property_tests.strategies import rollout_requests
from reference import tasks
from reference.spec import RolloutRequest, SamplingParams

ENGINES = ("cb_impl", "hf-generate", "transformers-cb")
# vLLM runs in its own environment (``make test-vllm``): the same properties, marked and skipped without it
VLLM = [pytest.param("vllm", marks=(pytest.mark.vllm, needs_vllm))]
SMALL = dict(max_requests=3, max_prompt_len=16, max_new_tokens=(1, 8))


@pytest.fixture(scope="module")
def llama_model(llama):
    return llama.model


class _Engines(dict):
    """One engine per name, built on first use and reused for the module."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def __missing__(self, name: str):
        self[name] = get_engine(name, self.model, **DEFAULT_ENGINE_OPTIONS.get(name, {}))
        return self[name]


@pytest.fixture(scope="module")
def engines(llama_model):
    return _Engines(llama_model)


@pytest.mark.parametrize("name", VLLM)
@given(requests=rollout_requests(**SMALL, greedy=True))
def test_vllm_greedy_tokens_match_the_reference(name, engines, llama_model, requests):
    got = engines[name].generate(requests)
    assert_matches_reference(llama_model, requests, got, engine=name, logprobs=False, conventions=False)


@pytest.mark.parametrize("name", VLLM)
@given(requests=rollout_requests(**SMALL))
def test_returned_logprobs_agree_with_the_reference_teacher_forced_on_the_engines_own_tokens(
    name, engines, llama_model, requests
):
    # vLLM applies min-p before top-p: the registered vllm-min-p-before-top-p, whose script holds it. This property
    # found it on its own (shrunk to one token at T=1.5, top-p 0.95, min-p 0.05); other draws must still agree.
    if name == "vllm":
        assume(not any(r.sampling.top_p < 1 and r.sampling.min_p > 0 for r in requests))
    engine = engines[name]
    got = engine.generate(requests)
    expected = compare.teacher_forced_logprobs(llama_model, requests, got, engine.capabilities.logprob_semantics)
    diff = compare.logprob_diffs(got, expected, requests)
    assert diff.max_abs <= FP32.logprob_max_abs and diff.mean_abs <= FP32.logprob_mean_abs, (
        f"{name}: max |dlogp| {diff.max_abs:.3g} at {diff.worst_request!r}[{diff.worst_position}], "
        f"mean {diff.mean_abs:.3g}"
    )


@pytest.mark.parametrize("name", VLLM)
@given(requests=rollout_requests(**SMALL, group_size=(1, 3)))
def test_results_are_complete_in_request_order_and_follow_the_eos_and_length_conventions(
    name, engines, llama_model, requests
):
    got = engines[name].generate(requests)
    assert not compare.check_results(requests, got), compare.check_results(requests, got)
    pairs = zip(requests, got, strict=True)
    problems = [p for request, rollout in pairs for p in compare.check_conventions(request, rollout)]
    assert not problems, problems


def _alone_and_in_crowd(engine, request, crowd, slot):
    """``request``'s rollout generated alone and at position ``slot`` of ``crowd``."""
    return engine.generate([request])[0], engine.generate([*crowd[:slot], request, *crowd[slot:]])[slot]


def _assert_invariant(engine, name, model, target, crowd, data) -> None:
    request = replace(target[0], request_id="target")
    alone, in_crowd = _alone_and_in_crowd(engine, request, crowd, data.draw(st.integers(0, len(crowd))))
    div = compare.compare_tokens(model, request, alone, in_crowd, engine=name, tier=FP32)
    assert div is None or div.accepted, div.describe()
    if alone.completion_ids == in_crowd.completion_ids:
        d = max((abs(a - b) for a, b in zip(alone.logprobs, in_crowd.logprobs, strict=True)), default=0.0)
        assert d * logprob_scale(request.sampling) <= FP32.logprob_max_abs, f"{name}: log-probs moved by {d:.3g}"


@pytest.mark.vllm
@needs_vllm
def test_vllm_in_its_batch_invariant_mode_is_held_to_the_claim(llama_model):
    """``batch_invariant=True`` claims invariance: held to it like any engine that claims it. Where the mode does not
    run, the failure must be the registered one (then an xfail naming it); anything else is a plain failure."""
    name = "vllm[batch-invariant]"
    try:
        engine = RemoteEngine(llama_model, engine="vllm", env="vllm", name=name, batch_invariant=True)
    except EngineError as err:
        finding = env_finding(name, [str(err)])
        assert finding is not None, f"an unregistered failure of vLLM's batch-invariant mode: {err}"
        pytest.xfail(f"{finding.id}: the mode does not run on this stack")
    assert engine.capabilities.claims_batch_invariance

    @settings(max_examples=10, deadline=None)
    @given(crowd=rollout_requests(**SMALL), target=rollout_requests(max_requests=1, max_prompt_len=16), data=st.data())
    def holds(crowd, target, data):
        _assert_invariant(engine, name, llama_model, target, crowd, data)

    try:
        holds()
    finally:
        engine.close()


@pytest.fixture(scope="module", autouse=True)
def batch_invariance_report(engines):
    """Not a test: after the module, measure the engines that do *not* claim batch invariance on a fixed greedy
    workload and print what changed in the terminal summary (a measurement to read, never a pass/fail)."""
    yield
    targets = [RolloutRequest(f"t{i}", tuple(tasks.prompt_ids(p)), SamplingParams(temperature=0.0, max_new_tokens=8),
                              seed=i, eos_token_ids=(tasks.EOS_ID,))
               for i, p in enumerate(tasks.make_problems(4, seed=7))]  # fmt: skip
    crowd = [replace(t, request_id=f"c{t.request_id}", prompt_ids=t.prompt_ids[:-2]) for t in targets]
    for name in [*ENGINES, *(["vllm"] if "vllm" in engines else [])]:  # vLLM only where this session built it
        if engines[name].capabilities.claims_batch_invariance:  # held to it by the conformance suite instead
            continue
        changed, worst = 0, 0.0
        for k, target in enumerate(targets):
            alone, in_crowd = _alone_and_in_crowd(engines[name], target, crowd, k % (len(crowd) + 1))
            changed += alone.completion_ids != in_crowd.completion_ids
            if alone.completion_ids == in_crowd.completion_ids:
                worst = max([worst, *(abs(a - b) for a, b in zip(alone.logprobs, in_crowd.logprobs, strict=True))])
        SUMMARY.append(f"batch invariance [{name}, not claimed]: {changed}/{len(targets)} greedy rollouts "
                            f"changed tokens in a crowd; max |dlogp| otherwise {worst:.3g}")  # fmt: skip
