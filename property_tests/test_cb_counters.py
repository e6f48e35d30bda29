"""What cb_impl counts, against counts made independently from the requests, the rollouts and the schedule: the
events ``cbverify verify`` reports (chunked prefills, shared prefills, copy-on-write copies), the token and step
counters and timers the benchmarks print, and the attention-padding statistic."""

from __future__ import annotations

import time

import pytest
import torch

from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from property_tests.helpers import assert_matches_reference, grpo_batch
from reference.spec import RolloutRequest, SamplingParams


def test_with_sharing_off_every_prompt_is_prefilled_and_the_token_counters_add_up(llama):
    """``enable_prefix_sharing=False``: no group shares a prefill, every prompt token goes through the model, and
    the counters (what verify and the benchmarks report) equal counts made from the requests and rollouts."""
    model, _ = llama
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, enable_prefix_sharing=False))
    assert engine.stats["num_prefill_tokens"] == 0
    requests = grpo_batch(num_prompts=2, group=3, max_new_tokens=5)
    got = engine.generate(requests)
    assert_matches_reference(model, requests, got, engine="cb_impl")
    stats = engine.stats
    assert stats["num_shared_prefills"] == 0
    assert stats["num_prefill_tokens"] == sum(len(r.prompt_ids) for r in requests)
    assert stats["num_decode_tokens"] == sum(len(r.completion_ids) - 1 for r in got)
    assert stats["num_generated_tokens"] == sum(len(r.completion_ids) for r in got)


@pytest.mark.parametrize("block_size", [4, 9])  # prompts of 18 and 27 tokens: end inside a block, at its end
def test_with_sharing_on_each_group_prefills_once_and_copies_its_partly_filled_block_once_per_follower(
    llama, block_size
):
    """A group of G requests with one prompt (room for all, no preemption): G - 1 followers forked from one prefill,
    the prompt's tokens through the model once per group, and, when the prompt ends inside a block, G - 1 copies of
    that shared block (every writer but the last copies it) -- the counters verify reports as events. Per request
    (``last_events``, what verify's mechanism table sums): each follower one shared prefill, and per group one copy
    made while 2 sequences held the block and G - 2 while 3 or more did."""
    model, _ = llama
    group = 3
    engine = LLMEngine(model, EngineConfig(block_size=block_size, num_blocks=64))
    requests = grpo_batch(num_prompts=2, group=group, max_new_tokens=5)
    got = engine.generate(requests)
    assert_matches_reference(model, requests, got, engine="cb_impl")
    prompts = [r.prompt_ids for r in requests[::group]]
    stats = engine.stats
    assert stats["num_preemptions"] == 0 and stats["num_shared_prefills"] == len(prompts) * (group - 1), stats
    assert stats["num_prefill_tokens"] == sum(len(p) for p in prompts), stats
    assert stats["num_cow_copies"] == sum(group - 1 for p in prompts if len(p) % block_size), stats
    events = engine.last_events
    total = lambda name: sum(e.get(name, 0) for e in events.values())  # noqa: E731
    assert total("shared_prefill") == len(prompts) * (group - 1)
    assert {rid for rid, e in events.items() if "shared_prefill" in e} == {
        r.request_id for i, r in enumerate(requests) if i % group}  # fmt: skip
    partial = sum(1 for p in prompts if len(p) % block_size)
    assert (total("cow_2"), total("cow_3plus")) == (partial, partial * (group - 2)), events
    assert total("preemption") == total("partial_prefill") == 0


