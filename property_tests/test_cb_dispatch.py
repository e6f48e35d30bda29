"""On an accelerator's settings, the kernels a cb_impl step launches do not grow with the sequences in it.

Each aten op a step dispatches is a kernel launch on a GPU, and each op that reads a device value back (``.item()``,
``nonzero``, ``unique``, a device-to-host copy) stalls the host until the GPU catches up. So, counted with a
``TorchDispatchMode`` on the CPU under ``cb_impl.tuning.ACCELERATOR`` (the settings a CUDA model gets):

- a prefill step, a decode step that rebuilds its metadata and a decode step that advances the last one dispatch the
  same ops, op for op, for 8 and for 256 sequences (so the same number per layer);
- every step makes exactly one device-to-host copy (its tokens and log-probs) and no other op that reads back;
- the decode steps replay a recorded forward (``cb_impl.graphs``): on CUDA its ops are one graph launch.

Under the CPU's settings the attention is cut into cache-sized slices, so there the count grows with the batch (shown
by the same counter, which keeps the property able to fail). Requests are mixed greedy and sampled, with top-k, top-p
and min-p, a vocabulary big enough for the CPU's Gumbel race, so every branch of the sampler is on the path.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from cb_impl import tuning
from cb_impl.attention import folded_gqa_attention
from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from reference.models import load
from reference.spec import RolloutRequest, SamplingParams

aten = torch.ops.aten
READ_BACK = {aten._local_scalar_dense.default, aten.nonzero.default, aten.unique_consecutive.default,
             aten._unique2.default, aten.unique_dim.default, aten.masked_select.default}  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts every dispatched op, and apart: those inside the model's forward (``in_model``, set by the caller),
    ops that read a device value back and device-to-host copies."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.read_back: Counter = Counter()
        self.to_host = self.model_ops = 0
        self.in_model = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[str(func)] += 1
        self.model_ops += self.in_model
        if func in READ_BACK or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            self.read_back[str(func)] += 1
        if func is aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            self.to_host += 1
        return func(*args, **kwargs)


def _requests(n: int) -> list[RolloutRequest]:
    kinds = [SamplingParams(max_new_tokens=4, temperature=0.0), SamplingParams(max_new_tokens=4, temperature=0.9),
             SamplingParams(max_new_tokens=4, temperature=1.1, top_k=7, top_p=0.9, min_p=0.05)]  # fmt: skip
    return [RolloutRequest(f"r{i}", (1, 5 + i % 7, 9, 3 + i % 5), kinds[i % 3], seed=i) for i in range(n)]


def count_steps(model: torch.nn.Module, n: int, settings: tuning.DeviceTuning) -> list[OpCounter]:
    """Counters of an engine's first three steps on ``n`` requests of 4-token prompts: the prefill (no sharing, so
    one chunk each), a decode that builds its metadata, a decode that advances it."""
    engine = LLMEngine(model, EngineConfig(num_blocks=n, block_size=16, max_batch_tokens=4 * n, max_num_seqs=n,
                                           enable_prefix_sharing=False))  # fmt: skip
    engine.runner.set_tuning(settings)
    for r in _requests(n):
        engine.add_request(r)
    counters = []
    model = engine.runner.model
    with engine.runner.attached():
        for _ in range(3):
            with OpCounter() as counter:
                hooks = (model.register_forward_pre_hook(lambda *_: setattr(counter, "in_model", True)),
                         model.register_forward_hook(lambda *_: setattr(counter, "in_model", False)))  # fmt: skip
                try:
                    engine.step()
                finally:
                    for hook in hooks:
                        hook.remove()
            counters.append(counter)
    counters[0].graph_replays = engine.stats["num_graph_replays"]
    return counters


@pytest.fixture(scope="module")
def chat_model() -> torch.nn.Module:
    return load("tiny-qwen3-chat")[0]  # 2,048 tokens: the CPU race is on (>= RACE_MIN_VOCAB)


def test_on_accelerator_settings_a_step_dispatches_the_same_ops_for_8_and_256_sequences_and_reads_back_once(
    chat_model,
):
    small, large = (count_steps(chat_model, n, tuning.ACCELERATOR) for n in (8, 256))
    layers = chat_model.config.num_hidden_layers
    for step, (a, b) in enumerate(zip(small, large, strict=True)):
        diff = {op: (a.ops[op], b.ops[op]) for op in a.ops | b.ops if a.ops[op] != b.ops[op]}
        assert not diff, f"step {step}: ops whose count grows with the batch (8 vs 256 sequences): {diff}"
        for c in (a, b):
            assert c.to_host == 1, f"step {step}: {c.to_host} device-to-host copies, want one"
            assert not c.read_back, f"step {step}: ops reading a device value back: {dict(c.read_back)}"
        total = sum(a.ops.values())
        on_cuda = {0: f"{total} launches", 1: "the bucket's graph recorded", 2: f"{total - a.model_ops + 1} launches"}
        print(f"step {step}: {total} ops ({total / layers:.1f} per layer) for 8 and 256, {a.model_ops} in the model's "
              f"forward; on CUDA: {on_cuda[step]}")  # fmt: skip
    assert small[0].graph_replays == large[0].graph_replays == 2, "the two decode steps replay a recorded forward"


def test_on_cpu_settings_the_attention_is_sliced_so_the_count_grows_with_the_batch(chat_model):
    small, large = (count_steps(chat_model, n, tuning.CPU) for n in (8, 256))
    grows = [sum(b.ops.values()) > sum(a.ops.values()) for a, b in zip(small, large, strict=True)]
    assert any(grows), "the CPU tuning no longer slices: the counter would not see a per-sequence launch"
    print("cpu settings, ops per step for 8 / 256 sequences:",
          [(sum(a.ops.values()), sum(b.ops.values())) for a, b in zip(small, large, strict=True)])  # fmt: skip


def test_each_device_gets_its_tuning():
    assert tuning.tuning_for("cpu") is tuning.CPU
    assert tuning.tuning_for("cuda") is tuning.ACCELERATOR and tuning.tuning_for("cuda:1") is tuning.ACCELERATOR
    assert tuning.ACCELERATOR.gather_budget is tuning.ACCELERATOR.sample_budget is None


@given(s=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.integers(1, 4), q_len=st.integers(1, 5),
       extra=st.integers(0, 6), seed=st.integers(0, 2**16), masked=st.booleans())  # fmt: skip
def test_grouped_queries_folded_into_the_query_length_equal_sdpa_with_enable_gqa(s, kv_heads, group, q_len, extra,
                                                                                  seed, masked):  # fmt: skip
    """The accelerator's attention (``folded_gqa_attention``: a group's heads become query rows of its key head, so
    kernels without ``enable_gqa`` apply) equals SDPA's own grouped-query attention, in float64."""
    gen = torch.Generator().manual_seed(seed)
    keys = q_len + extra
    q = torch.randn(s, kv_heads * group, q_len, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(s, kv_heads, keys, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = (torch.rand(s, 1, q_len, keys, generator=gen) > 0.4) | (torch.arange(keys) == 0) if masked else None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(folded_gqa_attention(q, k, v, mask, None), want, rtol=0, atol=1e-12)
