"""transformers ``model.generate()`` called as TRL's default GRPO path calls it (``GRPOTrainer`` without vLLM/CB).

How requests are batched: ``generate()`` takes one ``GenerationConfig`` per call, so requests are grouped by
``(temperature, top_k, top_p, min_p, eos_token_ids)`` (first-appearance order); each group is one left-padded batch
with ``max_new_tokens`` = the group's largest, and every row is then cut at its own ``max_new_tokens`` and first EOS
(:func:`cbverify.engines.finish_rollout`; generation is causal, so the cut rows are what a per-row limit gives).

Randomness: ``generate()`` samples with ``torch.multinomial`` on torch's global RNG. Per-request seeds cannot be
honoured; the adapter seeds torch once per ``generate`` call with its own ``seed`` option inside
``torch.random.fork_rng`` (the caller's RNG state is left untouched), so a call is reproducible.

Log-probs: ``output_scores=True`` gives the *processed* scores the token was drawn from (temperature, top-k, top-p,
min-p applied; none when greedy), so ``log_softmax(score)[token]`` has the spec's semantics. (``output_logits=True``
would give the raw logits instead.) With ``return_logprobs=False`` no scores are requested -- as TRL calls it; storing
a ``(B, V)`` tensor per step costs time -- the rollouts carry NaN log-probs and the instance's ``capabilities`` say
``logprob_semantics="none"``.

Cost (``last_run``, :class:`cbverify.engines.RunStats`): the window is the whole call; TTFT is the first call of a
pass-through logits processor (every row's first token is being sampled); KV is the returned cache's tensors.

Every generation option the spec does not know is set explicitly to its neutral value: ``GenerationConfig`` fills
unset fields from the checkpoint's ``generation_config.json`` and then from global defaults such as ``top_k=50``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from cbverify.engines import (
    Capabilities,
    EngineError,
    RunStats,
    WindowHook,
    check_unique_ids,
    clock,
    finish_rollout,
)
from reference.spec import Rollout, RolloutRequest, SamplingParams

# Processors outside the spec, pinned to their neutral values so a checkpoint's generation_config cannot enable them.
NEUTRAL_OPTIONS = dict(
    repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, min_length=0,
    num_beams=1, num_return_sequences=1, renormalize_logits=False,
)  # fmt: skip


def group_key(request: RolloutRequest) -> tuple:
    """Requests with equal keys share one ``generate()`` call."""
    s = request.sampling
    return (s.temperature, s.top_k, s.top_p, s.min_p, request.eos_token_ids)


def generation_config(
    sampling: SamplingParams, eos_token_ids: tuple[int, ...], max_new_tokens: int, pad: int, *, scores: bool = True
):
    """The explicit ``GenerationConfig`` for one group (see the module docstring); ``scores``: ``output_scores``."""
    sample = not sampling.greedy
    # Greedy: warpers are never built when do_sample=False, so they are left to transformers' (unused) defaults.
    warpers = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p)
    return GenerationConfig(
        do_sample=sample,
        **(warpers if sample else {}),
        max_new_tokens=max_new_tokens,
        eos_token_id=list(eos_token_ids),  # [] means "no EOS" (None would fall back to the checkpoint's EOS)
        pad_token_id=pad,
        output_scores=scores,
        return_dict_in_generate=True,  # also returns the cache (measured for last_run)
        disable_compile=True,  # as TRL does
        **NEUTRAL_OPTIONS,
    )


def cache_bytes(cache) -> int | None:
    """Bytes of a returned ``Cache``'s tensors on every layer (keys and values; a state-space or convolution layer's
    state under whatever names it keeps them); ``None`` when the cache's layout is unknown."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    return sum(
        t.nbytes for layer in layers for t in getattr(layer, "__dict__", {}).values() if isinstance(t, torch.Tensor)
    )


