"""The oracle's repetition penalty and min-new-tokens against transformers' own LogitsProcessors, on drawn scores."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from cbverify.tolerances import SAME_LOGITS_ATOL
from property_tests.strategies import logits_batches, seeds
from reference import processors_extra as px
from reference.generate import generate_one as plain_generate_one
from reference.generate import process_logits
from reference.spec import RolloutRequest, SamplingParams


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


def test_min_new_tokens_keeps_greedy_off_eos_and_its_log_probs_are_teacher_forced(llama):
    plain = plain_generate_one
    request = RolloutRequest("r", (1, 6, 5, 16, 7, 5, 3), SamplingParams(temperature=0.0, max_new_tokens=8), 0, (2,))
    base = plain(llama.model, request)
    assert base.finish_reason == "stop"  # the trained model answers and stops
    held = px.generate_one(llama.model, request, min_new_tokens=len(base.completion_ids) + 1)
    assert 2 not in held.completion_ids[: len(base.completion_ids)]
    assert px.generate_one(llama.model, request, repetition_penalty=1.0) == base
    tf = px.teacher_forced(llama.model, request, held.completion_ids, min_new_tokens=len(base.completion_ids) + 1)
    torch.testing.assert_close(tf, torch.tensor(held.logprobs), atol=SAME_LOGITS_ATOL, rtol=0)


@given(logits=logits_batches(max_rows=1, max_vocab=12), penalty=st.sampled_from([0.7, 1.3]))
def test_the_extra_processors_default_to_nothing_and_process_low_precision_logits_in_float32(logits, penalty):
    vocab = logits.shape[-1]
    request = RolloutRequest("r", (0, vocab - 1), SamplingParams(temperature=0.7, max_new_tokens=4), 0, (1 % vocab,))
    # the defaults (no penalty, no minimum length) are process_logits itself, an EOS id allowed from the first token
    assert torch.equal(px.process_logits_extra(logits[0], request, []), process_logits(logits[0], request.sampling))
    low = (logits[0] * 3.1).to(torch.bfloat16)  # scores whose penalised values bfloat16 cannot hold
    ours = px.process_logits_extra(low, request, [0], repetition_penalty=penalty)
    assert torch.equal(ours, px.process_logits_extra(low.float(), request, [0], repetition_penalty=penalty))


PROMPT = (1, 6, 5, 16, 7, 5, 3)


@pytest.mark.parametrize("penalty", [0.3, 1.5, 3.0])
def test_greedy_generation_with_a_repetition_penalty_is_transformers_generate_and_its_log_probs_are_teacher_forced(
    qwen2, penalty
):
    """On the random-weight model (flat enough that every penalty here changes the greedy completion)."""
    request = RolloutRequest("r", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=10), 0, (2,))
    ours = px.generate_one(qwen2.model, request, repetition_penalty=penalty)
    assert ours.completion_ids != plain_generate_one(qwen2.model, request).completion_ids  # the test can tell
    ids = torch.tensor([PROMPT])
    theirs = qwen2.model.generate(
        ids, do_sample=False, repetition_penalty=penalty, max_new_tokens=10, eos_token_id=2, pad_token_id=0
    )[0, len(PROMPT) :].tolist()
    assert list(ours.completion_ids) == theirs
    forced = px.teacher_forced(qwen2.model, request, ours.completion_ids, repetition_penalty=penalty)
    torch.testing.assert_close(forced, torch.tensor(ours.logprobs), atol=SAME_LOGITS_ATOL, rtol=0)


@settings(max_examples=10, deadline=None)
@given(seed=seeds(), penalty=st.sampled_from([1.0, 1.5]))
def test_sampled_generation_is_the_oracles_without_options_and_teacher_forced_with_them(qwen2, seed, penalty):
    request = RolloutRequest("r", PROMPT, SamplingParams(temperature=0.9, top_k=20, max_new_tokens=6), seed, (2,))
    ours = px.generate_one(qwen2.model, request, repetition_penalty=penalty)
    if penalty == 1.0:
        assert ours == plain_generate_one(qwen2.model, request)  # the spec's noise at the spec's positions
    forced = px.teacher_forced(qwen2.model, request, ours.completion_ids, repetition_penalty=penalty)
    torch.testing.assert_close(forced, torch.tensor(ours.logprobs), atol=SAME_LOGITS_ATOL, rtol=0)
