"""The benchmark drives the harness adapters (``cbverify.bench.timed.run_engine``): contract-shaped outputs, compute
counted correctly, and the adapter options the benchmark relies on behave as documented (default run, CPU).

A tiny random Llama (``golden.build_models.llama_config``: hidden 128, vocab 32) keeps each example well under a
second; model-backed properties draw 6 examples (not the profile's 50) to stay inside bench/'s ~20 s share of the
default suite -- each example already covers a whole batch of requests.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from transformers import LlamaForCausalLM

from cbverify.bench import measure
from cbverify.bench.timed import EngineOptions, run_engine
from cbverify.bench.workloads import LengthDist, Workload, make_requests
from cbverify.engines import NotApplicable, get_engine
from golden.build_models import llama_config
from property_tests.strategies import bench_workloads
from reference.spec import RolloutRequest, SamplingParams


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config()).eval()


def _opts(num_blocks: int = 64) -> EngineOptions:
    return EngineOptions(device="cpu", num_blocks=num_blocks, max_batch_tokens=64, time_forwards=True)


@settings(max_examples=6)
@given(workload=bench_workloads(max_generations=4, max_prompts=2, max_len=12))
def test_hf_generate_runs_every_row_to_the_longest_and_cuts_each_at_its_own_length(tiny_model, workload: Workload):
    requests = make_requests(workload, vocab_size=32)
    run = run_engine("hf-generate", tiny_model, requests, _opts())
    assert [len(c) for c in run.completions] == [r.sampling.max_new_tokens for r in requests]
    assert set(run.finish_reasons) == {"length"}
    width, longest = max(len(r.prompt_ids) for r in requests), max(r.sampling.max_new_tokens for r in requests)
    # independent count: one (B, width) prefill, then one (B, 1) decode per further token
    assert run.forward_tokens == len(requests) * (width + longest - 1)
    assert run.steps == longest
    layer_bytes = 2 * len(requests) * (width + longest - 1) * llama_config().num_key_value_heads * 32 * 4
    assert run.kv_reserved_bytes == llama_config().num_hidden_layers * layer_bytes
    assert 0 < run.forward_s <= run.wall_s and 0 < run.ttft_s <= run.wall_s


@settings(max_examples=6)
@given(workload=bench_workloads(max_generations=4, max_prompts=2, max_len=12))
def test_cb_impl_runner_honours_per_request_lengths_and_never_computes_less_than_needed(tiny_model, workload):
    requests = make_requests(workload, vocab_size=32)
    run = run_engine("cb_impl", tiny_model, requests, _opts())
    lengths = [len(c) for c in run.completions]
    assert lengths == [r.sampling.max_new_tokens for r in requests]
    assert set(run.finish_reasons) == {"length"}
    assert run.forward_tokens >= measure.necessary_tokens(requests, lengths)
    assert run.kv_reserved_bytes == run.extra["stats"]["kv_cache_bytes"] > 0
    assert 0 < run.ttft_s <= run.wall_s and run.setup_s > 0


def test_greedy_hf_generate_and_cb_impl_agree_token_for_token_through_the_bench_runners(tiny_model):
    workload = Workload("gsm8k-like", 2, 3, LengthDist(6, 0.5, 2, 12), LengthDist(8, 0.5, 1, 16), 16,
                        temperature=0.0, seed=5)  # fmt: skip
    requests = make_requests(workload, vocab_size=32)
    ours = run_engine("cb_impl", tiny_model, requests, _opts())
    theirs = run_engine("hf-generate", tiny_model, requests, _opts())
    assert theirs.completions == ours.completions


def test_transformers_cb_runner_stops_each_request_at_its_own_length(tiny_model):
    workload = Workload("gsm8k-like", 2, 2, LengthDist(5, 0.3, 2, 9), LengthDist(6, 0.6, 1, 12), 12, seed=3)
    requests = make_requests(workload, vocab_size=32)
    run = run_engine("transformers-cb", tiny_model, requests, _opts())
    assert [len(c) for c in run.completions] == [r.sampling.max_new_tokens for r in requests]
    assert set(run.finish_reasons) == {"length"}
    assert run.kv_reserved_bytes > 0 and 0 < run.ttft_s <= run.wall_s
    assert run.setup_s > 0, "manager construction, warm-up, start and stop are setup, outside the window"
    assert run.extra["cb_config"]["max_memory_percent"] == 0.5, "driven with TRL's memory share"
    lengths = [len(c) for c in run.completions]
    assert run.forward_tokens >= measure.necessary_tokens(requests, lengths)


def test_hf_generate_without_logprobs_gives_the_same_greedy_tokens_and_declares_none(tiny_model):
    workload = Workload("gsm8k-like", 2, 3, LengthDist(6, 0.5, 2, 12), LengthDist(8, 0.5, 1, 16), 16,
                        temperature=0.0, seed=9)  # fmt: skip
    requests = make_requests(workload, vocab_size=32)
    with_lp = get_engine("hf-generate", tiny_model)
    without_lp = get_engine("hf-generate", tiny_model, return_logprobs=False)
    a, b = with_lp.generate(requests), without_lp.generate(requests)
    assert [r.completion_ids for r in b] == [r.completion_ids for r in a]
    assert [r.finish_reason for r in b] == [r.finish_reason for r in a]
    assert without_lp.capabilities.logprob_semantics == "none"
    assert with_lp.capabilities.logprob_semantics == "processed", "the option changes the instance, not the class"
    assert all(math.isnan(x) for r in b for x in r.logprobs) and all(math.isfinite(x) for r in a for x in r.logprobs)
    assert without_lp.last_run.generate_s > 0 and without_lp.last_run.kv_reserved_bytes > 0


def test_transformers_cb_with_one_shared_config_refuses_a_group_with_mixed_sampling(tiny_model):
    engine = get_engine("transformers-cb", tiny_model, per_request_processors=False)
    requests = [RolloutRequest(f"r{i}", (1, 5, 6), SamplingParams(temperature=t, max_new_tokens=3), seed=i)
                for i, t in enumerate((1.0, 0.7))]  # fmt: skip
    with pytest.raises(NotApplicable, match="per_request_processors=False"):
        engine.generate(requests)
    same = [RolloutRequest(r.request_id, r.prompt_ids, requests[0].sampling, r.seed) for r in requests]
    assert [len(r.completion_ids) for r in engine.generate(same)] == [3, 3], "a shared configuration is served"


def test_the_wasted_share_is_one_minus_necessary_over_forwarded():
    assert measure.wasted_share(30, 40) == pytest.approx(0.25)
    assert measure.wasted_share(30, 0) is None