def test_the_attention_pair_counters_count_each_step_s_needed_and_computed_query_key_pairs(llama):
    """Per step, a chunk of n queries after ``start`` cached tokens needs ``n * start + n(n+1)/2`` query-key pairs;
    each attention group (the decodes, the longer chunks) computes its S x Q x L grid. Summed over the steps of a
    chunked GRPO run, the runner's counters equal those counts from the schedule, and the padding waste that verify
    and the benchmarks print is ``1 - needed / computed``."""
    model, _ = llama
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=16))
    steps: list[list[tuple[int, int]]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        steps.append([(seq.num_computed_tokens, n) for seq, n in batch.chunks])
        return batch

    engine.scheduler.schedule = recording_schedule
    engine.generate(grpo_batch(num_prompts=2, group=3, max_new_tokens=6))
    needed = sum(n * start + n * (n + 1) // 2 for chunks in steps for start, n in chunks)
    computed = 0
    for chunks in steps:
        for group in ([c for c in chunks if c[1] == 1], [c for c in chunks if c[1] > 1]):
            if group:
                computed += len(group) * max(n for _, n in group) * max(start + n for start, n in group)
    assert any(n > 1 and start > 0 for chunks in steps for start, n in chunks), "no chunked prefill was exercised"
    assert int(engine.runner.num_pairs) == needed and engine.runner.num_padded_pairs == computed
    assert not torch.is_floating_point(engine.runner.num_pairs), "a float32 count is inexact beyond 2**24 pairs"
    assert engine.stats["attention_padding_waste"] == pytest.approx(1 - needed / computed, rel=1e-12)


@pytest.mark.parametrize(("prompt_len", "budget"), [(10, 4), (9, 3), (5, 8), (12, 1), (5, 3)])
def test_the_event_counters_verify_reports_count_what_happened(llama, prompt_len, budget):
    """One request alone, its prompt prefilled in chunks of ``budget`` tokens: ceil(P / B) - 1 of its prefill steps are
    partial (what ``verify`` reports as chunked prefills), and each generate() adds its requests to the count."""
    engine = LLMEngine(llama.model, EngineConfig(num_blocks=32, block_size=4, max_batch_tokens=budget))
    prompt = tuple((1, 6, 5, 16, 7, 5, 3, 4, 8, 9, 10, 11)[:prompt_len])
    sampling = SamplingParams(temperature=0.0, max_new_tokens=2)
    engine.generate([RolloutRequest("one", prompt, sampling, eos_token_ids=())])
    chunks, new = -(-prompt_len // budget), sampling.max_new_tokens
    assert engine.stats["num_partial_prefills"] == chunks - 1
    assert engine.stats["num_requests"] == 1
    # the step and token counters the benchmarks report: one step per prefill chunk, then one per further token
    expected = dict(num_steps=chunks + new - 1, num_forward_tokens=prompt_len + new - 1, num_decode_tokens=new - 1,
                    num_prefill_tokens=prompt_len, num_generated_tokens=new)  # fmt: skip
    assert {k: engine.stats[k] for k in expected} == expected
    engine.generate([RolloutRequest(f"g{i}", prompt, sampling, eos_token_ids=()) for i in range(3)])
    assert engine.stats["num_requests"] == 4


def test_the_step_timers_add_up_to_the_time_spent_in_steps(llama):
    """``schedule_s`` / ``model_s`` / ``sample_s`` (printed by the benchmarks) each accumulate over the steps: all
    positive, together within the call's wall time and most of it (a timer holding only the last step, counting down,
    adding clock readings or starting above zero fails)."""
    engine = LLMEngine(llama.model, EngineConfig(block_size=4, num_blocks=32))
    requests = [RolloutRequest(f"r{i}", (1, 2, 3 + i), SamplingParams(temperature=0.0, max_new_tokens=12))
                for i in range(3)]  # fmt: skip
    start = time.perf_counter()
    engine.generate(requests)
    wall = time.perf_counter() - start
    stats = engine.stats
    timers = [stats[k] for k in ("schedule_s", "model_s", "sample_s")]
    assert stats["num_steps"] >= 10 and all(t > 0 for t in timers), stats
    assert 0.5 * wall <= sum(timers) <= wall, (timers, wall)


def test_each_step_timer_accumulates_its_own_interval_of_every_step(llama, monkeypatch):
    """Against a fake clock whose readings within a step are 1, 2 and 4 s apart (schedule, model, sample), every
    timer is exactly its interval times the number of steps: one that keeps only the last step, swaps two readings or
    drops a step is off by whole seconds."""
    import itertools
    from types import SimpleNamespace

    import cb_impl.engine

    gaps = itertools.cycle([8.0, 1.0, 2.0, 4.0])  # (the first reading), t0 -> t1 -> t2 -> end of the step
    clock = itertools.accumulate(gaps)
    monkeypatch.setattr(cb_impl.engine, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    engine = LLMEngine(llama.model, EngineConfig(block_size=4, num_blocks=32))
    engine.generate([RolloutRequest("r", (1, 2, 3), SamplingParams(temperature=0.0, max_new_tokens=5))])
    n = engine.stats["num_steps"]
    assert n == 5 and [engine.stats[k] for k in ("schedule_s", "model_s", "sample_s")] == [n * 1.0, n * 2.0, n * 4.0]


def test_a_group_decoding_wider_than_the_token_budget_counts_no_partial_prefill_after_its_prompt(llama):
    """A group of four sharing one 3-token prompt with a budget of 2 tokens a step: the prompt takes two steps (one
    partial prefill), then the four members decode two at a time (six steps). A member left without budget in a step
    is not scheduled at all (not as an empty chunk counted as a partial prefill), and the tokens are the oracle's."""
    from reference.generate import generate as reference_generate

    engine = LLMEngine(llama.model, EngineConfig(num_blocks=32, block_size=4, max_batch_tokens=2))
    requests = [RolloutRequest(f"g{i}", (1, 6, 5), SamplingParams(temperature=1.0, max_new_tokens=4), seed=i,
                               eos_token_ids=()) for i in range(4)]  # fmt: skip
    got = engine.generate(requests)
    assert engine.stats["num_partial_prefills"] == 1, engine.stats
    assert engine.stats["num_forward_tokens"] == 3 + 4 * 3, "the prompt once, then every token but the last"
    assert engine.stats["num_steps"] == 2 + 4 * 3 // 2, "two prompt steps, then every decode step spends its budget"
    assert [r.completion_ids for r in got] == [r.completion_ids for r in reference_generate(llama.model, requests)]


def test_requests_with_different_prompts_are_all_prefilled_in_the_first_step_when_they_fit(llama):
    """Prefix sharing on, three distinct prompts within the budget: one step prefills all three (the search for a
    group ends at the first different prompt, it does not end the admission), then one step per further token."""
    engine = LLMEngine(llama.model, EngineConfig(num_blocks=32, block_size=4, max_batch_tokens=64))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=3)
    engine.generate([RolloutRequest(f"r{i}", (1, 6, 5 + i), sampling, eos_token_ids=()) for i in range(3)])
    assert engine.stats["num_steps"] == 3 and engine.stats["num_forward_tokens"] == 3 * 3 + 3 * 2, engine.stats
