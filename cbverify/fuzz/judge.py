"""Judging one call of a fuzz case, with the suite's own comparisons (:mod:`cbverify.compare`) and the fp32 tier.

Each problem is a :class:`Failure` named by its check; the checks (the failure classes) are :data:`CHECKS`.
The oracle is ``reference`` (``reference.processors_extra`` for repetition penalty and ``min_new_tokens``): tokens
of greedy requests (and of sampled ones for engines that follow the sampling spec) must equal the oracle's except at
a near-tie; returned log-probs must match the oracle's teacher forcing of the engine's own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbverify import compare
from cbverify.fuzz.case import FuzzCase, Step
from cbverify.fuzz.drivers import CallResult, snapshot
from cbverify.tolerances import FP32
from reference import processors_extra as px
from reference.spec import Rollout

CHECKS = (
    "engine-crash", "lost-request", "duplicate-result", "foreign-result", "request-failed", "results-order",
    "conventions", "min-new-tokens", "tokens", "logprobs", "state:training-mode", "state:attn-implementation",
    "state:dtypes", "state:global-rng", "state:generation-config", "plain-forward",
)  # fmt: skip
STATE_CHECKS = tuple(c for c in CHECKS if c.startswith("state:"))
# plain-forward (transformers CB, cbverify.fuzz.drivers.PlainForwards): after each call and inside each step between
# calls the caller's own forward (loss, per-token log-probs, train/eval mode, attention implementation) equals a twin's
# that never had a manager
SPEC_ENGINES = ("cb_impl",)  # engines whose sampled tokens must equal the oracle's


@dataclass(frozen=True, slots=True)
class Failure:
    check: str
    detail: str


def extras(case: FuzzCase) -> dict:
    g = case.generation
    return dict(repetition_penalty=float(g.get("repetition_penalty") or 1.0),
                min_new_tokens=int(g.get("min_new_tokens") or 0))  # fmt: skip


def returns_logprobs(case: FuzzCase) -> bool:
    return case.engine in ("cb_impl", "vllm") or bool(case.config.get("return_logprobs"))


def judge_call(model, case: FuzzCase, step: Step, result: CallResult) -> list[Failure]:
    out: list[Failure] = []
    if result.crash:
        out.append(Failure("engine-crash", result.crash[:300]))
    ids = [r.request_id for r in step.requests]
    seen = [o.request_id for o in result.raw]
    for rid in ids:
        if rid not in seen and not result.crash:
            out.append(Failure("lost-request", f"{rid!r} never came back ({len(seen)}/{len(ids)} results)"))
        elif seen.count(rid) > 1:
            out.append(Failure("duplicate-result", f"{rid!r} came back {seen.count(rid)} times"))
    for rid in sorted(set(seen) - set(ids)):
        out.append(Failure("foreign-result", f"a result for {rid!r}, which this call did not ask for"))
    for o in result.raw:
        if o.error is not None:
            out.append(Failure("request-failed", f"{o.request_id!r}: {o.error}"[:300]))
    requests = [r.rollout_request(case.generation, case.per_request) for r in step.requests]
    pairs = [(q, o) for q, o in zip(requests, result.ordered, strict=True) if o is not None and o.error is None]
    rollouts = [_rollout(q, o) for q, o in pairs]
    present = [q for q, _ in pairs]
    order = compare.check_results(present, rollouts)
    out += [Failure("results-order", p) for p in order]
    if order:
        return out
    ex = extras(case)
    for q, r in zip(present, rollouts, strict=True):
        out += [Failure("conventions", p) for p in compare.check_conventions(q, r)]
        eos = [i for i, t in enumerate(r.completion_ids) if t in q.eos_token_ids]
        if eos and eos[0] < ex["min_new_tokens"]:
            out.append(
                Failure("min-new-tokens", f"{q.request_id!r}: EOS at {eos[0]} < min_new_tokens {ex['min_new_tokens']}")
            )
        if q.sampling.greedy or case.engine in SPEC_ENGINES:
            ref = px.generate_one(model, q, **ex)
            div = _divergence(model, q, ref, r, case, ex)
            if div:
                out.append(Failure("tokens", div))
        if returns_logprobs(case) and r.completion_ids:
            if len(r.logprobs) != len(r.completion_ids):
                out.append(
                    Failure(
                        "logprobs", f"{q.request_id!r}: {len(r.logprobs)} log-probs for {len(r.completion_ids)} tokens"
                    )
                )
                continue
            expected = px.teacher_forced(model, q, r.completion_ids, **ex)
            d = compare.logprob_diffs([r], [expected], [q])
            if d.max_abs > FP32.logprob_max_abs:
                where = f"position {d.worst_position}: got {r.logprobs[d.worst_position]:.6g}"
                want = f"oracle {float(expected[d.worst_position]):.6g}"
                out.append(Failure("logprobs", f"{q.request_id!r} {where}, {want} (|diff| {d.max_abs:.3g})"))
    return out


def _rollout(request, o) -> Rollout:
    tokens = list(o.tokens)
    reason = "stop" if tokens and tokens[-1] in request.eos_token_ids else "length"
    lp = o.logprobs if o.logprobs else (float("nan"),) * len(tokens)
    return Rollout(request.request_id, request.prompt_ids, tuple(tokens), tuple(lp), reason)


def _divergence(model, q, ref: Rollout, got: Rollout, case: FuzzCase, ex: dict) -> str | None:
    if ex["repetition_penalty"] == 1.0 and ex["min_new_tokens"] == 0:
        d = compare.compare_tokens(model, q, ref, got, engine=case.engine, tier=FP32)
        return None if d is None or d.accepted else d.describe().splitlines()[0]
    pos = compare.first_divergence(ref.completion_ids, got.completion_ids)
    if pos is None:
        return None
    a = ref.completion_ids[pos] if pos < len(ref.completion_ids) else None
    b = got.completion_ids[pos] if pos < len(got.completion_ids) else None
    if a is not None and b is not None:
        from reference.generate import next_token_logits

        scores = px.process_logits_extra(next_token_logits(model, [*q.prompt_ids, *ref.completion_ids[:pos]]), q,
                                         ref.completion_ids[:pos], **ex)  # fmt: skip
        if float(scores[a] - scores[b]) <= FP32.near_tie_gap:
            return None
    both = f"oracle {ref.completion_ids} vs engine {got.completion_ids}"
    return f"{q.request_id!r} diverges at position {pos}: {both} ({ex})"


def judge_state(before: dict, model, session) -> list[Failure]:
    """The caller's model and GenerationConfig as found before the engine was built."""
    after, out = snapshot(model), []
    for key in ("training", "attn_implementation", "dtypes"):
        if before[key] != after[key]:
            name = {"training": "training-mode", "attn_implementation": "attn-implementation"}.get(key, key)
            out.append(Failure(f"state:{name}", f"{key} {before[key]!r} before, {after[key]!r} after"))
    if not torch.equal(before["global_rng"], after["global_rng"]):
        out.append(Failure("state:global-rng", "torch's global RNG state changed"))
    if before["generation_config"] != after["generation_config"]:
        out.append(Failure("state:generation-config", "model.generation_config changed"))
    passed = getattr(session, "passed_configs", None)
    if passed is None:  # the manager session: the one config it built its managers with
        config = getattr(session, "generation_config", None)
        passed = [] if config is None else [(config, session.generation_config_before)]
    for config, contents in passed:
        if config.to_dict() != contents:
            changed = {k: (contents.get(k), v) for k, v in config.to_dict().items() if contents.get(k) != v}
            out.append(Failure("state:generation-config", f"the GenerationConfig passed in changed: {changed}"))
            break
    return out
