"""Judging one ``model.generate_batch`` call: what the ``GenerationConfig`` asked for, read with transformers'
documented semantics (:func:`intent`), the oracle extended by the options ``generate_batch`` accepts, and the checks.

**What a call asks for** (:class:`Intent`). ``generate()``'s rule for a parameter: a keyword argument overrides the
``GenerationConfig`` passed, a field left unset (``None``) takes ``model.generation_config``'s value, then the
release's global default (the ``GenerationConfig`` docstring: unset fields are "overridden by
``_get_default_generation_params()``"; read through ``transformers_compat.generation_defaults``). ``min_length`` is
the whole sequence's (prompt included) and ``min_new_tokens`` overrides it when set; ``num_return_sequences`` results
come back per input, consecutive, inputs in order (the order ``generate()`` returns its rows in, and the order TRL
reads ``generate_batch``'s dict in); ``no_repeat_ngram_size`` n: "all ngrams of that size can only occur once" in
the sequence, prompt included (``NoRepeatNGramLogitsProcessor``); ``top_k`` at or beyond the vocabulary cuts
nothing; ``eos_token_id`` an int or a list (``[]``: no EOS).

**The oracle** is ``reference`` (``generate.process_logits`` for temperature / top-k / top-p / min-p,
``processors_extra`` for the repetition penalty and the EOS mask of a minimum length), with the n-gram ban added
here (:func:`banned_by_ngrams`, the processor's rule re-read from its documentation), in ``generate()``'s order:
penalty, n-gram ban, minimum length, then the warpers. One full forward per token.

**Checks** (a check is *decisive* on a call where it could have failed; :func:`judge_batch_call` returns both):
``engine-crash`` (``generate_batch`` raised, hung, or its generation thread died), ``request-failed`` (a result
with an error), ``result-count`` (inputs x ``num_return_sequences`` results), ``results-order`` (each input's
results consecutive, inputs in order, told by the prompt each result carries; decisive with two distinct prompts),
``conventions`` (1 <= length <= max_new_tokens, nothing after the first EOS), ``min-new-tokens`` (no EOS before the
minimum; decisive with an EOS and a minimum), ``no-repeat-ngram`` (no n-gram ending in the completion occurs
earlier; decisive where some n-gram was banned), ``tokens`` (greedy: the oracle's, except at a near-tie of the fp32
tier), ``support`` (sampled: every token inside the oracle's processed support, top-p / min-p relaxed by
``BOUNDARY_RELAX``; decisive where that support is smaller than the vocabulary), ``logprobs`` (with
``return_logprobs``: the oracle's processed log-probs of the result's own tokens within the fp32 tier).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cbverify import compare
from cbverify.fuzz.case import FuzzCase, Step
from cbverify.fuzz.drivers import CallResult
from cbverify.fuzz.judge import Failure
from cbverify.tolerances import BOUNDARY_RELAX, FP32
from reference import processors_extra as px
from reference.generate import next_token_logits, process_logits
from reference.spec import Rollout, RolloutRequest, SamplingParams

BATCH_CHECKS = (
    "engine-crash", "request-failed", "result-count", "results-order", "conventions", "min-new-tokens",
    "no-repeat-ngram", "tokens", "support", "logprobs", "plain-forward",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Intent:
    """What one ``generate_batch`` call asks for, every field resolved (see the module docstring)."""

    do_sample: bool
    num_return_sequences: int
    max_new_tokens: int
    eos: tuple[int, ...]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    min_new_tokens: int | None
    min_length: int
    no_repeat_ngram_size: int

    def min_new(self, prompt_len: int) -> int:
        """Completion tokens before an EOS may come: ``min_new_tokens`` if set, else what ``min_length`` leaves."""
        if self.min_new_tokens is not None:
            return self.min_new_tokens
        return max(0, self.min_length - prompt_len)

    def sampling(self, relax: bool = False) -> SamplingParams:
        if not self.do_sample:
            return SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens)
        top_p, min_p = (min(1.0, self.top_p + BOUNDARY_RELAX), self.min_p * (1 - BOUNDARY_RELAX)) if relax else (
            self.top_p, self.min_p)  # fmt: skip
        return SamplingParams(self.temperature, self.top_k, top_p, min_p, self.max_new_tokens)

    def request(self, request_id: str, prompt) -> RolloutRequest:
        return RolloutRequest(request_id, tuple(prompt), self.sampling(), 0, self.eos)


def intent(generation: dict, options: dict, model_generation: dict, defaults: dict) -> Intent:
    """Resolve a call: ``options`` (generate_batch's keyword arguments) over ``generation`` (the config passed) over
    ``model_generation`` (``model.generation_config`` as the caller left it) over ``defaults``."""
    asked = {**generation, **{k: v for k, v in options.items() if v is not None}}

    def get(name: str, fallback=None):
        for layer in (asked, model_generation, defaults):
            if layer.get(name) is not None:
                return layer[name]
        return fallback

    if get("max_new_tokens") is None:
        raise ValueError("a generate_batch case sets max_new_tokens (the config's or the keyword's)")
    eos = get("eos_token_id")
    eos = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
    return Intent(
        do_sample=bool(get("do_sample", False)), num_return_sequences=int(get("num_return_sequences", 1)),
        max_new_tokens=int(get("max_new_tokens")), eos=eos, temperature=float(get("temperature", 1.0)),
        top_k=int(get("top_k", 0)), top_p=float(get("top_p", 1.0)), min_p=float(get("min_p", 0.0)),
        repetition_penalty=float(get("repetition_penalty", 1.0)),
        min_new_tokens=None if get("min_new_tokens") is None else int(get("min_new_tokens")),
        min_length=int(get("min_length", 0)), no_repeat_ngram_size=int(get("no_repeat_ngram_size", 0)),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ the oracle
def banned_by_ngrams(sequence, n: int) -> set[int]:
    """Tokens that would complete an n-gram already in ``sequence`` (its last n-1 tokens followed by them)."""
    if n <= 0 or len(sequence) + 1 < n:
        return set()
    tail = tuple(sequence[len(sequence) - n + 1 :]) if n > 1 else ()
    return {int(sequence[i + n - 1]) for i in range(len(sequence) - n + 1) if tuple(sequence[i : i + n - 1]) == tail}


def processed(model, want: Intent, prompt, completion, *, relax: bool = False) -> torch.Tensor:
    """(V,) float32 processed log-probs of the next token: penalty, n-gram ban, minimum length, then the warpers."""
    context = [*prompt, *completion]
    scores = next_token_logits(model, context)
    scores = px.apply_repetition_penalty(scores, context, want.repetition_penalty)
    banned = banned_by_ngrams(context, want.no_repeat_ngram_size)
    if banned:
        scores = scores.clone()
        scores[sorted(banned)] = float("-inf")
    scores = px.apply_min_new_tokens(scores, want.eos, len(completion), want.min_new(len(prompt)))
    return process_logits(scores, want.sampling(relax))


def greedy(model, want: Intent, prompt) -> list[int]:
    out: list[int] = []
    for _ in range(want.max_new_tokens):
        out.append(int(torch.argmax(processed(model, want, prompt, out))))
        if out[-1] in want.eos:
            break
    return out


# ------------------------------------------------------------------------------------------------ the checks
def judge_batch_call(model, case: FuzzCase, step: Step, result: CallResult, want: Intent):
    """``(failures, decisive checks)`` of one call, ``want`` resolved by :func:`intent`."""
    out: list[Failure] = []
    decisive = {"engine-crash", "request-failed"}
    if result.crash:
        out.append(Failure("engine-crash", result.crash[:300]))
    inputs = [r.prompt_ids for r in step.requests]
    expected = [p for p in inputs for _ in range(want.num_return_sequences)]
    got = result.raw
    for o in got:
        if o.error is not None:
            out.append(Failure("request-failed", f"{o.request_id!r}: {o.error}"[:300]))
    if not result.crash:
        decisive.add("result-count")
        if len(got) != len(expected):
            ids = [o.request_id for o in got]
            n = want.num_return_sequences
            out.append(Failure("result-count", f"{len(got)} results for {len(inputs)} inputs x {n}: {ids}"[:300]))
        elif len(set(inputs)) > 1:
            decisive.add("results-order")
            bad = next((i for i, (p, o) in enumerate(zip(expected, got, strict=True)) if o.prompt_ids != p), None)
            if bad is not None:
                what = f"answers prompt {list(got[bad].prompt_ids)}, expected {list(expected[bad])}"
                out.append(Failure("results-order", f"result {bad} ({got[bad].request_id!r}) {what}"))
    oracle: dict[tuple, list[int]] = {}
    for o in got:
        if o.error is not None or o.prompt_ids not in inputs:
            if o.error is None:
                out.append(Failure("results-order", f"{o.request_id!r} answers a prompt no input had"))
            continue
        problems, checked = _judge_output(model, case, want, o, oracle)
        out += problems
        decisive |= checked
    return out, decisive


def _judge_output(model, case: FuzzCase, want: Intent, o, oracle: dict) -> tuple[list[Failure], set[str]]:
    out, decisive = [], {"conventions"}
    q = want.request(o.request_id, o.prompt_ids)
    tokens = list(o.tokens)
    reason = "stop" if tokens and tokens[-1] in want.eos else "length"
    lp = o.logprobs if o.logprobs else (float("nan"),) * len(tokens)
    rollout = Rollout(q.request_id, q.prompt_ids, tuple(tokens), tuple(lp), reason)
    out += [Failure("conventions", p) for p in compare.check_conventions(q, rollout)]
    floor = want.min_new(len(o.prompt_ids))
    if want.eos and floor:
        decisive.add("min-new-tokens")
        eos = [i for i, t in enumerate(tokens) if t in want.eos]
        if eos and eos[0] < floor:
            out.append(Failure("min-new-tokens", f"{q.request_id!r}: EOS at {eos[0]} < the minimum {floor} "
                                                 f"(prompt {len(o.prompt_ids)} tokens): {tokens}"))  # fmt: skip
    n = want.no_repeat_ngram_size
    context = list(o.prompt_ids)
    for i, t in enumerate(tokens):
        banned = banned_by_ngrams(context, n)
        if banned:
            decisive.add("no-repeat-ngram")
        if t in banned:
            out.append(Failure("no-repeat-ngram", f"{q.request_id!r}: token {t} at {i} repeats a {n}-gram: "
                                                  f"prompt {list(o.prompt_ids)}, completion {tokens}"))  # fmt: skip
            break
        context.append(t)
    if not want.do_sample:
        decisive.add("tokens")
        key = tuple(o.prompt_ids)
        if key not in oracle:
            oracle[key] = greedy(model, want, o.prompt_ids)
        div = _divergence(model, want, o.prompt_ids, oracle[key], tokens)
        if div:
            out.append(Failure("tokens", f"{q.request_id!r} {div}"))
    returns_lp = bool(case.config.get("return_logprobs"))
    if not (want.do_sample or returns_lp) or not tokens:
        return out, decisive
    expected, outside = [], None
    for i, t in enumerate(tokens):
        exact = processed(model, want, o.prompt_ids, tokens[:i])
        expected.append(float(exact[t]))
        if want.do_sample:
            relaxed = processed(model, want, o.prompt_ids, tokens[:i], relax=True)
            if bool(torch.isneginf(relaxed).any()):
                decisive.add("support")
            if outside is None and torch.isneginf(relaxed[t]):
                outside = i
    if outside is not None:
        out.append(Failure("support", f"{q.request_id!r}: token {tokens[outside]} at {outside} is outside the "
                                      f"processed support ({_options(want)}): {tokens}"))  # fmt: skip
    if returns_lp:
        decisive.add("logprobs")
        if len(o.logprobs) != len(tokens):
            out.append(Failure("logprobs", f"{q.request_id!r}: {len(o.logprobs)} log-probs for {len(tokens)} tokens"))
        else:
            d = compare.logprob_diffs([rollout], [torch.tensor(expected)], [q])
            if d.max_abs > FP32.logprob_max_abs:
                at = d.worst_position
                what = (
                    f"got {o.logprobs[at]:.6g}, oracle {expected[at]:.6g} (|diff| {d.max_abs:.3g}; {_options(want)})"
                )
                out.append(Failure("logprobs", f"{q.request_id!r} position {at}: {what}"))
    return out, decisive


def _divergence(model, want: Intent, prompt, ref: list[int], got: list[int]) -> str | None:
    pos = compare.first_divergence(ref, got)
    if pos is None:
        return None
    if pos < len(ref) and pos < len(got):
        scores = processed(model, replace(want, do_sample=False), prompt, ref[:pos])
        if float(scores[ref[pos]] - scores[got[pos]]) <= FP32.near_tie_gap:
            return None
    return f"diverges at position {pos}: oracle {ref} vs engine {got} ({_options(want)})"


def _options(want: Intent) -> str:
    fields = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "min_new_tokens", "min_length",
              "no_repeat_ngram_size")  # fmt: skip
    sampled = ("temperature", "top_k", "top_p", "min_p")
    shown = [f"{k}={getattr(want, k)}" for k in fields if want.do_sample or k not in sampled]
    return ", ".join([f"do_sample={want.do_sample}", f"eos={list(want.eos)}", *shown])
