"""Engines with their own RNG sample from the reference's processed distribution (``cbverify.distribution``).

False-alarm budget: each call of ``distribution_test`` fails a correct engine with probability <= ALPHA (Holm over
all its node tests). The default run makes 2 engines x 3 scenarios = 6 calls, so its false-alarm rate is <= 6e-3 by
the union bound (the power meta-tests add 2 calls of a faulty engine, which must be rejected); the ``slow``
Hypothesis variant makes ``max_examples`` calls per engine at ALPHA / max_examples each (Bonferroni across
examples), so it keeps the same <= 1e-3 per engine. Engines are seeded, so a run is reproducible.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings

from cbverify.cli.verify import DEFAULT_ENGINE_OPTIONS
from cbverify.distribution import distribution_test
from cbverify.engines import get_engine
from cbverify.tolerances import DISTRIBUTION_ALPHA
from property_tests.helpers import needs_vllm
from property_tests.strategies import sampling_params
from reference import tasks
from reference.spec import RolloutRequest, SamplingParams

RNG_ENGINES = ("hf-generate", "transformers-cb")
ALPHA = DISTRIBUTION_ALPHA
PROMPTS = [tuple(tasks.prompt_ids(p)) for p in tasks.make_problems(2, seed=7, max_terms=3)]
SCENARIOS = {
    "T=1": SamplingParams(temperature=1.0, max_new_tokens=3),
    "T=0.7 top-k 5 top-p 0.9": SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=3),
    "T=1.5 min-p 0.05": SamplingParams(temperature=1.5, min_p=0.05, max_new_tokens=3),
}


def _requests(scenario: str) -> list[RolloutRequest]:
    return [RolloutRequest(f"d{i}", prompt, SCENARIOS[scenario], eos_token_ids=(tasks.EOS_ID,))
            for i, prompt in enumerate(PROMPTS)]  # fmt: skip


@pytest.fixture(scope="module")
def models(llama, qwen2):
    """The random Qwen2 (flat distributions: every node has several tokens with mass) and the trained Llama (peaked:
    most nodes are one token, so a sampler fault there would pass; only the vLLM tests use its architecture, with
    random weights)."""
    return {"llama": llama.model, "qwen2": qwen2.model}


class _OwnRNGIgnoringTemperature:
    """A correct own-RNG engine (``faulty.OwnRNG``) that samples at T=1 whatever is asked."""

    def __init__(self, model) -> None:
        from property_tests.faulty import OwnRNG

        self.inner = OwnRNG(model, seed=11)
        self.name, self.capabilities = "ignores-temperature", self.inner.capabilities

    def generate(self, requests):
        fixed = [replace(r, sampling=replace(r.sampling, temperature=1.0)) for r in requests]
        return self.inner.generate(fixed)


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "T=1"])  # at T=1 ignoring it is no fault
def test_each_scenario_has_the_power_to_catch_a_sampler_that_ignores_temperature(scenario, models):
    requests = _requests(scenario)
    engine = _OwnRNGIgnoringTemperature(models["qwen2"])
    result = distribution_test(engine, models["qwen2"], requests, num_samples=200, min_count=50, alpha=ALPHA)
    assert result.tests and not result.passed, result.describe()


@pytest.mark.parametrize("name", RNG_ENGINES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_own_rng_engines_sample_from_the_reference_processed_distribution(name, scenario, models):
    model = models["qwen2"]  # flat: on the trained Llama most nodes hold one token, and a wrong sampler passes
    engine = get_engine(name, model, **DEFAULT_ENGINE_OPTIONS.get(name, {}), seed=11)
    requests = _requests(scenario)
    result = distribution_test(engine, model, requests, num_samples=200, min_count=50, alpha=ALPHA)
    assert result.tests, "no node had enough samples: the test would be vacuous"
    assert result.passed, result.describe()


@pytest.mark.slow
@pytest.mark.parametrize("name", RNG_ENGINES)
@settings(max_examples=20)
@given(sampling=sampling_params(greedy=False, max_new_tokens=(1, 3)))
def test_own_rng_engines_sample_from_the_reference_distribution_for_any_sampling_parameters(name, sampling, models):
    engine = get_engine(name, models["qwen2"], **DEFAULT_ENGINE_OPTIONS.get(name, {}), seed=3)
    requests = [RolloutRequest("d", PROMPTS[0], sampling, eos_token_ids=(tasks.EOS_ID,))]
    result = distribution_test(engine, models["qwen2"], requests, num_samples=300, min_count=50, alpha=ALPHA / 20)
    assert result.passed, result.describe()


@pytest.fixture(scope="module")
def flat_llama(llama):
    """The bundled Llama's architecture with seeded random weights at init std 0.14: distributions flat enough for
    the test to have power (the trained Llama puts ~all mass on one token at most nodes, so a wrong temperature or
    processor would pass unseen), and a head size vLLM-CPU has kernels for (the random Qwen2's it has not)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(llama.model.config)
    config.initializer_range = 0.14
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def vllm_engine(flat_llama):
    engine = get_engine("vllm", flat_llama, seed=11)
    yield engine
    engine.close()


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_vllm_samples_from_the_reference_processed_distribution(scenario, flat_llama, vllm_engine):
    """vLLM's own per-request generators against the reference's processed distribution (top-p and min-p are never
    combined here: see vllm-min-p-before-top-p)."""
    requests = _requests(scenario)
    result = distribution_test(vllm_engine, flat_llama, requests, num_samples=200, min_count=50, alpha=ALPHA)
    assert result.tests, "no node had enough samples: the test would be vacuous"
    assert result.passed, result.describe()


@pytest.mark.vllm
@needs_vllm
def test_the_distribution_test_catches_a_vllm_adapter_that_ignores_temperature(flat_llama):
    from cbverify.engines.remote import RemoteEngine

    engine = RemoteEngine(flat_llama, engine="property_tests.faulty_vllm:IgnoresTemperature", env="vllm", seed=11)
    requests = _requests("T=1.5 min-p 0.05")
    result = distribution_test(engine, flat_llama, requests, num_samples=200, min_count=50, alpha=ALPHA)
    engine.close()
    assert result.tests and not result.passed, result.describe()
