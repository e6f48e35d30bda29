"""Every tolerance of the suite, defined once, each with its reason and how it was measured.

Tests, ``cbverify verify``, the golden checks and the upstream numerics import these names; no other file holds a
tolerance literal (a test may compute a bound from one of these, e.g. ``FP32.logprob_max_abs / T``).

| name | what it bounds |
|---|---|
| :data:`FP32`, :data:`BF16`, :data:`FP16` (:func:`tier_for`) | an engine's tokens and log-probs against the oracle |
| :func:`recurrent_tier` (:func:`tier_for_model`) | the same, float32, a recurrent decode (:func:`recurrent_state`) |
| :data:`LOW_PRECISION` | TRL's bf16-autocast trainer log-probs against the float32 oracle |
| :data:`SAME_LOGITS_ATOL` | two implementations of the sampling rule on the *same* float32 logits |
| :data:`PASS_THROUGH_ATOL` | a float32 value handed from one component to another unchanged |
| :data:`SEMANTICS_GAP` | telling processed log-probs from full-support ones |
| :data:`BOUNDARY_RELAX` | a sampled token at a top-p / min-p cut |
| :data:`TRAINER_FP32` | TRL's float32 advantages / loss / loss gradient against the float64 oracle |
| :data:`MATH_RTOL`, :data:`MATH_ATOL` | float64 GRPO math against TRL's code or a second float64 formula |
| :data:`FLOAT64_RTOL`, :data:`FLOAT64_ATOL`, ... | float64 identities that only reorder a few operations |
| :data:`GOLDEN_LOGPROBS`, :data:`GOLDEN_TRAJECTORY` | re-runs against recorded goldens |
| :data:`DISTRIBUTION_ALPHA`, :data:`SELF_TEST_PVALUE` | false-alarm rates of the statistical tests |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from reference.spec import SamplingParams

TokenRule = Literal["exact_or_near_tie", "near_tie_in_noise"]


@dataclass(frozen=True, slots=True)
class Tier:
    """How an engine's rollouts are judged against the oracle at one dtype.

    Bounds are in *units*: 1 when ``ulp == 0`` (absolute, float32), else ``ulp * max(1/4, M)`` at each position, where
    ``ulp`` is the dtype's spacing at 1 (``torch.finfo(dtype).eps``) and ``M`` the largest |logit| of the reference's
    teacher-forced row there (:meth:`unit`): the spacing of the dtype at the logits' magnitude, within a factor 2.
    Log-prob bounds are further scaled per token by its sensitivity (``cbverify.compare.noise_positions``).

    - ``token_rule``: ``exact_or_near_tie``: tokens must be identical; a divergence is accepted (and reported) only
      where the reference's token scores at most ``near_tie_gap`` above the engine's. ``near_tie_in_noise``: the same,
      with the gap in units (divided by T when sampled: the decision score is logits / T + noise), and a sampling
      processor's cut may move by the same noise: a token within it of the top-k / top-p / min-p boundary may be
      in or out (``cbverify.divergence.boundary_tokens``).
    - ``logprob_max_abs`` / ``logprob_mean_abs``: bounds on |engine log-prob - reference teacher-forced log-prob| per
      position (max over tokens, mean over tokens), after :func:`logprob_scale`, in units. With ``ulp > 0`` a position
      whose processed support can change within ``near_tie_gap / 2`` units of logit noise is not judged on its
      log-prob when it disagrees (the two sides renormalised over different kept sets); it is counted instead.
    """

    name: str
    token_rule: TokenRule
    near_tie_gap: float
    logprob_max_abs: float
    logprob_mean_abs: float
    reason: str
    ulp: float = 0.0

    def __post_init__(self) -> None:
        if self.token_rule not in ("exact_or_near_tie", "near_tie_in_noise"):
            raise ValueError(f"unknown token_rule {self.token_rule!r}")
        if not all(x >= 0 for x in (self.near_tie_gap, self.logprob_max_abs, self.logprob_mean_abs, self.ulp)):
            raise ValueError("tolerances must be >= 0 (and not NaN)")
        if (self.token_rule == "near_tie_in_noise") != (self.ulp > 0):
            raise ValueError("near_tie_in_noise needs the dtype's ulp (> 0), exact_or_near_tie absolute bounds")

    def unit(self, max_abs_logit: float) -> float:
        """The size of one unit of this tier's bounds at a position whose largest |logit| is ``max_abs_logit``."""
        return self.ulp * max(0.25, max_abs_logit) if self.ulp > 0 else 1.0


