"""cb_impl's attention kernels against plain loops over the definitions, on drawn shapes and features.

The exactness properties (``test_cb_exactness.py``, ``test_zoo.py``) hold the engine end to end against the
reference; these pin the two pieces that only some architectures reach (soft-capped scores, attention sinks,
sliding windows), so that a fault in them fails in a second on any machine, not only on a zoo checkpoint.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from cb_impl.attention import GATHER_BUDGET, build_group, explicit_attention, slot_grid
from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from cbverify.zoo import architectures as zoo
from property_tests.helpers import assert_matches_reference
from reference import tasks
from reference.spec import RolloutRequest, SamplingParams


def _attention_by_definition(q, k, v, mask, scale, softcap, sinks):
    """One query row at a time in float64: scores = scale * q.k, soft-capped, masked, a sink logit in the softmax."""
    s_, hq, qn, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(s_, hq, qn, d, dtype=torch.float64)
    for s in range(s_):
        for h in range(hq):
            for i in range(qn):
                scores = []
                for j in range(k.shape[2]):
                    x = scale * sum(float(q[s, h, i, t]) * float(k[s, h // group, j, t]) for t in range(d))
                    x = softcap * math.tanh(x / softcap) if softcap is not None else x
                    scores.append(x if mask is None or bool(mask[s, 0, i, j]) else -math.inf)
                extra = [float(sinks[h])] if sinks is not None else []
                top = max(scores + extra)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights) + sum(math.exp(x - top) for x in extra)
                for j, w in enumerate(weights):
                    out[s, h, i] += w / total * v[s, h // group, j].double()
    return out


@given(
    s=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    q_len=st.integers(1, 3),
    extra_keys=st.integers(0, 3),
    softcap=st.sampled_from([None, 0.5, 3.0]),
    with_sinks=st.booleans(),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_explicit_attention_equals_the_definition(s, kv_heads, group, q_len, extra_keys, softcap, with_sinks, masked,
                                                  seed):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    hq, keys, d = kv_heads * group, q_len + extra_keys, 3
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2
               for shape in ((s, hq, q_len, d), (s, kv_heads, keys, d), (s, kv_heads, keys, d)))  # fmt: skip
    mask = None
    if masked:  # causal over the last q_len keys, and some early keys dropped at random (never a whole row)
        own = torch.arange(extra_keys, keys)[:, None]  # (Q, 1): each query's own key position
        causal = torch.arange(keys)[None, :] <= own  # (Q, L)
        mask = causal & (torch.rand(s, 1, q_len, keys, generator=gen) > 0.3)  # (s, 1, Q, L)
        mask |= torch.arange(keys)[None, :] == own  # its own key always
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64) if with_sinks else None
    scale = 1 / math.sqrt(d) * 1.7
    got = explicit_attention(q, k, v, mask, scale, softcap, sinks)
    want = _attention_by_definition(q, k, v, mask, scale, softcap, sinks)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@given(
    chunks=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4)), min_size=1, max_size=3),
    window=st.integers(1, 6),
)
@example(chunks=[(0, 2), (0, 1)], window=1)  # a padding row under the narrowest window still sees key 0
def test_a_group_masks_exactly_the_causal_window_of_each_query(chunks, window):
    """Query q of a chunk starting at ``start`` sits at position start + q and sees key positions p with
    p <= start + q (causal) and, under a window w, p > start + q - w; a padding row sees key 0 only."""
    starts, lengths = [c[0] for c in chunks], [c[1] for c in chunks]
    offsets = [sum(lengths[:i]) for i in range(len(chunks))]
    q_max, l_max = max(lengths), max(a + n for a, n in zip(starts, lengths, strict=True))
    all_full = all(a + n == l_max for a, n in zip(starts, lengths, strict=True))
    bs, width = 3, -(-l_max // 3)
    tables = [[(5 * s + 2 * j + 1) % 97 for j in range(width)] for s in range(len(chunks))]  # distinct, unordered
    grid = slot_grid(torch.tensor(tables), bs)
    group = build_group(torch.tensor(starts), torch.tensor(lengths), torch.tensor(offsets), grid, q_max, l_max,
                        all_full, sum(lengths))  # fmt: skip
    for s, (start, n) in enumerate(chunks):  # a key column's slot; padding columns read the sequence's position 0
        want = [tables[s][p // bs] * bs + p % bs if p < start + n else tables[s][0] * bs for p in range(l_max)]
        assert group.kv_slots[s].tolist() == want, (s, group.kv_slots[s])
    want_rows = [offsets[s] + q for s, (_, n) in enumerate(chunks) for q in range(n)]
    assert group.dst_rows.tolist() == want_rows and group.q_index.flatten()[group.valid_flat].tolist() == want_rows
    full = torch.ones(len(chunks), 1, q_max, l_max, dtype=torch.bool) if group.mask is None else group.mask
    for w, mask in ((None, full), (window, group.window_mask(window))):
        for s, (start, n) in enumerate(chunks):
            for q in range(q_max):
                for p in range(l_max):
                    pos = start + q
                    want = (p <= pos and (w is None or p > pos - w)) if q < n else p == 0
                    assert bool(mask[s, 0, q, p]) == want, (s, q, p, w)
            assert group.q_pos[s, :n].tolist() == [start + q for q in range(n)]


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "mistral", "gpt2"])
@pytest.mark.parametrize("gather_budget", [GATHER_BUDGET, 1], ids=["one-slice", "a-sequence-per-slice"])
def test_paged_attention_in_the_engine_is_exact_on_soft_capped_sink_and_windowed_models(arch, gather_budget, tmp_path):
    """cb_impl against the oracle through the whole engine on the zoo's soft-capped + windowed (gemma2), sink
    (gpt_oss) and windowed (mistral) checkpoints, and gpt2 (its config has no ``num_key_value_heads``): GRPO groups
    with prompts longer than the window, chunked prefill, and the gathered K/V sliced one sequence at a time or not at
    all (the attention unit tests above call the math directly; here the engine's paged path must route soft-cap,
    sinks and windows to it)."""
    model, _ = zoo.load(arch, tmp_path)
    problems = tasks.make_problems(3, seed=5, max_terms=4)
    sampling = SamplingParams(temperature=1.0, top_k=5, max_new_tokens=6)
    requests = [
        RolloutRequest(
            f"p{p}-g{g}", tuple(tasks.prompt_ids(prob)), sampling, seed=100 * p + g, eos_token_ids=(tasks.EOS_ID,)
        )
        for p, prob in enumerate(problems)
        for g in range(2)
    ]
    assert min(len(r.prompt_ids) for r in requests) > zoo.WINDOW
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=7))
    engine.runner.attention.gather_budget = gather_budget
    assert_matches_reference(model, requests, engine.generate(requests), engine="cb_impl", repro=f"{arch}")
