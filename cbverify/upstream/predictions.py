"""Predictions: what a registered finding's wrong behaviour makes a check observe.

A :class:`~cbverify.upstream.findings.Finding` excuses a FAIL only when the failure is *its* failure: each of its
checks carries a :class:`Prediction`, a pattern the check's reason must contain and, where the wrong value can be
computed, a model of what the affected release computes from the check's observation (the normaliser it divides by,
the advantages its float32 statistics give, the dtype it runs in). Any other failure under the same configuration is
reported as FAIL, naming the finding it did not match.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a finding's wrong behaviour makes one check observe, so that a failure is excused only when it is *this*
    failure: ``pattern``, a regular expression the check's reason must contain (the exception type and message the
    release raises, or the wrong state it leaves, in the check's words), and optionally ``model``, the value the
    affected release computes: ``model(scenario, observed values) -> None`` when the observation is what the release
    computes (within tolerance), else one line saying how it differs."""

    pattern: str
    model: Callable[[object, dict], str | None] | None = None

    def mismatch(self, result, scenario) -> str | None:
        """``None`` when ``result`` is the predicted failure, else why it is not."""
        if not re.search(self.pattern, result.reason):
            return f"its reason does not match /{self.pattern}/"
        if self.model is not None:
            return self.model(scenario, result.observed_values)
        return None


# Models of the wrong values registered findings compute (Prediction.model): each reads a check's observation and
# returns None when it is what the affected release computes, else how it differs.
FLOAT32_EPS = 2.0**-23
TRL_STD_EPS = 1e-4  # TRL divides by std + 1e-4


def float32_mean_rounding(scenario, seen: dict) -> str | None:
    """TRL's float32 group statistics on an equal-reward group of n: the mean rounds to r - d with d = k half-ulps of
    r (k a small nonzero integer), every member deviates by that d, so the (Bessel) std is |d| sqrt(n / (n - 1)) or 0
    and the advantage is d / (std + 1e-4) with group scaling, d without: one value for the whole
    group, equal to one of these for some |k| <= 8 (to 1e-3, float32 arithmetic). Batch scaling divides by the
    batch's std, which the check does not see: there only the size is predicted (d / 1e-4 at most)."""
    rewards, advantages, ends = seen.get("rewards"), seen.get("advantages"), seen.get("group_ends")
    if not (rewards and advantages and ends):
        return "the check observed no equal-reward group's rewards and advantages"
    start = 0
    for end in (int(e) for e in ends):
        scored = [(r, a) for r, a in zip(rewards[start:end], advantages[start:end], strict=True) if r == r]  # not NaN
        start = end
        values = {a for _, a in scored}
        if len(values) != 1:
            return f"advantages {sorted(values)} differ within one equal-reward group (rounding gives them one value)"
        reward, advantage, n = abs(scored[0][0]), values.pop(), len(scored)
        half_ulp = 2.0 ** (math.frexp(reward)[1] - 25) if reward else 2.0**-150
        if scenario.scale_rewards == "batch":
            if not 0 < abs(advantage) <= 8 * half_ulp / TRL_STD_EPS:
                return f"advantage {advantage:.3g} is not float32 rounding of the mean over a batch std"
            continue
        spread = math.sqrt(n / (n - 1)) if n > 1 else 0.0
        # torch's std takes its own mean, which may be exact where the centring mean rounded: then the std is 0
        stds = (0.0, spread) if scenario.scale_rewards == "group" else ()
        predicted = [k * half_ulp / (abs(k) * half_ulp * c + TRL_STD_EPS) for k in range(-8, 9) if k for c in stds]
        predicted += [k * half_ulp for k in range(-8, 9) if k and not stds]
        if not any(abs(advantage - p) <= 1e-3 * abs(p) for p in predicted):
            return f"advantage {advantage:.6g} is none of the values rounding the mean of {n} x {reward:.6g} gives"
    return None


