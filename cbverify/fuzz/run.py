"""Running one fuzz case end to end: a fresh copy of the weights, the program of calls / trainings / weight updates
through a :class:`~cbverify.fuzz.drivers.Session`, every call judged against the oracle *at the weights it ran
with*, and the model state judged at the end. Also what the case exercised (for the histogram)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz.batch_driver import BatchSession
from cbverify.fuzz.batch_judge import intent, judge_batch_call
from cbverify.fuzz.case import FuzzCase
from cbverify.fuzz.coverage import batch_units, manager_units
from cbverify.fuzz.drivers import PLAIN_CHECK, Session, snapshot
from cbverify.fuzz.judge import STATE_CHECKS, Failure, judge_call, judge_state


@dataclass(slots=True)
class Outcome:
    failures: list[Failure] = field(default_factory=list)
    features: set[str] = field(default_factory=set)
    decisive: set[str] = field(default_factory=set)  # generate_batch: the checks that could have failed here
    units: list[set[str]] = field(default_factory=list)  # option values as the calls resolved them (coverage.py)

    @property
    def checks(self) -> set[str]:
        return {f.check for f in self.failures}


def features(case: FuzzCase) -> set[str]:
    """What the case is built to exercise (evictions are counted while it runs)."""
    c, out = case.config, {case.call_pattern()}
    if case.entry == "generate_batch":
        out |= batch_features(case)
    budget = c.get("max_batch_tokens") or (c.get("enable_chunked_prefill") and c.get("max_num_batched_tokens"))
    page = c.get("page_size") or c.get("block_size")
    if budget and any(len(r.prompt_ids) > budget for r in case.requests):
        out.add("chunked-prefill")
    if page and any(len(r.prompt_ids) > page for r in case.requests):
        out.add("prompt>page")
    prompts = [r.prompt_ids for s in case.calls for r in s.requests]
    shared = page and any(prompts.count(p) > 1 and len(p) >= page for p in prompts)
    if shared and (c.get("allow_block_sharing") or c.get("enable_prefix_sharing") or c.get("enable_prefix_caching")):
        out.add("shared-blocks")
    if any(s.staggered for s in case.calls):
        out.add("added-while-running")
    out.add("sampled" if any(g.get("do_sample") for g in case.generations()) else "greedy")
    for key in ("min_new_tokens", "repetition_penalty"):
        if case.generation.get(key) not in (None, 0, 1.0):
            out.add(key)
    if any(r.top_k == 0 for r in case.requests) and case.generation.get("do_sample"):
        out.add("per-request-top_k=0")
    return out


class Pristine:
    """The model's weights and mode as loaded, restored before every case (cases train and update weights)."""

    def __init__(self, model) -> None:
        self.model = model
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.training = model.training
        self.attn = model.config._attn_implementation

    def restore(self) -> None:
        self.model.load_state_dict(self.state)
        self.model.train(self.training)
        if self.model.config._attn_implementation != self.attn:
            self.model.set_attn_implementation(self.attn)


@contextmanager
def _oracle_view(model, attn: str):
    """The oracle judges with the caller's attention implementation even where the engine left another installed
    (transformers 5.8 leaves its paged attention: judged once, as ``state:attn-implementation``); the engine's choice
    is put back afterwards, so its next call runs on the model as it left it."""
    left = model.config._attn_implementation
    if left != attn:
        model.set_attn_implementation(attn)
    try:
        yield
    finally:
        if model.config._attn_implementation != left:
            model.set_attn_implementation(left)


def run_case(model, case: FuzzCase, session_factory=None) -> Outcome:
    """Run ``case`` on ``model`` (restored by the caller) and judge it (``session_factory``: the entry's session)."""
    outcome = Outcome(features=features(case))
    model.train(case.caller_training)
    if case.caller_attn is not None and model.config._attn_implementation != case.caller_attn:
        model.set_attn_implementation(case.caller_attn)  # the caller's choice (Pristine.restore puts it back)
    torch.rand(1)  # the caller's RNG is mid-stream: a state fresh from manual_seed(s) would hide a reseed with s
    before = snapshot(model)
    batch = case.entry == "generate_batch"
    session = (session_factory or (BatchSession if batch else Session))(model=model, case=case)
    wants, ran = [], 0
    try:
        session.open()
        for step in case.steps:
            if step.kind == "call":
                result = session.call(step)
                ran += 1
                if result.evictions:
                    outcome.features.add("evicted")
                with _oracle_view(model, before["attn_implementation"]):
                    if batch:
                        want = intent(case.generation_of(step), step.options, before["generation_config"],
                                      compat.generation_defaults())  # fmt: skip
                        wants.append(want)
                        failures, decisive = judge_batch_call(model, case, step, result, want)
                        outcome.failures += failures
                        outcome.decisive |= decisive
                    else:
                        outcome.failures += judge_call(model, case, step, result)
            elif step.kind == "train":
                session.train_step(step.seed, *([step.paused] if batch else []))
            else:
                session.update_weights(step.seed, *([step.paused] if batch else []))
    except Exception as err:  # noqa: BLE001 - a crash outside a call (opening, training while paused)
        outcome.failures.append(Failure("engine-crash", f"{type(err).__name__}: {err}"[:300]))
    finally:
        session.close()
    if (plain := getattr(session, "plain", None)) is not None:  # the caller's plain forwards (drivers.PlainForwards)
        outcome.failures += plain.failures
        outcome.decisive |= {PLAIN_CHECK} if plain.probes else set()
    outcome.failures += judge_state(before, model, session)
    if case.engine == "transformers-cb":  # the options the calls that ran resolved to (a crash ends the program)
        outcome.units = batch_units(case, wants, ran=len(wants)) if batch else manager_units(case, ran)
    if batch:
        outcome.decisive |= {c for c in STATE_CHECKS if c != "state:training-mode" or case.caller_training}
    return outcome


def batch_features(case: FuzzCase) -> set[str]:
    """What a generate_batch case exercises: the options its calls ask for, its keyword arguments, its program."""
    from reference import tasks

    out = set()
    for g in case.generations():
        eos = g.get("eos_token_id", "unset")
        out.add("eos-unset" if eos == "unset" else "no-eos" if eos == [] else "eos-list" if isinstance(eos, list)
                else "eos-int")  # fmt: skip
        if (g.get("num_return_sequences") or 1) > 1:
            out.add("num_return_sequences>1")
        for key in ("min_length", "no_repeat_ngram_size", "min_p", "top_p", "temperature"):
            if g.get(key) is not None:
                out.add(key)
        k = g.get("top_k")
        out.add("top_k-unset" if k is None else "top_k=0" if k == 0 else "top_k>=vocab" if k >= tasks.VOCAB_SIZE
                else "top_k<vocab")  # fmt: skip
    for s in case.calls:
        out |= {f"kwarg:{k}" for k in s.options}
    for s in case.steps:
        if s.kind != "call":
            out.add(f"{s.kind}{'-in-pause' if s.paused else '-beside-idle-manager'}")
    seen: list[tuple[int, ...]] = []
    page = case.config.get("page_size") or 1
    for s in case.calls:
        prompts = [r.prompt_ids for r in s.requests]
        if any(p[:page] == q[:page] and min(len(p), len(q)) >= page for p in prompts for q in seen):
            out.add("prompt-prefix-from-an-earlier-call")
        seen += prompts
    return out
