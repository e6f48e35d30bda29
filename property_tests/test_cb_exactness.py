"""cb_impl returns the reference oracle's rollouts (fp32 tier of ``cbverify.tolerances``) whatever the engine does
internally.

For any batch (greedy and sampled, per-request parameters, EOS sets, GRPO groups), any arrival order and timing
(incremental ``add_request`` between steps), block size, chunk size (``max_batch_tokens``), seat count and memory
budget (down to one sequence: preemption by recompute), with prefix sharing on or off, on every bundled model:
tokens are identical (a divergence only at a reported near-tie) and log-probs agree within the fp32 tier.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cb_impl import tuning
from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from cbverify.tolerances import FP32
from conftest import per_model_examples
from property_tests.helpers import assert_matches_reference, grpo_batch
from property_tests.strategies import cb_arrival_plans, rollout_requests
from reference.spec import Rollout, RolloutRequest

# How a step's work is split (cb_impl.tuning): the CPU's own, the CPU's cut to a sequence per attention slice and a
# row per sampling slice, a middle budget, and the accelerator's (one call per group, exact noise, folded GQA).
TUNINGS = {
    "cpu": tuning.CPU,
    "cpu-one-sequence-per-slice": replace(tuning.CPU, gather_budget=1, sample_budget=1),
    "cpu-4096": replace(tuning.CPU, gather_budget=4096),
    "accelerator": tuning.ACCELERATOR,
}


def run_with_arrivals(engine: LLMEngine, requests: list[RolloutRequest], order: list[int], steps: list[int]) -> list:
    """Add ``requests[order[k]]`` before engine step ``steps[k]``; step until all finish; rollouts in request order."""
    pending = [(steps[k], requests[i]) for k, i in enumerate(order)]
    results: dict[str, Rollout] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        if engine.has_unfinished():
            for rollout in engine.step():
                assert rollout.request_id not in results, f"{rollout.request_id} finished twice"
                results[rollout.request_id] = rollout
        step += 1
    return [results[r.request_id] for r in requests]


def assert_engine_idle_and_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "KV-cache blocks leaked"
    engine.block_manager.check_invariants([])


# The budget stays the one this property had on the first two bundled models (the profile's examples on each), now
# shared by all of them: a parameter per model rather than a model drawn per example, so that each model gets its
# share whatever the shrinker prefers and a failure names its model in the test id.
@settings(max_examples=per_model_examples(2))
@given(data=st.data())
def test_cb_matches_reference_for_any_batch_arrival_chunking_sharing_and_memory_budget(bundled_model, data):
    name, model, _ = bundled_model
    requests = data.draw(rollout_requests(max_requests=2, max_prompt_len=16, max_new_tokens=(1, 12),
                                          group_size=(1, 3)), label="requests")  # fmt: skip
    config, order, steps = data.draw(cb_arrival_plans(requests=requests), label="plan")
    engine = LLMEngine(model, EngineConfig(**config))
    settings_name = data.draw(st.sampled_from(sorted(TUNINGS)), label="tuning")  # the accelerator's, tested here too
    engine.runner.set_tuning(TUNINGS[settings_name])
    rollouts = run_with_arrivals(engine, requests, order, steps)
    repro = f"model={name} config={config} order={order} tuning={settings_name}"
    assert_matches_reference(model, requests, rollouts, engine="cb_impl", repro=repro)
    assert_engine_idle_and_clean(engine)


def _assert_same(got: object, want: object, where: str) -> None:
    """Step inputs (tensors, groups of tensors, counts) equal field by field."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), (where, got, want)
    elif isinstance(want, tuple | list) or hasattr(want, "__slots__"):
        fields = [getattr(want, f) for f in want.__slots__] if hasattr(want, "__slots__") else want
        other = [getattr(got, f) for f in want.__slots__] if hasattr(want, "__slots__") else got
        assert len(other) == len(fields), (where, got, want)
        for i, (g, w) in enumerate(zip(other, fields, strict=True)):
            _assert_same(g, w, f"{where}.{i}")
    else:
        assert got == want, (where, got, want)


def run_checking_reused_metadata(engine: LLMEngine, requests: list, order: list[int], steps: list[int]) -> int:
    """Run, and at every step rebuild the metadata from the sequences beside the engine's own (which a decode step
    advances from the last one): both must be equal. Returns how many steps advanced the last step's."""
    runner, reused = engine.runner, [0]
    build = runner._metadata

    def checked(batch, padded):
        last = runner._decodes
        got = build(batch, padded)
        kept, runner._decodes = runner._decodes, None
        want = build(batch, padded)  # from the sequences alone
        runner._decodes = kept
        reused[0] += last is not None and last[0] == padded and not batch.tables_changed and batch.chunks == last[1]
        _assert_same(got, want, "step inputs")
        return got

    runner._metadata = checked
    run_with_arrivals(engine, requests, order, steps)
    return reused[0]


def draw_run(data: st.DataObject, model: torch.nn.Module, settings: tuning.DeviceTuning | None = None) -> tuple:
    """Up to 3 requests (groups too, up to 24 new tokens), an engine of a drawn config with ``settings`` (else a
    drawn tuning: the CPU's or the accelerator's) and an arrival plan: (engine, requests, order, steps, config)."""
    requests = data.draw(rollout_requests(max_requests=3, max_prompt_len=16, max_new_tokens=(1, 24),
                                          group_size=(1, 3)), label="requests")  # fmt: skip
    config, order, steps = data.draw(cb_arrival_plans(requests=requests), label="plan")
    engine = LLMEngine(model, EngineConfig(**config))
    if settings is None:
        settings = TUNINGS[data.draw(st.sampled_from(["cpu", "accelerator"]), label="tuning")]
    engine.runner.set_tuning(settings)
    return engine, requests, order, steps, config