def mean_of_rank_means(scenario, seen: dict) -> str | None:
    """TRL before 1.9 logs a token mean (``entropy``) as ``gather(each rank's masked token mean).nanmean()``: the
    plain mean of the ranks' means, which differs from the global batch's token mean when the ranks hold unequal token
    counts. The logged value is that mean of the ranks' own means (within the trainer-metric tolerance)."""
    from cbverify.tolerances import TRAINER_METRIC

    logged, means, tokens = seen.get("logged"), seen.get("rank_means"), seen.get("rank_tokens")
    if not (logged and means and tokens):
        return "the check observed no per-rank token means to compare with"
    predicted = sum(means) / len(means)
    if abs(logged[0] - predicted) > TRAINER_METRIC.atol + TRAINER_METRIC.rtol * abs(predicted):
        return f"logged {logged[0]:.6g} is not the mean of the ranks' means {predicted:.6g}"
    if len(set(tokens)) == 1:
        return "the ranks hold equal token counts: the mean of their means is the global mean, not this failure"
    return None


def bos_dropped(scenario, seen: dict) -> str | None:
    """Every problem of the batch is a prompt tokenized without its leading BOS (``add_special_tokens=False``):
    nothing else in what reached the trainer is wrong."""
    (problems,), (dropped,) = seen.get("problems", (0.0,)), seen.get("bos_dropped", (0.0,))
    if problems and dropped == problems:
        return None
    return f"{int(problems - dropped)} of {int(problems)} problem(s) are not a prompt missing its leading BOS"


def unscorable_as_zero(scenario, seen: dict) -> str | None:
    """TRL before 1.6 sums reward functions with nansum: an unscorable (NaN) reward counts as 0 in its group's
    statistics and gets an advantage; the advantages are the reference's for the rewards with NaN made 0."""
    import torch

    from cbverify.tolerances import TRAINER_FP32
    from reference.advantages import compute_advantages

    rewards, got = seen.get("rewards"), seen.get("advantages")
    if not rewards or not got or len(rewards) != len(got):
        return "the check observed no rewards and advantages of one process's rows"
    zeroed = torch.tensor(rewards, dtype=torch.float64).nan_to_num(0.0)
    want = compute_advantages(zeroed, scenario.num_generations, scenario.scale_rewards)
    got_t = torch.tensor(got, dtype=torch.float64)
    if not torch.allclose(got_t, want, rtol=TRAINER_FP32.rtol, atol=TRAINER_FP32.atol):
        return f"advantages {got} are not the ones of rewards with NaN as 0 ({want.tolist()})"
    return None


def bf16_forward(scenario, seen: dict) -> str | None:
    """Weights cast to bfloat16 move the probe's logits by bf16 rounding: more than 0, at most 2**-4 of the largest
    logit (16 bf16 ulps through the layers); a forward changed any other way is not this."""
    (diff,), (scale,) = seen.get("max_abs_diff", (None,)), seen.get("max_abs_logit", (None,))
    if diff is None or scale is None:
        return "the check observed no probe difference"
    return None if 0 < diff <= 2**-4 * scale else f"the probe moved by {diff:.3g}, not bf16 rounding of {scale:.3g}"


def bf16_logprobs(scenario, seen: dict) -> str | None:
    """A bfloat16 copy of a float32 sampler: its processed log-probs are off the float32 reference by the bf16
    log-prob tier (``LOW_PRECISION``), not more."""
    from cbverify.tolerances import LOW_PRECISION

    (diff,) = seen.get("max_diff_processed", (None,))
    if diff is None:
        return "the check observed no log-prob difference"
    bound = LOW_PRECISION.logprob_max_abs
    return None if diff <= bound else f"processed log-probs off by {diff:.3g}, past the bf16 tier {bound}"


def another_attention(scenario, seen: dict) -> str | None:
    """The training forward runs paged attention left behind by generation: log-probs off by far more than rounding
    (measured 0.79; at least 1e-2), not a last-bits difference."""
    (diff,) = seen.get("max_diff", (None,))
    if diff is None:
        return "the check observed no log-prob difference"
    return None if diff >= 1e-2 else f"log-probs off by {diff:.3g}, a rounding-sized difference, not another attention"


