"""Decode steps from graphs (``cb_impl.graphs``): padded to buckets, replayed on static inputs, still the oracle's.

On the CPU the recorder is the graph's eager stand-in (``ReplayedForward``: a replay reads the bucket's static inputs
and writes the recorded output tensor), so everything but the CUDA capture runs here:

- a padded step's inputs are the unpadded step's, plus padding rows that write and read only the scratch block;
- graphs are recorded once per bucket and replayed at every decode step, and the rollouts are the oracle's;
- a graph sees weights updated in place; weights or a KV cache that moved drop every graph, which is recorded again;
- a forward that cannot be recorded turns the graphs off with a warning, and the run stays exact.

The CUDA instance (marked ``gpu``) records real CUDA graphs, holds them to the eager run of the same engine and the
oracle, and reports both runs' warm times in the session summary.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cb_impl import graphs, model_runner, tuning
from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from conftest import requires_cuda
from property_tests.helpers import SUMMARY, assert_matches_reference, grpo_batch
from property_tests.test_cb_exactness import assert_engine_idle_and_clean, draw_run, run_with_arrivals
from reference.models import load


@given(n=st.integers(1, 4096))
def test_a_batch_bucket_holds_the_batch_with_a_bounded_padding(n):
    b = graphs.batch_bucket(n)
    assert n <= b and b <= graphs.batch_bucket(n + 1), (n, b)
    assert (b & (b - 1) == 0 and b < 2 * n) if n <= 32 else (b % 32 == 0 and b - n < 32), (n, b)


@given(length=st.integers(1, 1 << 16), room=st.integers(0, 1 << 12))
def test_a_length_bucket_holds_the_keys_adds_less_than_a_quarter_and_stays_inside_the_grid(length, room):
    limit = length + room
    b = graphs.length_bucket(length, limit)
    assert length <= b <= limit and b <= graphs.length_bucket(length + 1, limit + 1), (length, limit, b)
    assert b == min(16, limit) or 4 * (b - length) < length, (length, b)


def test_four_length_buckets_an_octave():
    for k in range(5, 14):
        assert len({graphs.length_bucket(n, 1 << 20) for n in range((1 << k) + 1, (1 << (k + 1)) + 1)}) == 4, k


def _padded_steps(engine: LLMEngine) -> list[tuple]:
    """Wrap the runner's metadata: for every padded step, (its inputs, the same step's unpadded inputs, chunks)."""
    runner, seen = engine.runner, []
    build = runner._metadata

    def recorded(batch, padded):
        got = build(batch, padded)
        if padded:
            kept, runner._decodes = runner._decodes, None
            seen.append((got, build(batch, False), len(batch.chunks)))
            runner._decodes = kept
        return got

    runner._metadata = recorded
    return seen


def _assert_padding_only_touches_the_scratch_block(engine: LLMEngine, steps: list[tuple]) -> None:
    """Each padded step: the unpadded step's values on its rows and valid keys, padding rows in the scratch block."""
    bs, scratch = engine.config.block_size, engine.runner.cache.scratch_block
    for (ids, pos, meta, _), (ids0, pos0, meta0, _), num in steps:
        rows = graphs.batch_bucket(num)
        (g,), (g0,) = meta.groups, meta0.groups
        length, keys = g0.kv_slots.shape[1], g.kv_slots.shape[1]
        assert ids.shape == pos.shape == (1, rows) and keys == graphs.length_bucket(length, keys), (rows, keys)
        assert torch.equal(ids[:, :num], ids0) and torch.equal(pos[:, :num], pos0), "the chunks' tokens / positions"
        assert torch.equal(meta.slot_mapping[:num], meta0.slot_mapping), "a chunk's token writes elsewhere"
        mask0 = torch.ones_like(g0.kv_slots, dtype=torch.bool)[:, None, None] if g0.mask is None else g0.mask
        assert torch.equal(g.mask[:num, ..., :length], mask0) and not g.mask[:num, ..., length:].any(), "mask"
        assert torch.equal(g.kv_slots[:num, :length], g0.kv_slots), "the keys a chunk reads"
        assert (g.kv_slots[:num, length:] == g0.kv_slots[:, :1]).all(), "a padded key column: the row's position 0"
        assert (pos[0, num:] == 0).all() and (meta.slot_mapping[num:] == scratch * bs).all(), "a padding row's write"
        assert (g.kv_slots[num:] == scratch * bs).all() and not g.mask[num:, ..., 1:].any(), "a padding row's read"


