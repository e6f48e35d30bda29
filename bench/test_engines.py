"""The benchmark's engine runners produce contract-shaped outputs and count compute correctly (default run, CPU).

A tiny random Llama (``golden.build_models.llama_config``: hidden 128, vocab 32) keeps each example well under a
second; model-backed properties draw 6 examples (not the profile's 50) to stay inside bench/'s ~20 s share of the
default suite -- each example already covers a whole batch of requests.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from transformers import LlamaForCausalLM

from cbverify.bench import measure
from cbverify.bench.engines import EngineOptions, run_cb_impl, run_generate, run_transformers_cb
from cbverify.bench.workloads import LengthDist, Workload, make_requests
from golden.build_models import llama_config
from property_tests.strategies import bench_workloads


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config()).eval()


def _opts(requests, num_blocks: int = 64) -> EngineOptions:
    return EngineOptions(device="cpu", pad_token_id=0, num_blocks=num_blocks, max_batch_tokens=64, time_forwards=True)


@settings(max_examples=6)
@given(workload=bench_workloads(max_generations=4, max_prompts=2, max_len=12))
def test_generate_runs_every_row_to_the_longest_and_cuts_each_at_its_own_length(tiny_model, workload: Workload):
    requests = make_requests(workload, vocab_size=32)
    run = run_generate(tiny_model, requests, _opts(requests))
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
    run = run_cb_impl(tiny_model, requests, _opts(requests))
    lengths = [len(c) for c in run.completions]
    assert lengths == [r.sampling.max_new_tokens for r in requests]
    assert set(run.finish_reasons) == {"length"}
    assert run.forward_tokens >= measure.necessary_tokens(requests, lengths)
    assert run.kv_reserved_bytes == run.extra["stats"]["kv_cache_bytes"] > 0


def test_greedy_generate_and_cb_impl_agree_token_for_token_through_the_bench_runners(tiny_model):
    workload = Workload("gsm8k-like", 2, 3, LengthDist(6, 0.5, 2, 12), LengthDist(8, 0.5, 1, 16), 16,
                        temperature=0.0, seed=5)  # fmt: skip
    requests = make_requests(workload, vocab_size=32)
    ours = run_cb_impl(tiny_model, requests, _opts(requests))
    theirs = run_generate(tiny_model, requests, _opts(requests))
    assert theirs.completions == ours.completions


def test_transformers_cb_runner_stops_each_request_at_its_own_length(tiny_model):
    workload = Workload("gsm8k-like", 2, 2, LengthDist(5, 0.3, 2, 9), LengthDist(6, 0.6, 1, 12), 12, seed=3)
    requests = make_requests(workload, vocab_size=32)
    run = run_transformers_cb(tiny_model, requests, _opts(requests))
    assert [len(c) for c in run.completions] == [r.sampling.max_new_tokens for r in requests]
    assert set(run.finish_reasons) == {"length"}
    assert run.kv_reserved_bytes > 0 and run.ttft_s is not None
    lengths = [len(c) for c in run.completions]
    assert run.forward_tokens >= measure.necessary_tokens(requests, lengths)


def test_the_wasted_share_is_one_minus_necessary_over_forwarded():
    assert measure.wasted_share(30, 40) == pytest.approx(0.25)
    assert measure.wasted_share(30, 0) is None
