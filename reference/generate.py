"""The reference generator: one request at a time, the whole prefix recomputed at every step.

Contract (``reference.spec``): for each :class:`~reference.spec.RolloutRequest`, tokens are produced one by one from
``model(input_ids=prefix).logits[0, -1]`` cast to float32:

- greedy (``temperature == 0``): ``token = argmax(logits)``, log-prob ``log_softmax(logits)[token]``;
- sampled: ``processed = process_logits(logits, sampling)`` and
  ``token = argmax(processed.double() + spec.gumbel_noise(seed, position, V))``, log-prob ``processed[token]``.

Generation stops after the first token in ``eos_token_ids`` (kept in the completion, ``finish_reason="stop"``) or
after ``max_new_tokens`` tokens (``finish_reason="length"``).

Simplifications versus TRL / transformers ``generate()`` (on purpose, so the code can be checked by reading):

- no KV cache, no padding, no batching: a single (1, T) forward per generated token, quadratic cost;
- only temperature, top-k, top-p and min-p; no repetition penalty, no min-new-tokens, no stop strings;
- ``min_tokens_to_keep`` is fixed at 1 (transformers' default outside beam search);
- randomness is the counter-based Gumbel noise of ``reference.spec``, not ``torch.multinomial`` on a global RNG, so
  the same request gives the same tokens whatever else is running;
- top-p sorts with a *stable* sort, so among tied scores the lowest token id is dropped first; transformers'
  ``torch.sort`` is not guaranteed stable, so exact ties at the top-p boundary may be resolved differently there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reference.spec import Rollout, RolloutRequest, SamplingParams, gumbel_noise


def apply_temperature(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """(V,) -> (V,): ``scores / temperature`` (transformers' ``TemperatureLogitsWarper``)."""
    return scores / temperature


def apply_top_k(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """(V,) -> (V,): ``-inf`` for every score strictly below the k-th largest one (ties at the boundary stay).

    transformers' ``TopKLogitsWarper``; ``top_k == 0`` (or ``top_k >= V``) keeps everything.
    """
    if top_k == 0 or top_k >= scores.numel():
        return scores
    kth_largest = torch.sort(scores, descending=True).values[top_k - 1]
    return scores.masked_fill(scores < kth_largest, float("-inf"))


def apply_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """(V,) -> (V,): nucleus filtering with transformers' ``TopPLogitsWarper`` semantics.

    Sort ascending, accumulate the softmax probabilities, drop every token whose cumulative probability is
    ``<= 1 - top_p``; the most probable token is always kept. ``top_p == 1.0`` keeps everything.
    """
    if top_p >= 1.0:
        return scores
    ascending_scores, order = torch.sort(scores, descending=False, stable=True)  # (V,), (V,)
    cumulative = torch.softmax(ascending_scores, dim=-1).cumsum(dim=-1)  # (V,)
    remove_sorted = cumulative <= (1 - top_p)  # (V,)
    remove_sorted[-1] = False  # min_tokens_to_keep = 1: the top token survives
    remove = torch.zeros_like(remove_sorted)
    remove[order] = remove_sorted  # undo the sort: token order[rank] takes the flag of its rank
    return scores.masked_fill(remove, float("-inf"))


def apply_min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """(V,) -> (V,): ``-inf`` for tokens whose probability is below ``min_p * max probability``.

    transformers' ``MinPLogitsWarper``; the most probable token is always kept. ``min_p == 0`` keeps everything.
    """
    if min_p == 0.0:
        return scores
    probs = torch.softmax(scores, dim=-1)  # (V,)
    remove = probs < min_p * probs.max()
    remove[torch.argmax(probs)] = False
    return scores.masked_fill(remove, float("-inf"))


def process_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """(V,) raw logits -> (V,) processed log-probs, float32.

    Sampled: temperature -> top-k -> top-p -> min-p (transformers' order and semantics), then ``log_softmax`` over
    what is left, so kept tokens sum to probability 1 and removed tokens are ``-inf``.
    Greedy (``temperature == 0``): ``log_softmax(logits)`` with no processors.
    """
    if logits.dim() != 1:
        raise ValueError(f"process_logits expects a (V,) tensor, got shape {tuple(logits.shape)}")
    scores = logits.to(torch.float32)
    if sampling.greedy:
        return torch.log_softmax(scores, dim=-1)
    scores = apply_temperature(scores, sampling.temperature)
    scores = apply_top_k(scores, sampling.top_k)
    scores = apply_top_p(scores, sampling.top_p)
    scores = apply_min_p(scores, sampling.min_p)
    return torch.log_softmax(scores, dim=-1)


@torch.no_grad()
def next_token_logits(model, token_ids: Sequence[int]) -> torch.Tensor:
    """(V,) float32 logits for the token after ``token_ids``: one full forward, no cache, no padding."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)  # (1, T)
    return model(input_ids=input_ids).logits[0, -1].to(torch.float32)  # (V,)


def choose_token(logits: torch.Tensor, sampling: SamplingParams, seed: int, position: int) -> tuple[int, float]:
    """``(token, log-prob)`` for one step: greedy argmax, or Gumbel-max over the processed log-probs."""
    logprobs = process_logits(logits, sampling)  # (V,)
    if sampling.greedy:
        token = int(torch.argmax(logits))
    else:
        seeds = torch.tensor([seed], dtype=torch.int64, device=logits.device)  # (1,)
        positions = torch.tensor([position], dtype=torch.int64, device=logits.device)  # (1,)
        noise = gumbel_noise(seeds, positions, logits.numel())[0]  # (V,) float64
        token = int(torch.argmax(logprobs.double() + noise))
    return token, float(logprobs[token])


def generate_one(model, request: RolloutRequest) -> Rollout:
    """Complete one request (see the module docstring for the contract)."""
    prefix = list(request.prompt_ids)
    completion: list[int] = []
    logprobs: list[float] = []
    finish_reason = "length"
    for position in range(request.sampling.max_new_tokens):
        logits = next_token_logits(model, prefix)  # (V,)
        token, logprob = choose_token(logits, request.sampling, request.seed, position)
        prefix.append(token)
        completion.append(token)
        logprobs.append(logprob)
        if token in request.eos_token_ids:
            finish_reason = "stop"
            break
    return Rollout(request.request_id, request.prompt_ids, tuple(completion), tuple(logprobs), finish_reason)


def generate(model, requests: Sequence[RolloutRequest]) -> list[Rollout]:
    """One :class:`Rollout` per request, in request order; requests are completed one after another."""
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request_ids must be unique within one generate() call")
    return [generate_one(model, request) for request in requests]