def _normaliser_ratio(seen: dict) -> list[float] | str:
    """Per loss call, the factor TRL's dapo / cispo normaliser puts on the reference's loss: the window's active
    tokens over TRL's count (``num_items_in_batch``), in the form of the installed release:

    - up to 1.8 (0.x included): every completion token of the generation batch, truncated rows that
      ``mask_truncated_completions`` removes from the loss still counted (the completion lengths);
    - 1.9.0: the generation batch's active tokens;
    - from 1.9.1: those, times gradient_accumulation_steps / steps_per_generation (one mean window)."""
    window, steps = seen.get("window_tokens"), seen.get("steps")
    from cbverify.upstream.findings import installed_in  # findings imports this module

    counted = "generation_tokens" if installed_in("trl", ">=1.9.0") else "generation_completion_tokens"
    generation = seen.get(counted)
    if not (window and generation and steps):
        return f"the check observed no token counts ({counted})"
    per_window = steps[0] / steps[1] if installed_in("trl", ">=1.9.1") else 1.0
    return [w / (g * per_window) for w, g in zip(window, generation, strict=True)]


def dapo_losses(scenario, seen: dict) -> str | None:
    """Every loss call is the reference's times the normaliser ratio (:func:`_normaliser_ratio`), to 1e-4."""
    predicted = _normaliser_ratio(seen)
    if isinstance(predicted, str):
        return predicted
    for got, want in zip(seen.get("ratio", ()), predicted, strict=True):
        if got == got and abs(got - want) > 1e-4 * abs(want):  # NaN: a loss the reference puts at 0
            return f"a loss call is {got:.6g} x the reference's, the release's normaliser gives {want:.6g} x"
    return None


def dapo_gradient(scenario, seen: dict) -> str | None:
    """Where every loss call of the step has one normaliser ratio, the step's gradient is the reference's times it
    (within the float32 step tolerance); a window over generation batches of different sizes mixes ratios, and then
    only the size of the deviation is predicted (between the smallest and largest ratio)."""
    predicted = _normaliser_ratio(seen)
    if isinstance(predicted, str):
        return predicted
    ((scale,), (residual,)) = seen["grad_scale"], seen["grad_residual"]
    ((noise,), (norm,)) = seen["grad_noise"], seen["grad_norm"]
    slack = 2 * noise / max(norm, 1e-300)
    if len(set(predicted)) == 1:
        want = predicted[0]
        if abs(scale - want) > slack or residual > 2 * noise:
            return (
                f"the step's gradient is {scale:.6g} x the reference's (+{residual:.3g} off its direction), the "
                f"release's normaliser gives {want:.6g} x"
            )
    elif not min(predicted) - slack <= scale <= max(predicted) + slack:
        return (
            f"the step's gradient is {scale:.6g} x the reference's, outside the ratios {min(predicted):.6g} to "
            f"{max(predicted):.6g} the release's normaliser gives"
        )
    return None


def unweighted_logged_reward(scenario, seen: dict) -> str | None:
    """A release that logs the reward statistics of the plain sum of the functions (every weight 1): the logged
    ``reward`` and ``reward_std`` are those of the unweighted sums, within the logged-metric tier."""
    from cbverify.tolerances import TRAINER_METRIC

    logged, plain = seen.get("logged", ()), seen.get("unweighted", ())
    if len(logged) != 2 or len(plain) != 2:
        return "no logged and unweighted reward statistics observed"
    pairs = zip(("reward", "reward_std"), logged, plain, strict=True)
    far = [f"{n} {a:.8g} vs unweighted {b:.8g}" for n, a, b in pairs
           if abs(a - b) > TRAINER_METRIC.atol + TRAINER_METRIC.rtol * abs(b)]  # fmt: skip
    return f"logged {'; '.join(far)}" if far else None