FP32 = Tier(
    name="fp32",
    token_rule="exact_or_near_tie",
    near_tie_gap=1e-4,
    logprob_max_abs=5e-5,
    logprob_mean_abs=1e-5,
    reason=(
        "float32 logits differ between engines only by reduction order (padding, packing, a 1-row KV-cached decode "
        "vs a full forward): on the bundled Llama, 48 greedy arithmetic rollouts (1991 tokens) give a p99.9 of "
        "3-5e-6 for every engine, the reference's full recompute against its own teacher forcing reaches 1.2e-5 "
        "(logits up to ~17 differ by up to 8e-6), and hf-generate 1.26e-5 (1.66e-5 on a drawn example); a max of "
        "1e-5 is inside that noise, so the max is 5e-5 (3x headroom) and the mean 1e-5. A token can flip only "
        "where two decision scores are within 1e-4."
    ),
)


# bf16 / fp16: the noise is a few ulps of the logits' own magnitude (one bf16 step at |logit| ~ 10 is 0.0625, above
# any flat bound that would still catch a bug at |logit| ~ 1), so bounds are in *units* of ``eps * max(1/4, M)``
# (``Tier.unit``: the dtype's spacing at the row's largest |logit| M, within a factor 2; the 1/4 floor keeps the
# near-uniform rows of a random model, M ~ 0.6, from getting a window wider than their own logit spread). Each logit
# may move by K = ``near_tie_gap / 2`` units; a log-prob then moves by at most log(p + (1 - p) e^(2K)) (p: the token's
# processed probability; 2K for an unlikely token, ~0 for a sure one), plus one ulp of its own value: that is one
# log-prob "unit" per position (``compare.noise_positions``), and ``logprob_max_abs`` = 2K of them is the exact
# first-order worst case. Measured on CPU (torch 2.13.0, transformers 5.24.0, 1 thread), per position:
# - logit noise, the reference's own generation (one forward per prefix) against its teacher forcing (one forward of
#   the whole sequence), in eps * max(1, M): bundled Llama 0.97, random Qwen2 0.50, zoo llama 1.36, gemma 0.73,
#   qwen3_moe 1.13 (bf16);
# - log-probs against teacher forcing, in these units, every engine on the whole bf16 zoo (``cbverify zoo --dtype
#   bfloat16``): max 2.62 (cb_impl, gemma3_text; the reference itself 1.83, starcoder2), mean per engine and
#   architecture <= 0.49; with the former eps * max(1, M) units and no sensitivity: bf16 4.36, fp16 5.41 max;
# - at a processor cut (near-uniform rows where a top-p / top-k cut falls within that noise: random Qwen2 at top-p
#   0.95) the two sides renormalise over different kept sets: up to 0.17 absolute, and a sampled token just outside
#   the reference's cut gets -inf (hf-generate): such positions are counted, not judged.
# So K = 4 (3x the reference's own 1.36): a decision-score gap is two entries (``near_tie_gap`` 8), a processor cut
# moves by K, a log-prob by 8 units (3x the largest measurement), their mean by 1 (2x). The signal: the faulty
# engines of ``property_tests/faulty.py`` (shifted, reordered, re-processed log-probs, a shared RNG) in bf16, caught
# by ``test_meta_power.py`` / ``test_meta_verify.py``; zoo gemma2's dropped attention softcap (0.095 at |logit| ~ 2.4
# in float32) is ~5 bf16 units: in bf16 only its mean (1.3 units) crosses a bound.
BF16 = Tier(
    name="bf16",
    token_rule="near_tie_in_noise",
    near_tie_gap=8.0,
    logprob_max_abs=8.0,
    logprob_mean_abs=1.0,
    ulp=torch.finfo(torch.bfloat16).eps,
    reason="bfloat16 keeps 8 significant bits: logits carry up to ~1.4 ulps of their magnitude of reduction-order "
    "noise (measured above); a logit may move by 4 units, a gap or a log-prob by 8, the mean by 1",
)
FP16 = Tier(
    name="fp16",
    token_rule="near_tie_in_noise",
    near_tie_gap=8.0,
    logprob_max_abs=8.0,
    logprob_mean_abs=1.0,
    ulp=torch.finfo(torch.float16).eps,
    reason="float16 keeps 11 significant bits; its noise in its own ulps is that of bfloat16 in its (measured above)",
)


