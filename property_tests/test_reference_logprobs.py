"""The oracle's teacher-forced logits (``reference.logprobs.completion_logits``): their dtype whatever the model's, the
empty completion, and the refusals. The values themselves are checked against the model's own forward, row by row."""

from __future__ import annotations

import copy

import pytest
import torch

from reference import logprobs as ref_logprobs

PROMPT, COMPLETION = (1, 6, 5), (16, 7, 2)


@pytest.mark.parametrize(
    ("model_dtype", "logits_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float64, torch.float64)],
)
def test_completion_logits_are_the_model_s_rows_in_float32_or_float64_for_a_float64_model_even_when_empty(
    llama, model_dtype, logits_dtype
):
    """Row ``i`` is the model's logit row after the prompt and ``completion[:i]``, promoted to at least float32 (a
    bf16 model's logits are not judged in bf16); an empty completion is a (0, V) tensor of the same dtype."""
    model = copy.deepcopy(llama.model).to(model_dtype)
    vocab = model.config.vocab_size
    logits = ref_logprobs.completion_logits(model, PROMPT, COMPLETION)  # (L, V)
    assert logits.dtype == logits_dtype and logits.shape == (len(COMPLETION), vocab)
    ids = torch.tensor([PROMPT + COMPLETION])
    with torch.no_grad():
        own = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]  # (L, V) in the model's dtype
    torch.testing.assert_close(logits, own.to(logits_dtype), rtol=0, atol=0)
    empty = ref_logprobs.completion_logits(model, PROMPT, ())
    assert empty.shape == (0, vocab) and empty.dtype == logits_dtype


def test_completion_logits_refuse_an_empty_prompt_and_the_log_prob_functions_lists_of_unequal_lengths(llama):
    with pytest.raises(ValueError, match="prompt_ids is empty: there is no logit row"):
        ref_logprobs.completion_logits(llama.model, (), COMPLETION)
    with pytest.raises(ValueError, match=r"lists must have equal lengths, got \[1, 2\]"):
        ref_logprobs.per_token_logps(llama.model, [PROMPT, PROMPT], [COMPLETION])
