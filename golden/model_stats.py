"""Figures that say whether a bundled model is a discriminating test model, written into its README by the builders.

- :func:`attention_stats`: how far attention is from uniform. A model whose attention is near-uniform (the max weight
  of a row close to 1/L) hides attention bugs — a wrong mask, a wrong RoPE position, a stale KV block all average to
  nearly the same output.
- :func:`greedy_gap_stats`: the top-2 logit gap at every greedy step. Near-ties (gap below ~1e-3) let float noise
  flip a greedy token, which weakens token-equality checks.
- :func:`summary`: min / p10 / median / p90 / max of a list of numbers.
"""

from __future__ import annotations

import statistics

import torch


def summary(values: list[float], digits: int = 4) -> dict[str, float]:
    """``{"min", "p10", "median", "p90", "max"}`` of ``values`` (nearest-rank percentiles), rounded."""
    ordered = sorted(values)
    at = [ordered[min(len(ordered) - 1, int(f * len(ordered)))] for f in (0.1, 0.9)]
    picks = (ordered[0], at[0], statistics.median(ordered), at[1], ordered[-1])
    return {k: round(float(v), digits) for k, v in zip(("min", "p10", "median", "p90", "max"), picks, strict=True)}


@torch.no_grad()
def attention_stats(model, sequences: list[list[int]]) -> dict[str, float]:
    """Attention at the last position of each sequence, over every layer and head (eager attention, float32).

    Returns the mean and max of the row's largest weight, the mean uniform weight 1/L for comparison, and the mean
    row entropy normalised by log L (1.0 = uniform). The model's attention implementation is restored afterwards.
    """
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    maxima, entropies, uniform = [], [], []
    try:
        for ids in sequences:
            out = model(torch.tensor([ids]), output_attentions=True)
            length = len(ids)
            uniform.append(1.0 / length)
            for layer in out.attentions:  # (1, H, L, L)
                row = layer[0, :, -1, :].float()  # (H, L)
                maxima += row.max(-1).values.tolist()
                entropy = -(row * row.clamp_min(1e-30).log()).sum(-1) / torch.log(torch.tensor(float(length)))
                entropies += entropy.tolist()
    finally:
        model.set_attn_implementation(previous)
    return {
        "max_weight_mean": round(statistics.mean(maxima), 4),
        "max_weight_max": round(max(maxima), 4),
        "uniform_weight_mean": round(statistics.mean(uniform), 4),
        "normalised_entropy_mean": round(statistics.mean(entropies), 4),
    }


@torch.no_grad()
def greedy_gap_stats(model, prompts: list[list[int]], *, eos_token_ids: list[int], max_new_tokens: int) -> dict:
    """Greedy decoding of each prompt alone (no padding); the top-2 logit gap at every step up to and including EOS.

    Returns the number of steps, the min and median gap and the fraction of steps with a gap below 1e-3 and 1e-4.
    """
    gaps: list[float] = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long), do_sample=False,
            max_new_tokens=max_new_tokens, eos_token_id=eos_token_ids, pad_token_id=eos_token_ids[-1],
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        for logits in out.logits:  # one (1, V) per generated token
            top = logits[0].float().topk(2).values
            gaps.append(float(top[0] - top[1]))
    return {
        "steps": len(gaps),
        "min": float(f"{min(gaps):.3g}"),
        "median": round(statistics.median(gaps), 4),
        "fraction_below_1e-3": round(sum(g < 1e-3 for g in gaps) / len(gaps), 4),
        "fraction_below_1e-4": round(sum(g < 1e-4 for g in gaps) / len(gaps), 4),
    }
