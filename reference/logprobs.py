"""Teacher-forced log-probabilities of given completions: what the trainer sees, and what the sampler used.

For a pair (prompt, completion) of lengths P and L, one forward over ``prompt + completion`` (shape (1, P + L)) gives
the logits that predicted completion token ``i`` at row ``P - 1 + i``. Logits are cast to float32 before anything else
(a float64 model keeps float64: the trainer-math checks recompute gradients in float64).

- :func:`per_token_logps` has TRL's trainer semantics (``GRPOTrainer._get_per_token_logps_and_entropies``):
  ``log_softmax(logits / T)`` over the full vocabulary, read at each completion token.
- :func:`processed_per_token_logps` applies ``reference.generate.process_logits`` (temperature -> top-k -> top-p ->
  min-p, renormalised): the log-prob of each token under the distribution a sampler drew it from. A token outside
  the kept set gets ``-inf``.
- :func:`per_token_entropies`: the entropy of the same full-support distribution at each completion position.

Each log-prob quantity is also a function of one pair's logits (:func:`logps_of`, :func:`processed_logps_of`,
:func:`top_logprobs_of`): a caller that needs several of them for the same pair runs its forward once.

Simplifications versus TRL: one unpadded forward per pair (TRL pads a batch and slices ``logits_to_keep``), no
``torch.compile``, no chunking of the vocabulary; TRL computes in the model's dtype, here the logits are always cast
to float32 (or wider) first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reference.generate import process_logits
from reference.spec import SamplingParams


def completion_logits(
    model, prompt_ids: Sequence[int], completion_ids: Sequence[int], *, grad: bool = False
) -> torch.Tensor:
    """(L, V) raw logits, float32 (float64 for a float64 model); row ``i`` predicts ``completion_ids[i]``.

    An empty completion gives a (0, V) tensor without running the model. ``grad=True`` keeps the autograd graph (the
    training loop differentiates through it); by default no graph is built.
    """
    prompt, completion = list(prompt_ids), list(completion_ids)
    if not prompt:
        raise ValueError("prompt_ids is empty: there is no logit row to predict the first completion token from")
    vocab_size = model.config.get_text_config().vocab_size
    device = next(model.parameters()).device
    if not completion:
        dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
        return torch.zeros((0, vocab_size), dtype=dtype, device=device)
    input_ids = torch.tensor([prompt + completion], dtype=torch.long, device=device)  # (1, P + L)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=input_ids).logits[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (P + L, V)
    first = len(prompt) - 1
    return logits[first : first + len(completion)]  # (L, V)


def _check_pairs(prompt_ids_list: Sequence, completion_ids_list: Sequence, *more: Sequence) -> None:
    lengths = {len(prompt_ids_list), len(completion_ids_list), *(len(m) for m in more)}
    if len(lengths) != 1:
        raise ValueError(f"prompt/completion/sampling lists must have equal lengths, got {sorted(lengths)}")


def per_token_logps(
    model,
    prompt_ids_list: Sequence[Sequence[int]],
    completion_ids_list: Sequence[Sequence[int]],
    temperature: float = 1.0,
    *,
    grad: bool = False,
) -> list[torch.Tensor]:
    """Trainer-side log-probs (TRL semantics): for each pair a float32 (L_i,) tensor of
    ``log_softmax(logits / temperature)[completion_ids[i]]`` over the full vocabulary.
    ``grad=True`` returns differentiable tensors (for the training loop)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for trainer log-probs (TRL divides by it), got {temperature}")
    _check_pairs(prompt_ids_list, completion_ids_list)
    return [
        logps_of(completion_logits(model, prompt, completion, grad=grad), completion, temperature)
        for prompt, completion in zip(prompt_ids_list, completion_ids_list, strict=True)
    ]


def logps_of(logits: torch.Tensor, completion_ids: Sequence[int], temperature: float = 1.0) -> torch.Tensor:
    """(L, V) teacher-forced logits (:func:`completion_logits`) -> (L,): ``log_softmax(logits / temperature)`` read at
    each completion token, what :func:`per_token_logps` returns for one pair (callers that need several quantities of
    the same rollout compute its logits once and read them all from it)."""
    logps = torch.log_softmax(logits / temperature, dim=-1)  # (L, V)
    targets = torch.tensor(list(completion_ids), dtype=torch.long, device=logits.device)  # (L,)
    return logps[torch.arange(len(targets), device=logits.device), targets]  # (L,)


def per_token_entropies(
    model,
    prompt_ids_list: Sequence[Sequence[int]],
    completion_ids_list: Sequence[Sequence[int]],
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """For each pair a float32 (L_i,) tensor: the entropy in nats, ``-sum_v p_v log p_v`` with
    ``p = softmax(logits / temperature)`` over the full vocabulary, of the distribution each completion token was
    predicted from (what TRL's trainer logs as ``entropy`` and ranks for its entropy mask)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (TRL divides by it), got {temperature}")
    _check_pairs(prompt_ids_list, completion_ids_list)
    out: list[torch.Tensor] = []
    for prompt, completion in zip(prompt_ids_list, completion_ids_list, strict=True):
        logps = torch.log_softmax(completion_logits(model, prompt, completion) / temperature, dim=-1)  # (L, V)
        out.append(-(logps.exp() * logps).sum(-1))  # (L,)
    return out


def processed_per_token_logps(
    model,
    prompt_ids_list: Sequence[Sequence[int]],
    completion_ids_list: Sequence[Sequence[int]],
    sampling_list: Sequence[SamplingParams],
) -> list[torch.Tensor]:
    """Sampler-side log-probs: for each pair a float32 (L_i,) tensor of ``process_logits(row, sampling)[token]``,
    position by position (the distribution the token was sampled from; greedy: plain ``log_softmax``)."""
    _check_pairs(prompt_ids_list, completion_ids_list, sampling_list)
    return [
        processed_logps_of(completion_logits(model, prompt, completion), completion, sampling)
        for prompt, completion, sampling in zip(prompt_ids_list, completion_ids_list, sampling_list, strict=True)
    ]


def processed_logps_of(logits: torch.Tensor, completion_ids: Sequence[int], sampling: SamplingParams) -> torch.Tensor:
    """(L, V) teacher-forced logits -> (L,): ``process_logits(row, sampling)[token]`` position by position, what
    :func:`processed_per_token_logps` returns for one pair."""
    values = [process_logits(logits[i], sampling)[token] for i, token in enumerate(completion_ids)]
    return torch.stack(values) if values else torch.zeros(0, dtype=torch.float32, device=logits.device)


def top_logprobs(
    model,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    k: int = 5,
    sampling: SamplingParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, token_ids)``, both (L, k): the k largest log-probs at each completion position, descending.

    With ``sampling`` they are processed log-probs (``process_logits``), otherwise raw ``log_softmax(logits)``.
    Removed tokens appear as ``-inf`` when fewer than k tokens were kept.
    """
    return top_logprobs_of(completion_logits(model, prompt_ids, completion_ids), k, sampling)


def top_logprobs_of(
    logits: torch.Tensor, k: int = 5, sampling: SamplingParams | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, V) teacher-forced logits -> :func:`top_logprobs`' ``(values, token_ids)``, both (L, k)."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k must be in [1, vocab size {logits.shape[-1]}], got {k}")
    rows = [process_logits(row, sampling) if sampling is not None else torch.log_softmax(row, -1) for row in logits]
    if not rows:
        empty = torch.zeros((0, k), device=logits.device)
        return empty.to(torch.float32), empty.to(torch.long)
    top = torch.topk(torch.stack(rows), k, dim=-1)  # (L, k), (L, k)
    return top.values, top.indices