@given(data=st.data())
def test_padded_decode_steps_equal_the_unpadded_ones_and_padding_touches_only_the_scratch_block(llama, data):
    model = llama.model
    engine, requests, order, steps, config = draw_run(data, model, tuning.ACCELERATOR)
    padded = _padded_steps(engine)
    rollouts = run_with_arrivals(engine, requests, order, steps)
    _assert_padding_only_touches_the_scratch_block(engine, padded)
    assert engine.stats["num_graph_replays"] == len(padded)
    assert_matches_reference(model, requests, rollouts, engine="cb_impl", repro=f"config={config} order={order}")
    assert_engine_idle_and_clean(engine)


def test_a_graph_is_recorded_once_a_bucket_and_replayed_at_every_decode_step(llama):
    """GRPO groups whose sequences stop at different lengths: buckets shrink and keys grow, several steps share a
    bucket (so a replay that kept the recording's inputs would repeat its tokens), and the rollouts are exact."""
    model, _ = llama
    requests = [replace(r, sampling=replace(r.sampling, max_new_tokens=3 + 3 * i))
                for i, r in enumerate(grpo_batch(num_prompts=3, group=5, max_new_tokens=1))]  # fmt: skip
    engine = LLMEngine(model, EngineConfig(block_size=4))
    engine.runner.set_tuning(tuning.ACCELERATOR)
    padded = _padded_steps(engine)
    rollouts = engine.generate(requests)
    buckets = {(ids.shape[1], meta.groups[0].kv_slots.shape[1]) for (ids, _, meta, _), _, _ in padded}
    stats = engine.stats
    assert stats["num_decode_graphs"] == len(buckets) and stats["num_graph_replays"] == len(padded), stats
    assert len(padded) >= 2 * len(buckets) and len({b for b, _ in buckets}) > 1, (len(padded), sorted(buckets))
    assert_matches_reference(model, requests, rollouts, engine="cb_impl", repro="GRPO groups, decode graphs")


def test_graphs_see_weights_updated_in_place_and_are_recorded_again_when_weights_or_the_cache_move():
    model = load("tiny-llama-arith")[0]
    requests = grpo_batch(num_prompts=2, group=3, max_new_tokens=16)
    engine = LLMEngine(model, EngineConfig(block_size=4))
    engine.runner.set_tuning(tuning.ACCELERATOR)
    first = engine.generate(requests)
    recorded = engine.stats["num_decode_graphs"]
    assert recorded > 0
    with torch.no_grad():  # an optimizer step: in place, so every graph stays and must read the new values
        for p in model.parameters():
            p.mul_(1.25)
    updated = engine.generate(requests)
    assert engine.stats["num_decode_graphs"] == recorded, "an in-place update dropped the graphs"
    assert updated != first
    assert_matches_reference(model, requests, updated, engine="cb_impl", repro="weights updated in place")
    for moved in ("weights", "cache"):
        if moved == "weights":
            weight = model.lm_head.weight
            weight.data = weight.data.clone()  # a new address, as a re-cast or a gathered shard
        else:
            engine.release_cache()
        before = engine.stats["num_decode_graphs"]
        assert engine.generate(requests) == updated, moved
        assert engine.stats["num_decode_graphs"] > before, f"graphs kept after the {moved} moved"


