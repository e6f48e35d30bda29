"""The search: Hypothesis draws cases (:func:`cbverify.fuzz.strategies.fuzz_cases`), each is run and judged. A failure
class is a failing check together with the registered finding that covers that instance
(:data:`cbverify.fuzz.findings.FUZZ_FINDINGS`), or none: XFAIL(<finding>) when one covers it, FAIL otherwise. A
class's first failing case is then shrunk (drop steps, calls and requests, shorten prompts and completions, one
manager per call) while the same check keeps failing.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from cbverify.fuzz.case import FuzzCase
from cbverify.fuzz.findings import covering
from cbverify.fuzz.run import Pristine, run_case
from cbverify.fuzz.strategies import batch_cases, fuzz_cases


@dataclass(slots=True)
class FailureClass:
    check: str
    case: FuzzCase  # shrunk once shrink() ran
    detail: str
    examples: int = 0
    finding: str | None = None


@dataclass(slots=True)
class Report:
    engine: str
    examples: int = 0
    explored: Counter = field(default_factory=Counter)
    configs: Counter = field(default_factory=Counter)
    classes: dict[str, FailureClass] = field(default_factory=dict)
    seconds: float = 0.0
    decisive: Counter = field(default_factory=Counter)  # generate_batch: cases where a check could have failed
    failed: Counter = field(default_factory=Counter)  # ... and where it did

    @property
    def unregistered(self) -> list[FailureClass]:
        return [c for c in self.classes.values() if c.finding is None]


def explore(model, engine: str, *, model_name: str, examples: int, seed: int = 0, session_factory=None,
            engine_label: str | None = None, entry: str = "manager") -> Report:  # fmt: skip
    """Run ``examples`` drawn cases; ``engine_label`` names a wrapped engine (findings cover only the real one);
    ``entry="generate_batch"`` draws ``model.generate_batch`` programs (transformers CB only)."""
    report, pristine, start = Report(engine_label or engine), Pristine(model), time.perf_counter()
    if entry == "generate_batch" and engine != "transformers-cb":
        raise ValueError(f"--entry generate_batch is transformers CB's entry point, not {engine!r}'s")
    cases = batch_cases(model=model_name) if entry == "generate_batch" else fuzz_cases(engine=engine, model=model_name)

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(cases)
    def one(case: FuzzCase) -> None:
        pristine.restore()
        outcome = run_case(model, case, session_factory)
        report.examples += 1
        report.explored.update(outcome.features)
        report.configs.update(_config_keys(case))
        report.decisive.update(outcome.decisive)
        report.failed.update(outcome.checks & outcome.decisive)
        for f in outcome.failures:  # a class is (check, the finding that explains it or none)
            finding = covering(engine_label or engine, f.check, case)
            key = f"{f.check}:{finding.id if finding else 'unregistered'}"
            cls = report.classes.get(key)
            if cls is None:
                cls = report.classes[key] = FailureClass(f.check, case, f.detail, finding=finding and finding.id)
            cls.examples += 1

    one()
    pristine.restore()
    report.seconds = time.perf_counter() - start
    return report


def _config_keys(case: FuzzCase) -> list[str]:
    c = case.config
    names = ("scheduler_type", "allow_block_sharing", "return_logprobs", "per_request_processors",
             "enable_prefix_sharing", "max_num_seqs", "enable_prefix_caching", "enable_chunked_prefill",
             "max_num_batched_tokens")  # fmt: skip
    keys = [f"{k}={c[k]}" for k in names if k in c]
    return keys + ([f"max_batch_tokens={c.get('max_batch_tokens')}"] if "max_num_batched_tokens" not in c else [])


def still_fails(model, case: FuzzCase, check: str, pristine: Pristine, session_factory=None) -> bool:
    pristine.restore()
    try:
        return check in run_case(model, case, session_factory).checks
    finally:
        pristine.restore()


def candidates(case: FuzzCase):
    """Smaller cases, biggest cuts first."""
    steps = list(case.steps)
    if case.persistent:
        yield replace(case, persistent=False, steps=tuple(replace(s, staggered=False) for s in steps))
    for i in range(len(steps)):
        rest = steps[:i] + steps[i + 1 :]
        if any(s.kind == "call" for s in rest):
            yield case.with_steps(rest)
    for i, s in enumerate(steps):
        for j in range(len(s.requests)):
            if len(s.requests) > 1:
                yield case.with_steps(
                    steps[:i] + [replace(s, requests=s.requests[:j] + s.requests[j + 1 :])] + steps[i + 1 :]
                )
        for j, r in enumerate(s.requests):
            shorter = replace(r, max_new_tokens=max(1, r.max_new_tokens // 2))  # generate_batch: the call's limit
            for smaller in ((shorter,) if case.entry == "manager" else ()) + (
                    replace(r, prompt_ids=r.prompt_ids[: max(1, len(r.prompt_ids) // 2)]),):  # fmt: skip
                if smaller != r:
                    reqs = s.requests[:j] + (smaller,) + s.requests[j + 1 :]
                    yield case.with_steps(steps[:i] + [replace(s, requests=reqs)] + steps[i + 1 :])
    if case.caller_training:
        yield replace(case, caller_training=False)
    if case.entry == "generate_batch":
        yield from _batch_candidates(case)


def _batch_candidates(case: FuzzCase):
    """generate_batch cases: a smaller ``max_new_tokens`` per call, then every generation option unset in turn."""
    steps = list(case.steps)
    for i, s in enumerate(steps):
        if s.kind != "call":
            continue
        limit = s.options.get("max_new_tokens", case.generation_of(s).get("max_new_tokens"))
        if limit and limit > 1:
            options = {**s.options, "max_new_tokens": max(1, limit // 2)}
            reqs = tuple(replace(r, max_new_tokens=options["max_new_tokens"]) for r in s.requests)
            yield case.with_steps(steps[:i] + [replace(s, options=options, requests=reqs)] + steps[i + 1 :])
    for key in sorted(case.generation):
        if key != "max_new_tokens" or all("max_new_tokens" in s.options for s in case.calls if s.generation is None):
            yield replace(case, generation={k: v for k, v in case.generation.items() if k != key})
    for key in sorted(case.config):
        if key not in ("page_size", "num_blocks", "max_batch_tokens"):
            yield replace(case, config={k: v for k, v in case.config.items() if k != key})


def shrink(model, cls: FailureClass, *, budget: int, session_factory=None) -> FailureClass:
    """Greedy: take the first smaller candidate that still fails ``cls.check``; at most ``budget`` runs."""
    pristine, runs, case = Pristine(model), 0, cls.case
    improved = True
    while improved and runs < budget:
        improved = False
        for cand in candidates(case):
            if runs >= budget:
                break
            runs += 1
            if still_fails(model, cand, cls.check, pristine, session_factory):
                case, improved = cand, True
                break
    return replace(cls, case=case)
