"""Batch invariance beyond the conformance suite: vLLM's batch-invariant mode held to its claim (marked ``vllm``), and,
after the module, batch invariance *measured* (not claimed) on the engines that do not claim it.

Every built-in engine, vLLM included, is held to the cross-engine properties by the conformance suite
(``cbverify/conformance``, run on them by every ``pytest`` here through ``addopts``; vLLM's under ``-m vllm``): one
suite, the one a third party runs. vLLM declares its processor order (``Capabilities.deviations``), so the suite draws
around that domain and holds the declaration to being real.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbverify import compare
from cbverify.cli.verify import DEFAULT_ENGINE_OPTIONS
from cbverify.engines import EngineError, envs, get_engine
from cbverify.engines.remote import RemoteEngine
from cbverify.tolerances import FP32, logprob_scale
from cbverify.upstream.env_findings import env_finding
from property_tests.helpers import SUMMARY, needs_vllm
from property_tests.strategies import rollout_requests
from reference import tasks
from reference.spec import RolloutRequest, SamplingParams

ENGINES = ("cb_impl", "hf-generate", "transformers-cb")
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
def batch_invariance_report(engines, request):
    """Not a test: after the module, measure the engines that do *not* claim batch invariance on a fixed greedy
    workload and print what changed in the terminal summary (a measurement to read, never a pass/fail)."""
    yield
    targets = [RolloutRequest(f"t{i}", tuple(tasks.prompt_ids(p)), SamplingParams(temperature=0.0, max_new_tokens=8),
                              seed=i, eos_token_ids=(tasks.EOS_ID,))
               for i, p in enumerate(tasks.make_problems(4, seed=7))]  # fmt: skip
    crowd = [replace(t, request_id=f"c{t.request_id}", prompt_ids=t.prompt_ids[:-2]) for t in targets]
    vllm = request.config.getoption("markexpr").strip() == "vllm" and envs.problem("vllm") is None  # make test-vllm
    for name in [*ENGINES, *(["vllm"] if vllm else [])]:
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
