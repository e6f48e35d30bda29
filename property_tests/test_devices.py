"""Every tensor the oracle and cb_impl create names its device (the model's, or the host on purpose).

On a GPU, a tensor made without ``device=`` lands on the default device, the host, beside the model's CUDA tensors:
the step fails, or silently copies. On CPU the same slip is invisible, because the default device *is* the model's.
These properties make it visible without a GPU: they run under a foreign default device, ``meta`` (tensors with a
shape and no data, which mix with no CPU tensor and cannot be read back), so a tensor created on the default device
breaks the run or its result, and the results must equal those computed outside it.

What they cannot see on CPU: a host tensor that should have been moved to the model's device and was not
(``.to(None)``), since there the host is the model's device. So each property also has a CUDA instance (marked
``gpu``, run by ``make test-gpu``): the same body with the model on CUDA, still under the foreign default device.
"""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cb_impl import tuning
from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from cb_impl.sampler import build_sampling_batch, sample, sampling_row
from conftest import requires_cuda
from property_tests.helpers import assert_matches_reference, grpo_batch
from property_tests.strategies import cb_arrival_plans, logits_batches, rollout_requests, sampling_params
from property_tests.test_cb_exactness import assert_engine_idle_and_clean, run_with_arrivals
from reference import logprobs as ref_logprobs
from reference.advantages import compute_advantages
from reference.generate import generate
from reference.models import load

FOREIGN = torch.device("meta")  # the default device inside these runs: no data, so any use of it fails
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])]
MODELS = ("tiny-llama-arith", "tiny-qwen2-random")


@cache
def _model(name: str, device: str):
    return load(name, device=device)[0]


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


def test_the_foreign_default_device_breaks_a_tensor_made_without_a_device():
    """The premise: under ``FOREIGN``, a tensor made without ``device=`` cannot meet a CPU tensor or be read back."""
    host = torch.arange(4)
    with FOREIGN:
        stray = torch.arange(4)
        assert stray.device == FOREIGN and torch.arange(4, device="cpu").device.type == "cpu"
        for use in (lambda: host + stray, lambda: torch.cat([host, stray]), stray.tolist):
            try:
                use()
            except (RuntimeError, NotImplementedError):
                continue
            raise AssertionError(f"{use} mixed a {FOREIGN} tensor with host data without an error")


@pytest.mark.parametrize("name", MODELS)
@given(data=st.data())
def test_the_oracle_makes_no_tensor_on_the_default_device(device, name, data):
    """``generate`` and the log-prob and advantage functions give the same results under ``FOREIGN``."""
    model = _model(name, device)
    requests = data.draw(rollout_requests(max_requests=3, max_prompt_len=12, max_new_tokens=(1, 6)), label="requests")
    rollouts = generate(model, requests)
    prompts, completions = [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts]
    samplings = [r.sampling for r in requests]
    groups = data.draw(st.integers(1, 3), label="groups")
    rewards = data.draw(st.lists(st.floats(-2, 2), min_size=2 * groups, max_size=2 * groups), label="rewards")
    rewards = torch.tensor(rewards, device=device)

    def everything() -> tuple:
        triples = zip(prompts, completions, samplings, strict=True)
        tops = [ref_logprobs.top_logprobs(model, p, c, k=2, sampling=s) for p, c, s in triples]
        return (generate(model, requests), ref_logprobs.per_token_logps(model, prompts, completions, 0.7),
                ref_logprobs.processed_per_token_logps(model, prompts, completions, samplings), tops,
                compute_advantages(rewards, 2))  # fmt: skip

    outside = everything()
    with FOREIGN:
        inside = everything()
    assert inside[0] == outside[0] == rollouts, name
    for got, want in zip(inside[1:], outside[1:], strict=True):
        _assert_equal(got, want, name)


