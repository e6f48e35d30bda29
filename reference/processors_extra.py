"""Two more generation options, written to be checked by reading: repetition penalty and ``min_new_tokens``.

Semantics are transformers' (``RepetitionPenaltyLogitsProcessor``, ``MinNewTokensLengthLogitsProcessor``) and so is
their place in the chain: both act on the raw logits *before* temperature / top-k / top-p / min-p, repetition
penalty first. For a decoder-only model the penalised ids are the whole context (prompt and completion so far).

- repetition penalty ``p``: every token id present in the context has its score ``s`` replaced by ``s * p`` when
  ``s < 0`` and ``s / p`` otherwise (each id once, however often it occurs); ``p == 1`` changes nothing;
- ``min_new_tokens`` ``m``: while fewer than ``m`` completion tokens exist, every EOS id scores ``-inf``.

:func:`generate_one` is ``reference.generate.generate_one`` with these two applied (greedy: argmax of the processed
scores; sampled: the spec's Gumbel-max); :func:`teacher_forced` gives the processed log-probs of given tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reference.generate import next_token_logits, process_logits
from reference.spec import Rollout, RolloutRequest, gumbel_noise


def apply_repetition_penalty(scores: torch.Tensor, context_ids: Sequence[int], penalty: float) -> torch.Tensor:
    """(V,) -> (V,): each id in ``context_ids`` scored ``s * penalty`` if ``s < 0`` else ``s / penalty``."""
    if penalty == 1.0 or not context_ids:
        return scores
    out = scores.clone()
    for token in set(context_ids):
        s = scores[token]
        out[token] = s * penalty if s < 0 else s / penalty
    return out


def apply_min_new_tokens(
    scores: torch.Tensor, eos_token_ids: Sequence[int], num_generated: int, min_new_tokens: int
) -> torch.Tensor:
    """(V,) -> (V,): every EOS id at ``-inf`` while ``num_generated < min_new_tokens``."""
    if num_generated >= min_new_tokens or not eos_token_ids:
        return scores
    out = scores.clone()
    out[list(eos_token_ids)] = float("-inf")
    return out


def process_logits_extra(
    logits: torch.Tensor, request: RolloutRequest, completion: Sequence[int], *, repetition_penalty: float = 1.0,
    min_new_tokens: int = 0,
) -> torch.Tensor:  # fmt: skip
    """(V,) raw logits -> (V,) processed log-probs: penalty, min-new-tokens, then ``process_logits``."""
    scores = logits.to(torch.float32)
    scores = apply_repetition_penalty(scores, [*request.prompt_ids, *completion], repetition_penalty)
    scores = apply_min_new_tokens(scores, request.eos_token_ids, len(completion), min_new_tokens)
    return process_logits(scores, request.sampling)


def generate_one(model, request: RolloutRequest, *, repetition_penalty: float = 1.0, min_new_tokens: int = 0):
    """One request, the whole prefix recomputed per token, with the two options applied (see the module doc)."""
    completion: list[int] = []
    logprobs: list[float] = []
    reason = "length"
    for position in range(request.sampling.max_new_tokens):
        logits = next_token_logits(model, [*request.prompt_ids, *completion])  # (V,)
        processed = process_logits_extra(
            logits, request, completion, repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens
        )  # (V,)
        if request.sampling.greedy:
            token = int(torch.argmax(processed))
        else:
            noise = gumbel_noise(torch.tensor([request.seed]), torch.tensor([position]), logits.numel())[0]
            token = int(torch.argmax(processed.double() + noise))
        completion.append(token)
        logprobs.append(float(processed[token]))
        if token in request.eos_token_ids:
            reason = "stop"
            break
    return Rollout(request.request_id, request.prompt_ids, tuple(completion), tuple(logprobs), reason)


def teacher_forced(
    model, request: RolloutRequest, completion: Sequence[int], *, repetition_penalty: float = 1.0,
    min_new_tokens: int = 0,
) -> torch.Tensor:  # fmt: skip
    """(L,) float32: the processed log-prob of each token of ``completion`` given everything before it."""
    out = []
    for i, token in enumerate(completion):
        logits = next_token_logits(model, [*request.prompt_ids, *completion[:i]])  # (V,)
        processed = process_logits_extra(
            logits, request, completion[:i], repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens
        )  # (V,)
        out.append(float(processed[token]))
    return torch.tensor(out, dtype=torch.float32)