@given(data=st.data())
def test_a_decode_step_that_advances_the_last_steps_metadata_equals_one_rebuilt_from_the_sequences(llama, data):
    """Also padded to the graph buckets (the accelerator's tuning): its padding rows stay at position 0."""
    engine, requests, order, steps, _ = draw_run(data, llama.model)
    run_checking_reused_metadata(engine, requests, order, steps)


@pytest.mark.parametrize("settings_name", ["cpu", "accelerator"])
def test_decode_steps_of_grpo_groups_advance_the_last_steps_metadata_and_equal_a_rebuild(llama, settings_name):
    model, _ = llama
    requests = grpo_batch(num_prompts=2, group=3, max_new_tokens=24)
    engine = LLMEngine(model, EngineConfig(block_size=4))
    engine.runner.set_tuning(TUNINGS[settings_name])
    reused = run_checking_reused_metadata(engine, requests, list(range(len(requests))), [0] * len(requests))
    assert 0 < reused < engine.stats["num_steps"], (reused, engine.stats["num_steps"])  # both paths ran


def test_cb_preempts_shares_prompts_and_copies_on_write_without_changing_any_rollout(llama):
    """A tight cache with GRPO groups: the run must really preempt, share and copy on write, and stay exact."""
    model, _ = llama
    requests = grpo_batch(num_prompts=3, group=4, max_new_tokens=20)
    longest = max(len(r.prompt_ids) for r in requests) + 20
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=-(-longest // 4) + 4, max_batch_tokens=16))
    rollouts = engine.generate(requests)
    stats = engine.stats
    assert stats["num_preemptions"] > 0 and stats["num_shared_prefills"] > 0 and stats["num_cow_copies"] > 0, stats
    assert_matches_reference(model, requests, rollouts, engine="cb_impl", repro="tight-cache GRPO batch")
    assert_engine_idle_and_clean(engine)


def test_cb_engine_is_persistent_and_reads_weights_live(llama):
    """Two generate() calls on one engine: same cache object, same answers; after a weight update the engine's
    answers follow the new weights (equal the reference on the updated model) with no sync step."""
    model, _ = llama
    model = type(model)(model.config).eval()
    model.load_state_dict(llama.model.state_dict())
    requests = grpo_batch(num_prompts=2, group=2, max_new_tokens=12)
    engine = LLMEngine(model, EngineConfig(block_size=8, num_blocks=64))
    cache = engine.runner.cache.key
    first = engine.generate(requests)
    assert engine.generate(requests) == first
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # a drastic "training step"
    updated = engine.generate(requests)
    assert engine.runner.cache.key is cache, "the engine re-initialised its KV cache between calls"
    assert [r.completion_ids for r in updated] != [r.completion_ids for r in first]
    assert_matches_reference(model, requests, updated, engine="cb_impl", repro="after an in-place weight update")


@pytest.mark.parametrize("sharing", [True, False])
def test_cb_generate_equals_incremental_arrivals_for_the_same_requests(llama, sharing):
    model, _ = llama
    requests = grpo_batch(num_prompts=2, group=3, max_new_tokens=10)
    config = EngineConfig(block_size=4, num_blocks=40, max_batch_tokens=8, enable_prefix_sharing=sharing)
    batch = LLMEngine(model, config).generate(requests)
    order = list(reversed(range(len(requests))))
    incremental = run_with_arrivals(LLMEngine(model, config), requests, order, [0, 0, 1, 3, 3, 7])
    assert [r.completion_ids for r in batch] == [r.completion_ids for r in incremental]
    # each side is within the tier of the reference, so the two sides are within twice the tier of each other
    assert max(abs(a - b) for x, y in zip(batch, incremental, strict=True)
               for a, b in zip(x.logprobs, y.logprobs, strict=True)) <= 2 * FP32.logprob_max_abs  # fmt: skip
    repro = f"incremental arrivals, sharing={sharing}"
    assert_matches_reference(model, requests, incremental, engine="cb_impl", repro=repro)


def test_a_released_cache_is_refused_while_busy_and_gives_the_same_rollouts_in_fresh_memory(llama):
    """``release_cache`` hands the KV cache's pages back while the engine is idle: refused while a request is queued
    (the cache untouched), then the cache is new memory of the same shape and dtype, and the same requests give the
    same rollouts as before the release, the reference's."""
    model, _ = llama
    requests = grpo_batch(num_prompts=2, group=3, max_new_tokens=12)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=48, max_batch_tokens=16))
    first = engine.generate(requests)
    cache = engine.runner.cache
    key, value = cache.key, cache.value
    engine.add_request(requests[0])
    with pytest.raises(RuntimeError, match="release_cache\\(\\) needs an idle engine"):
        engine.release_cache()
    assert cache.key is key and cache.value is value
    engine.abort_all()
    engine.release_cache()
    assert cache.key is not key and cache.value is not value
    assert (cache.key.shape, cache.key.dtype, cache.value.shape) == (key.shape, key.dtype, value.shape)
    assert engine.generate(requests) == first
    assert_matches_reference(model, requests, first, engine="cb_impl", repro="after release_cache")
    assert_engine_idle_and_clean(engine)