@dataclass(frozen=True, slots=True)
class FlatLogprobBound:
    """A flat bound on |log-prob difference| (max over tokens, mean over tokens), in log-prob units."""

    logprob_max_abs: float
    logprob_mean_abs: float
    reason: str


# TRL's own trainer log-probs under ``bf16=True`` (autocast over float32 weights) against the float32 oracle
# (``cbverify.upstream.numerics``): a different computation from an engine's on a bf16 checkpoint, kept as measured.
LOW_PRECISION = FlatLogprobBound(
    logprob_max_abs=5e-2,
    logprob_mean_abs=2.5e-2,
    reason="bfloat16 autocast keeps 8 significant bits: TRL's trainer log-probs stay within 5e-2 of the float32 "
    "oracle; their mean reached 1.16e-2 on the re-initialised Qwen2 (logits of order 1, where a bf16 ulp is "
    "4e-3 .. 8e-3), so the mean bound is 2x that",
)


def logprob_scale(sampling: SamplingParams) -> float:
    """Factor applied to |d log-prob| before comparing it with a tier's bounds: ``min(1, T)`` when sampled, else 1.

    Reason: processed log-probs are computed from ``logits / T``, so the same float32 noise on the logits (different
    GEMM shapes: a 1-row decode vs a full-sequence forward) reaches the log-probs multiplied by ``1 / T``. Measured:
    2.05e-5 at T=0.3 for ``hf-generate`` on the bundled Llama where T=1 stays below 7e-6 (the reference against its
    own teacher forcing: 4.2e-5 at T=0.3). Scaling by ``T`` compares in logit units, so the bounds hold at T >= 1.
    """
    return 1.0 if sampling.greedy else min(1.0, sampling.temperature)


def tier_for(dtype: torch.dtype | str) -> Tier:
    """The tier for a model dtype (``torch.float32`` or ``"float32"`` -> ``FP32``; ``BF16``, ``FP16``)."""
    name = str(dtype).removeprefix("torch.")
    tiers = {"float32": FP32, "bfloat16": BF16, "float16": FP16}
    if name in tiers:
        return tiers[name]
    raise ValueError(f"no tolerance tier for dtype {dtype!r} (float32, bfloat16, float16)")


# A recurrent decode (linear attention, state-space, short convolution: ``recurrent_state``) updates a fixed-size state
# one token at a time, while a prefill (the oracle's full recompute, its teacher forcing) runs a chunked scan or a
# convolution over the whole sequence: two right computations whose float32 difference grows with the sequence, as
# reduction-order noise of attention over stored keys does not. Measured with ``python -m cbverify.zoo.measure_noise
# --archs qwen3_next olmo_hybrid mamba mamba2 lfm2 falcon_h1 bamba granitemoehybrid jamba llama --new-tokens 112
# --seeds 4`` (CPU, torch 2.13.0, transformers 5.24.0, 1 thread; 9 requests of 112 tokens on a 12-token prompt per
# architecture, |Δ log-prob| against teacher forcing scaled by ``logprob_scale``), max over positions and per token of
# context (|Δ| / t, t the position's 1-based index in prompt + completion):
# - gated delta-rule layers: qwen3_next hf-generate 1.75e-4 (3.24e-6 per token), the reference itself 7.8e-5
#   (7.6e-7); olmo_hybrid 4.1e-5 (8.1e-7), the reference 2.5e-5; from ~1e-6 in the first 8 positions, growing;
# - state-space and convolution layers (hf-generate, the reference): mamba 9.1e-6 (4.5e-7), 3.3e-6; granitemoehybrid
#   4.7e-6, 3.4e-6; jamba 3.8e-6, 3.0e-6; falcon_h1 3.1e-6, 2.3e-6; lfm2 2.5e-6, 1.6e-6; mamba2 2.4e-6, 1.2e-6;
#   bamba 1.7e-6, 1.4e-6: inside the fp32 tier, but the same kind of computation (the tier goes by what a model
#   computes; a tighter one for scans that happen to be quiet would be tuned to these weights);
# - attention only, for comparison: llama hf-generate 3.0e-6, the reference 3.1e-6, flat in length.
# So the bound grows by 1e-5 per token of context (3x the largest rate, 3.24e-6), from the fp32 tier's 5e-5 up
# (:func:`recurrent_tier`): at the zoo's 26 tokens 2.6e-4, at 112 + 12 tokens 1.24e-3, still ~80x below a dropped
# softcap's 0.095 and far below a state carried wrongly (O(1)). In bf16 the same layers stay inside the bf16 tier's
# units (``--dtype bfloat16 --new-tokens 64 --seeds 2``: max 2.27 units, mamba hf-generate; qwen3_next 1.51; llama
# 1.88; positions at a processor cut left out as the judge does): its
# units scale with the logits, and bf16 rounding dominates the state's float32 drift, so it needs no second tier.
RECURRENT_GROWTH = 1e-5