def _assert_equal(got, want, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert got.device == want.device and torch.equal(got, want), (where, got, want)
    else:
        assert len(got) == len(want), where
        for g, w in zip(got, want, strict=True):
            _assert_equal(g, w, where)


@pytest.mark.parametrize("name", MODELS)
@given(data=st.data())
def test_cb_impl_makes_no_tensor_on_the_default_device(device, name, data):
    """The engine, built and run under ``FOREIGN`` (chunked prefills, arrivals between steps, sharing, preemption,
    greedy and sampled rows), returns the oracle's rollouts."""
    model = _model(name, device)
    requests = data.draw(rollout_requests(max_requests=2, max_prompt_len=16, max_new_tokens=(1, 10),
                                          group_size=(1, 3)), label="requests")  # fmt: skip
    config, order, steps = data.draw(cb_arrival_plans(requests=requests), label="plan")
    with FOREIGN:
        engine = LLMEngine(model, EngineConfig(**config))
        rollouts = run_with_arrivals(engine, requests, order, steps)
    repro = f"model={name} device={device} config={config}"
    assert_matches_reference(model, requests, rollouts, engine="cb_impl", repro=repro)
    assert_engine_idle_and_clean(engine)


@pytest.mark.parametrize("settings", ["own", "graphs"])
def test_cb_impl_preempts_shares_and_copies_on_write_with_no_tensor_on_the_default_device(device, settings):
    """A tight cache with GRPO groups under ``FOREIGN``: the run must preempt, share and copy on write, release its
    cache and run again, and give the oracle's rollouts; with the device's own tuning and with decode graphs
    (``cb_impl.graphs``: CUDA graphs on CUDA, their stand-in on the CPU)."""
    if settings == "graphs" and device == "cuda":
        pytest.skip("on CUDA the device's own tuning is the one with graphs: the [cuda-own] case")
    model = _model("tiny-llama-arith", device)
    requests = grpo_batch(num_prompts=3, group=4, max_new_tokens=16)
    longest = max(len(r.prompt_ids) for r in requests) + 16
    with FOREIGN:
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=-(-longest // 4) + 4, max_batch_tokens=16))
        if settings == "graphs":
            engine.runner.set_tuning(tuning.ACCELERATOR)
        first = engine.generate(requests)
        engine.release_cache()
        again = engine.generate(requests)
    stats = engine.stats
    assert stats["num_preemptions"] > 0 and stats["num_shared_prefills"] > 0 and stats["num_cow_copies"] > 0, stats
    assert again == first
    assert (stats["num_graph_replays"] > 0) == (settings == "graphs" or device == "cuda"), stats
    assert_matches_reference(model, requests, first, engine="cb_impl", repro="tight-cache GRPO batch under meta")


@given(logits=logits_batches(), data=st.data())
def test_cb_impl_sampler_makes_no_tensor_on_the_default_device(device, logits, data):
    """``sample`` on a batch of greedy and sampled rows gives the same tokens and log-probs under ``FOREIGN``."""
    rows = [sampling_row(data.draw(sampling_params(), label=f"sampling {i}"), i) for i in range(logits.shape[0])]
    logits, positions = logits.to(device), torch.arange(logits.shape[0], dtype=torch.int64, device=device) * 3

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return sample(logits, build_sampling_batch(rows, logits.device), positions, budget=logits.shape[1] * 2)

    outside = run()
    with FOREIGN:
        inside = run()
    _assert_equal(inside, outside, "sample")


@pytest.mark.parametrize("bench_device", [pytest.param("cpu", marks=pytest.mark.slow), *DEVICES[1:]])
def test_cbverify_bench_runs_every_engine_and_the_grpo_step_end_to_end(bench_device, tmp_path):
    """``cbverify bench`` on the device, one small case of every default engine and one GRPO step per path after a
    warm-up: exit 0 (no case errored or failed its output checks), every case and GRPO row measured."""
    from cbverify.cli import main

    args = ["bench", "--device", bench_device, "--workload", "arith", "--n", "8", "--rounds", "1", "--grpo-n", "8",
            "--grpo-steps", "2", "--grpo-rounds", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert {c["engine"] for c in result["cases"]} == {"hf-generate", "transformers-cb", "cb_impl"}
    assert all(c["tokens_per_s"] > 0 and not c["check_problems"] for c in result["cases"]), result["cases"]
    rows = result["grpo"]["rows"]
    assert {r["path"] for r in rows} == {"generate", "transformers-cb", "cb_impl"}
    assert all("error" not in r and r["step_s"] > 0 for r in rows), rows
