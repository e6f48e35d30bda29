"""Nothing empty reaches cb_impl's model or sampler on any bundled checkpoint (``cb_impl.model_runner``'s invariant).

For any batch, arrival plan, block size, per-step token budget (chunked prefill), seat count and memory budget
(preemption), every forward the engine runs has at least one token and asks logits for at least one row, and the
sampler is called exactly for the steps that sample, with one row per sampling sequence. Some models forgive an
empty tensor and others do not (a reshape of zero elements, a kernel over nothing on a GPU), so the invariant is
checked where the engine makes the call, not by whether the model happened to survive it. The direct check that
guards the forward (``check_batch``) is held to refusing each kind of empty step.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cb_impl.engine
from cb_impl.attention import build_group, slot_grid
from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from cb_impl.model_runner import StepMetadata, check_batch
from cb_impl.scheduler import ScheduledBatch
from cb_impl.sequence import Sequence
from property_tests.strategies import cb_arrival_plans, rollout_requests
from property_tests.test_cb_exactness import run_with_arrivals
from reference.models import BUNDLED, load


@pytest.fixture(scope="module", params=BUNDLED)
def model(request) -> torch.nn.Module:
    return load(request.param)[0]


def _examples() -> int:
    """A third of the profile's examples for each of the three checkpoints (the same budget as one model)."""
    return max(5, settings().max_examples // len(BUNDLED))


@settings(max_examples=_examples())
@given(data=st.data())
def test_every_forward_has_tokens_and_rows_and_the_sampler_sees_exactly_the_sampling_steps(model, data):
    requests = data.draw(rollout_requests(max_requests=2, max_prompt_len=24, max_new_tokens=(1, 6),
                                          group_size=(1, 3)), label="requests")  # fmt: skip
    config, order, steps = data.draw(cb_arrival_plans(requests=requests), label="plan")
    engine = LLMEngine(model, EngineConfig(**config))
    forwards, sampled_rows, expected_rows = [], [], []

    def on_forward(_module, _args, kwargs):
        forwards.append((kwargs["input_ids"].shape[1], kwargs["logits_to_keep"].numel()))

    real_run, real_sample = engine.runner.run, cb_impl.engine.sample

    def run(batch):
        expected_rows.append(len(batch.samples))
        return real_run(batch)

    def sample(logits, *args, **kwargs):
        sampled_rows.append(logits.shape[0])
        return real_sample(logits, *args, **kwargs)

    hook = model.register_forward_pre_hook(on_forward, with_kwargs=True)
    try:
        with mock.patch.object(engine.runner, "run", run), mock.patch.object(cb_impl.engine, "sample", sample):
            run_with_arrivals(engine, requests, order, steps)
    finally:
        hook.remove()
    repro = f"config={config} order={order} steps={steps}"
    assert forwards and all(tokens >= 1 and rows >= 1 for tokens, rows in forwards), (forwards, repro)
    assert sampled_rows == [r for r in expected_rows if r], (sampled_rows, expected_rows, repro)


def _sequence(num_tokens: int, block_table: list[int]) -> Sequence:
    seq = Sequence(0, list(range(1, num_tokens + 1)), max_new_tokens=1, eos_token_ids=())
    seq.block_table = block_table
    return seq


def _group(num_seqs: int, q_len: int) -> StepMetadata:
    starts, lengths = torch.zeros(num_seqs, dtype=torch.int64), torch.full((num_seqs,), q_len, dtype=torch.int64)
    grid = slot_grid(torch.zeros(num_seqs, 1, dtype=torch.int64), 4)
    group = build_group(
        starts, lengths, torch.arange(num_seqs) * q_len, grid, q_len, max(q_len, 1), True, num_seqs * q_len
    )
    return StepMetadata(torch.zeros(num_seqs * q_len, dtype=torch.int64), (group,), torch.tensor(0), 0)


def test_the_forward_guard_refuses_an_empty_step_an_empty_chunk_and_an_empty_group_and_accepts_a_real_one():
    seq = _sequence(3, [0])
    check_batch(ScheduledBatch(chunks=[(seq, 3)]), _group(1, 3))
    with pytest.raises(RuntimeError, match="scheduled no token"):
        check_batch(ScheduledBatch(), _group(1, 1))
    with pytest.raises(RuntimeError, match="scheduled no token"):
        check_batch(ScheduledBatch(chunks=[(seq, 0)]), _group(1, 1))
    with pytest.raises(RuntimeError, match="empty attention group"):
        check_batch(ScheduledBatch(chunks=[(seq, 3)]), _group(0, 3))


def test_the_sampler_refuses_zero_rows():
    from cb_impl.sampler import build_sampling_batch, sample

    with pytest.raises(ValueError, match="no rows"):
        sample(torch.zeros(0, 300), build_sampling_batch([], torch.device("cpu")), torch.zeros(0, dtype=torch.int64))
