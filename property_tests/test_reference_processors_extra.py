"""The oracle's repetition penalty and min-new-tokens against transformers' own LogitsProcessors, on drawn scores."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from cbverify.tolerances import SAME_LOGITS_ATOL
from property_tests.strategies import logits_batches
from reference import processors_extra as px


@given(logits=logits_batches(max_rows=1), data=st.data(), penalty=st.sampled_from([1.0, 0.7, 1.3, 2.0]))
def test_repetition_penalty_matches_transformers(logits, data, penalty):
    vocab = logits.shape[-1]
    context = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12))
    ours = px.apply_repetition_penalty(logits[0], context, penalty)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([context]), logits.clone())[0]
    torch.testing.assert_close(ours, theirs, atol=SAME_LOGITS_ATOL, rtol=0)


@given(logits=logits_batches(max_rows=1), data=st.data())
def test_min_new_tokens_matches_transformers(logits, data):
    vocab = logits.shape[-1]
    eos = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3, unique=True))
    prompt_len, generated = data.draw(st.integers(1, 6)), data.draw(st.integers(0, 6))
    min_new = data.draw(st.integers(0, 6))
    ids = torch.zeros((1, prompt_len + generated), dtype=torch.long)
    theirs = MinNewTokensLengthLogitsProcessor(prompt_len, min_new, eos)(ids, logits.clone())[0]
    ours = px.apply_min_new_tokens(logits[0], eos, generated, min_new)
    assert torch.equal(torch.isneginf(ours), torch.isneginf(theirs))
    finite = torch.isfinite(theirs)
    torch.testing.assert_close(ours[finite], theirs[finite], atol=0, rtol=0)


def test_min_new_tokens_keeps_greedy_off_eos_and_the_penalty_changes_greedy_tokens(llama):
    from reference.generate import generate_one as plain
    from reference.spec import RolloutRequest, SamplingParams

    request = RolloutRequest("r", (1, 6, 5, 16, 7, 5, 3), SamplingParams(temperature=0.0, max_new_tokens=8), 0, (2,))
    base = plain(llama.model, request)
    assert base.finish_reason == "stop"  # the trained model answers and stops
    held = px.generate_one(llama.model, request, min_new_tokens=len(base.completion_ids) + 1)
    assert 2 not in held.completion_ids[: len(base.completion_ids)]
    assert px.generate_one(llama.model, request, repetition_penalty=1.0) == base
    tf = px.teacher_forced(llama.model, request, held.completion_ids, min_new_tokens=len(base.completion_ids) + 1)
    torch.testing.assert_close(tf, torch.tensor(held.logprobs), atol=SAME_LOGITS_ATOL, rtol=0)