def test_a_forward_that_cannot_be_recorded_turns_the_graphs_off_with_a_warning_and_stays_exact(llama, monkeypatch):
    model, _ = llama

    class Refused:
        def __init__(self, forward, inputs, pool):
            raise RuntimeError("operation not permitted when stream is capturing")

    requests = grpo_batch(num_prompts=2, group=3, max_new_tokens=12)
    engine = LLMEngine(model, EngineConfig(block_size=4))
    engine.runner.set_tuning(tuning.ACCELERATOR)
    engine.runner.graphs.recorder = Refused
    with pytest.warns(RuntimeWarning, match="decode graphs turned off.*stream is capturing"):
        rollouts = engine.generate(requests)
    assert engine.stats["num_graph_replays"] == engine.stats["num_decode_graphs"] == 0, engine.stats
    assert_matches_reference(model, requests, rollouts, engine="cb_impl", repro="recording refused")


def test_cuda_graphs_follow_the_config_and_other_accelerators_get_none():
    assert tuning.tuning_for("cuda").graph_decodes and not tuning.tuning_for("cpu").graph_decodes
    assert tuning.tuning_for("mps") == replace(tuning.ACCELERATOR, graph_decodes=False)


@pytest.mark.slow
def test_padded_decode_steps_are_exact_on_every_zoo_model_cb_impl_supports(monkeypatch, tmp_path):
    """The accelerator tuning (padded decodes from the graph stand-in) on every zoo model: windows, soft-caps, sinks,
    MoE, tied embeddings, their combinations. cb_impl passes with identical tokens, its decode steps replayed, or is
    refused up front, as under the CPU's tuning."""
    from cbverify import zoo
    from cbverify.zoo import combinations as combos
    from cbverify.zoo.matrix import run_architecture

    monkeypatch.setattr(model_runner, "tuning_for", lambda device: tuning.ACCELERATOR)
    replays = []
    record = graphs.Graphs.run
    monkeypatch.setattr(graphs.Graphs, "run", lambda self, *step: replays.append(1) or record(self, *step))
    passed = 0
    for arch in [*zoo.ARCHS, *combos.combinations(combos.FAMILIES)[0]]:
        before = len(replays)
        cell = {c.engine: c for c in run_architecture(arch, str(tmp_path), ("reference", "cb_impl"))}["cb_impl"]
        assert cell.status == "N/A" or (cell.status == "PASS" and cell.identical), (arch.name, cell)
        assert (cell.status == "PASS") == (len(replays) > before), (arch.name, "decode steps not replayed")
        passed += cell.status == "PASS"
    assert passed > 100, passed


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", ["tiny-llama-arith", "tiny-qwen3-chat"])
def test_cuda_graph_decodes_give_the_eager_engines_and_the_oracles_rollouts(name):
    model = load(name, device="cuda")[0]
    requests = grpo_batch(num_prompts=3, group=5, max_new_tokens=24)
    eager = LLMEngine(model, EngineConfig(block_size=4, cuda_graphs=False))
    graphed = LLMEngine(model, EngineConfig(block_size=4))
    assert eager.runner.graphs is None and graphed.runner.graphs.recorder is graphs.CudaGraph
    seconds, results = {}, {}
    for engine in (eager, graphed, eager, graphed):  # the second run of each is warm: its graphs recorded
        torch.cuda.synchronize()
        start = time.perf_counter()
        results[engine is graphed] = engine.generate(requests)
        torch.cuda.synchronize()
        seconds[engine is graphed] = time.perf_counter() - start
    want, got = results[False], results[True]
    SUMMARY.append(f"cb_impl on CUDA, {name}, {len(requests)} requests (warm): eager {seconds[False]:.3f} s, decode "
                   f"graphs {seconds[True]:.3f} s ({seconds[False] / seconds[True]:.2f}x)")  # fmt: skip
    assert graphed.stats["num_graph_replays"] > 0 and eager.stats["num_graph_replays"] == 0, graphed.stats
    assert_matches_reference(model, requests, got, expected=want, engine="cb_impl", repro=f"{name}: graphs vs eager")
    assert_matches_reference(model, requests, got, engine="cb_impl", repro=f"{name} on CUDA, graphs")