class FirstCall(LogitsProcessor):
    """Pass-through processor noting the clock at its first call: the first sampling step of the batch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            self.at = clock(self.device)
        return scores


class HFGenerateEngine:
    """transformers ``generate()``: own RNG (torch's), processed log-probs, padding-dependent numerics."""

    name = "hf-generate"
    capabilities = Capabilities(
        spec_sampling=False,
        per_request_max_new_tokens=True,  # by cutting rows of a group (see module docstring)
        per_request_sampling=True,  # by grouping
        per_request_eos=True,  # by grouping
        logprob_semantics="processed",
        claims_batch_invariance=False,  # left padding changes the matmul shapes, and the RNG stream is shared
        follows_weight_updates=True,  # it runs the caller's model object
    )

    def __init__(
        self,
        model,
        *,
        seed: int = 0,
        max_batch_size: int | None = None,
        return_logprobs: bool = True,
        window_hook: WindowHook | None = None,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        self.model = model
        self.seed = seed
        self.max_batch_size = max_batch_size
        self.return_logprobs = return_logprobs
        self.window_hook = window_hook or nullcontext
        if not return_logprobs:
            self.capabilities = dataclasses.replace(type(self).capabilities, logprob_semantics="none")
        cfg = model.config
        self.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.last_run: RunStats | None = None

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        check_unique_ids(self.name, requests)
        groups: dict[tuple, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(group_key(request), []).append(i)
        results: list[Rollout | None] = [None] * len(requests)
        device = next(self.model.parameters()).device
        fork_devices = [device] if device.type == "cuda" else []
        stats, first = RunStats(extra={"generated_width": 0}), FirstCall(device)
        with torch.random.fork_rng(devices=fork_devices), self.window_hook():
            torch.manual_seed(self.seed)
            start = clock(device)
            for indices in groups.values():
                step = self.max_batch_size or len(indices)
                for begin in range(0, len(indices), step):
                    chunk = indices[begin : begin + step]
                    batch = self._generate_batch([requests[i] for i in chunk], first, stats)
                    for i, rollout in zip(chunk, batch, strict=True):
                        results[i] = rollout
            stats.generate_s = clock(device) - start
        stats.ttft_s = None if first.at is None else first.at - start
        self.last_run = stats
        if any(r is None for r in results):
            raise EngineError(f"{self.name}: some requests produced no rollout")
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _generate_batch(self, batch: list[RolloutRequest], first: FirstCall, stats: RunStats) -> list[Rollout]:
        """One left-padded ``generate()`` call for requests sharing a group key; notes its cost in ``stats``."""
        device = next(self.model.parameters()).device
        width = max(len(r.prompt_ids) for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)  # (B, P)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, P)
        for row, request in enumerate(batch):
            input_ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            attention_mask[row, width - len(request.prompt_ids) :] = 1
        max_new = max(r.sampling.max_new_tokens for r in batch)
        config = generation_config(
            batch[0].sampling, batch[0].eos_token_ids, max_new, self.pad_token_id, scores=self.return_logprobs
        )
        out = self.model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config,
            logits_processor=LogitsProcessorList([first]),
        )  # fmt: skip
        new_tokens = out.sequences[:, width:].cpu()  # (B, N)
        if new_tokens.shape[1] == 0:
            raise EngineError(f"{self.name}: generate() returned no new tokens")
        kv = cache_bytes(getattr(out, "cache", None) or getattr(out, "past_key_values", None))
        if kv is not None:  # batches run one after another: the largest is what was reserved at once
            stats.kv_reserved_bytes = max(stats.kv_reserved_bytes or 0, kv)
        stats.extra["generated_width"] = max(stats.extra["generated_width"], new_tokens.shape[1])
        if not self.return_logprobs:
            nan = [float("nan")] * new_tokens.shape[1]
            return [finish_rollout(request, new_tokens[row].tolist(), nan) for row, request in enumerate(batch)]
        if new_tokens.shape[1] != len(out.scores):
            raise EngineError(f"{self.name}: {len(out.scores)} score steps for {new_tokens.shape[1]} new tokens")
        scores = torch.stack(out.scores, dim=1).float().cpu()  # (B, N, V)
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens[..., None])[..., 0]  # (B, N)
        return [
            finish_rollout(request, new_tokens[row].tolist(), logprobs[row].tolist())
            for row, request in enumerate(batch)
        ]