def _cache_tensors(obj, path: str = "", depth: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """``(path, shape)`` of every floating-point tensor of 2 or more dims reachable from a decode cache (objects,
    lists, tuples, dicts; 5 levels)."""
    if isinstance(obj, torch.Tensor):  # activations only: not a window size or a length kept as a tensor
        return [(path, tuple(obj.shape))] if obj.is_floating_point() and obj.ndim >= 2 else []
    if depth > 5 or obj is None or isinstance(obj, (str, int, float, bool, torch.nn.Module, torch.dtype)):
        return []
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        slots = [s for cls in type(obj).__mro__ for s in getattr(cls, "__slots__", ())]
        fields = dict(getattr(obj, "__dict__", {})) | {s: getattr(obj, s) for s in slots if hasattr(obj, s)}
        items = ((k, v) for k, v in fields.items() if k != "config")
    return [t for k, v in items for t in _cache_tensors(v, f"{path}.{k}" if path else str(k), depth + 1)]


def recurrent_state(model) -> tuple[str, ...]:
    """The parts of ``model``'s decode cache that carry a fixed-size state: tensors whose shape is the same after a
    prefill of 2 and of 3 tokens (a key / value cache grows by a row per token; a linear-attention, state-space or
    convolution state does not). Non-empty: the model's decode is a recurrence over that state, not attention over
    stored keys, and computes its tokens differently from a prefill of the whole sequence (a chunked scan, a
    convolution over the sequence). Read off two tiny forwards of the model itself, not its name or config."""
    param = next(model.parameters())
    shapes = []
    with torch.no_grad():
        for n in (2, 3):
            ids = (torch.arange(1, n + 1) % model.config.vocab_size).unsqueeze(0).to(param.device)  # (1, n)
            out = model(input_ids=ids, use_cache=True)
            cache = next(
                (out[k] for k in ("cache", "past_key_values", "cache_params", "state") if out.get(k) is not None), None
            )  # names of one object across releases: read one
            shapes.append(dict(_cache_tensors(cache)))
    short, long = shapes
    return tuple(path for path, shape in long.items() if short.get(path) == shape)


def recurrent_tier(max_length: int) -> Tier:
    """The float32 tier of a model whose decode is a recurrence (:func:`recurrent_state`), for sequences of up to
    ``max_length`` tokens (prompt and completion): :data:`FP32`'s bounds times ``max(1, RECURRENT_GROWTH *
    max_length / FP32.logprob_max_abs)``, the decision-score gap of a near-tie with them (see :data:`RECURRENT_GROWTH`
    for the measurement)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    factor = max(1.0, RECURRENT_GROWTH * max_length / FP32.logprob_max_abs)
    return Tier(
        name="fp32-recurrent",
        token_rule="exact_or_near_tie",
        near_tie_gap=FP32.near_tie_gap * factor,
        logprob_max_abs=FP32.logprob_max_abs * factor,
        logprob_mean_abs=FP32.logprob_mean_abs * factor,
        reason=f"float32 with a recurrent decode (linear attention, state-space, convolution): a one-token state "
        f"update and a chunked prefill of the whole sequence differ by noise that grows with the sequence, up to "
        f"{RECURRENT_GROWTH:g} per token of context measured x3; at {max_length} tokens {factor:.3g}x the fp32 "
        f"tier",
    )


def tier_for_model(model, dtype: torch.dtype | str | None = None, *, max_length: int) -> Tier:
    """The tier for ``model`` at ``dtype`` (default: its parameters') on sequences of up to ``max_length`` tokens:
    :func:`tier_for`, except that a float32 model whose decode carries a recurrent state (:func:`recurrent_state`,
    read off the model's own cache, whatever its name) gets :func:`recurrent_tier`. bf16 / fp16 bounds are already
    relative to the logits' magnitude and hold for such layers as measured (see :data:`RECURRENT_GROWTH`)."""
    dtype = next(model.parameters()).dtype if dtype is None else dtype
    tier = tier_for(dtype)
    if tier is FP32 and recurrent_state(model):
        return recurrent_tier(max_length)
    return tier


# Same float32 logits through two implementations of temperature/top-k/top-p/min-p + log_softmax (cb_impl's batched
# sampler vs the oracle's per-row rule): only elementwise order differs, ~1e-7 for log-probs of magnitude <= 10.
SAME_LOGITS_ATOL = 1e-6
# A float32 value copied between components (a rollout's log-probs -> TRL's ``sampling_per_token_logps``): a float32
# round trip of values up to ~10 in magnitude moves them by at most ~1e-6; anything larger is a different value.
PASS_THROUGH_ATOL = 1e-6
# Processed and full-support log-probs of a restricted sampler differ by log(kept mass), >= 1e-3 whenever a
# processor removes >= 0.1% of the mass; 1e-4 is 2x the fp32 engine bound, so float noise never decides it.
SEMANTICS_GAP = 1e-4
# A sampled token whose cumulative mass sits exactly at a top-p / min-p cut can fall on either side under float32
# reordering; support checks widen top-p by this much (and min-p by this fraction) so only real violations fail.
BOUNDARY_RELAX = 1e-3


@dataclass(frozen=True, slots=True)
class Closeness:
    """``|got - want| <= atol + rtol * |want|`` (``torch.allclose``'s rule)."""

    rtol: float
    atol: float
    reason: str


# TRL computes advantages, the loss and its gradient in float32; the oracle in float64. float32 carries 6e-8 relative
# error per operation and the loss sums ~100 terms, so ~1e-6 relative is the expected drift; rtol 1e-5 leaves 10x.
# atol: advantages are O(1), so 1e-6 absolute is float32 epsilon with margin; gradients per token are O(1 / tokens).
TRAINER_FP32 = Closeness(rtol=1e-5, atol=1e-6, reason="float32 trainer math vs the float64 oracle (see comment)")
TRAINER_FP32_GRAD_ATOL = 1e-8  # per-token loss gradients are ~1e-2 .. 1e-4: 1e-8 is below float32 resolution there
# The gradient TRL hands the optimizer (float32 forward and backward through the model, accumulated over the window)
# vs the float64 oracle's: |g - g_ref| over all parameters, relative to the step's cancellation-free scale (the norm of
# the gradient with every advantage made positive: float32 rounds each row's term, not their sum). Measured on clean
# runs of the bundled arithmetic Llama: 2e-6 .. 1.2e-5 at T = 1.5, up to 1.3e-4 at T = 1 (the trained model is sure
# of its tokens, and float32 loses the 1 - p of a log-softmax gradient at p ~ 0.999: 6e-8 / 1e-3); 1e-3 leaves ~8x.
TRAINER_FP32_PARAM_GRAD = 1e-3
# Numbers TRL logs per optimizer step (entropy, clip ratios, KL, grad norm): float32 means of float32 values.
TRAINER_METRIC = Closeness(rtol=1e-4, atol=1e-6, reason="float32 logged means vs the float64 oracle")

# float64 GRPO math against TRL's own code on the same float64 inputs, or against a second float64 formula: only the
# summation order differs (~1e-12 relative measured), 1e-6 leaves a wide margin yet catches any real formula change.
MATH_RTOL = 1e-6
# Values that are exactly 0 on one side: TRL's plain mean of a constant group can be one ulp (~4e-16) off, which its
# eps = 1e-4 in the std denominator turns into ~4e-12; losses and gradients of 0 likewise.
MATH_ATOL = 1e-10
# float64 identities that reorder a handful of operations (padding invariance, scaling, a clipped weight recomputed).
FLOAT64_RTOL = 1e-9
FLOAT64_ATOL = 1e-15
# float64 identities through a cancellation: shifting rewards by a constant then subtracting the group mean leaves
# ~|offset| * 2^-52 absolute, which a group std near 0 (denominator std + 1e-4) amplifies up to 1e4-fold.
FLOAT64_CANCELLATION_ATOL = 1e-7


@dataclass(frozen=True, slots=True)
class Tolerance:
    """A golden comparison: each point-wise |Δ| within :meth:`bound` of the golden value (``max_abs``, plus ``rel``
    times the value's magnitude: a low-ranked token's log-prob of -13 carries the rounding of logits of that size),
    and |mean Δ| over all positions within ``mean_drift`` (it flags a systematic one-sided shift that stays point-wise
    small), as in TRL's invariant tests."""

    max_abs: float
    mean_drift: float
    reason: str
    rel: float = 0.0

    def __post_init__(self) -> None:
        if not (self.max_abs > 0 and self.mean_drift > 0 and self.rel >= 0):
            raise ValueError(f"tolerances must be > 0, got max_abs={self.max_abs}, mean_drift={self.mean_drift}")
        if self.mean_drift > self.max_abs:
            raise ValueError("mean_drift > max_abs can never bind; make it tighter")

    def bound(self, value: float) -> float:
        return self.max_abs + self.rel * abs(value)


# Golden noise: the measurements (fresh process, threads, another CPU's kernels, engines, and the 1e-3 perturbation
# signal) are tabled in golden/README.md; ``python -m cbverify.golden.measure_noise`` re-measures them.
_GOLDEN_FP32 = Tolerance(5e-5, 1e-6, "another CPU's kernels move float32 top-5 log-probs by up to 2.0e-5 (1 thread "
                         "instead of 2: 2.4e-7): 2.5x margin, still 3.6x below the smallest perturbation signal "
                         "(1.8e-4); the mean drift stays below 1e-8 everywhere: 100x margin")  # fmt: skip
_GOLDEN_BF16 = Tolerance(5e-2, 3e-3, "one bf16 ulp of a logit in [2, 4) is 2^-6 = 1.6e-2, and a low-ranked token's "
                         "log-prob carries the rounding of logits of its own size: 2^-8 relative per ulp, measured "
                         "1.05e-2 x |value| (two ulps) on another CPU, so rel = 4 ulps; a 1e-3 weight perturbation "
                         "(<= 7.1e-3) is below that: the float32 goldens are the sensitive guard; mean drift 2x the "
                         "1.45e-3 of cb_impl on the re-initialised Qwen2 (logits of order 1)",
                         rel=4 * 2**-8)  # fmt: skip
_NO_FP16 = "as bfloat16 (no float16 goldens recorded yet; re-measure when adding them)"
# The reference re-run against its own golden (teacher-forced and re-generated log-probs), and any engine's sampling
# log-probs against the golden (recorded by the reference) on the common token prefix: one bound for both, since
# another CPU's kernels move the reference itself more than batching, padding or paging move an engine.
GOLDEN_LOGPROBS: dict[str, Tolerance] = {
    "float32": _GOLDEN_FP32,
    "bfloat16": _GOLDEN_BF16,
    "float16": Tolerance(5e-2, 3e-3, _NO_FP16, rel=4 * 2**-8),
}
# The 5-step GRPO trajectory (float32 only), per metric. Measured: a fresh process and 1 thread instead of 2 reproduce
# all 5 steps exactly (0 / 0). Recorded magnitudes: loss 3e-17 .. 1.7e-4 (~beta * KL), grad norm 6e-5 .. 2.0.
GOLDEN_TRAJECTORY: dict[str, Tolerance] = {
    "loss": Tolerance(1e-6, 5e-7, "noise 0 measured; float32 log-prob noise of another CPU (~1e-7) moves the loss "
                      "by ~1e-8: 100x margin, yet 170x below the largest step loss"),
    "grad_norm": Tolerance(1e-4, 5e-5, "noise 0 measured; ~1e-6 relative expected on other CPUs: 100x margin on "
                           "norms of ~1"),
    "mean_reward": Tolerance(1e-9, 1e-9, "exact: rewards are 0/1 from identical tokens; any change is a token change"),
}  # fmt: skip


# Statistical tests. The distribution test of own-RNG engines: Holm-corrected, <= 1e-3 false alarms per call. The
# oracle's own sampling and noise self-tests (chi-square, KS) use 1e-6 per case: many cases per run, and a false
# alarm there would send someone hunting a bug in the oracle.
DISTRIBUTION_ALPHA = 1e-3
SELF_TEST_PVALUE = 1e-6
# The cross-rank stream check (ranks_sample_distinct_streams) calls "shared stream" when every same-prompt row pair
# on two ranks drew one completion. Under independent streams that happens with probability prod_pairs p(row), the
# processed probability of one side's completion, computed from the model: the check judges only where that is
# below this false-alarm rate (power against a shared stream is 1: the same noise draws the same tokens).
STREAM_ALPHA = 1e-3
