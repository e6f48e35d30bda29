"""The search: Hypothesis draws cases (:func:`cbverify.fuzz.strategies.fuzz_cases`), each is run and judged. A failure
class is a failing check together with the registered finding that explains that instance
(:data:`cbverify.fuzz.findings.FUZZ_FINDINGS`, :func:`~cbverify.fuzz.findings.explaining`): XFAIL(<finding>) when a
finding covers it and predicts its detail, FAIL(not <finding>: <how it differs>) when findings cover it but none
predicts it, FAIL when none covers it; both FAILs are unregistered failures of the run. A class's first failing case
is then shrunk (drop steps, calls and requests, shorten prompts and completions, one manager per call) while the same
check keeps failing the same way.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hypothesis_seed

from cbverify.fuzz.case import FuzzCase
from cbverify.fuzz.coverage import entry_space
from cbverify.fuzz.findings import explaining
from cbverify.fuzz.run import Outcome, Pristine, run_case
from cbverify.fuzz.strategies import batch_cases, fuzz_cases
from cbverify.pairs import Coverage, Plan, concrete


@dataclass(slots=True)
class FailureClass:
    check: str
    case: FuzzCase  # shrunk once shrink() ran
    detail: str
    examples: int = 0
    finding: str | None = None
    why: str = ""  # findings cover it but none predicts it: "not <id>: <how the detail differs>; ..."

    @property
    def key(self) -> str:
        """The class: the check and the finding that explains it, or how it is unexplained (``classify``)."""
        return f"{self.check}:{self.finding or ('not-predicted' if self.why else 'unregistered')}"

    @property
    def verdict(self) -> str:
        """XFAIL(<finding>), FAIL(not <finding>: <how it differs>) or FAIL."""
        return f"XFAIL({self.finding})" if self.finding else f"FAIL({self.why})" if self.why else "FAIL"


def classify(engine: str, check: str, detail: str, case: FuzzCase) -> tuple[str, str | None, str]:
    """``(class key, finding id or None, why)`` of one failure (``engine``: the label findings are matched against)."""
    finding, why = explaining(engine, check, detail, case)
    cls = FailureClass(check, case, detail, finding=finding and finding.id, why=why)
    return cls.key, cls.finding, why


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
    coverage: Coverage | None = None  # options in pairs (cbverify.fuzz.coverage), transformers CB only

    @property
    def unregistered(self) -> list[FailureClass]:
        """The classes no registered finding explains: FAIL and FAIL(not <finding>: ...)."""
        return [c for c in self.classes.values() if c.finding is None]

    def add(self, case: FuzzCase, outcome: Outcome) -> None:
        """Count one judged case: what it exercised, and each failure in its class."""
        self.examples += 1
        self.explored.update(outcome.features)
        self.configs.update(_config_keys(case))
        self.decisive.update(outcome.decisive)
        self.failed.update(outcome.checks & outcome.decisive)
        if self.coverage is not None:
            self.coverage.add(outcome.units)
        for f in outcome.failures:
            key, finding, why = classify(self.engine, f.check, f.detail, case)
            cls = self.classes.get(key)
            if cls is None:
                cls = self.classes[key] = FailureClass(f.check, case, f.detail, finding=finding, why=why)
            cls.examples += 1


def planned_cases(
    engine: str, entry: str, *, model_name: str, examples: int, seed: int = 0, drop: tuple[tuple[str, str], ...] = ()
) -> list[FuzzCase]:
    """The cases of a run's deterministic prefix (transformers CB; none for other engines): the covering rows of the
    entry's pair space, then value rows for half of the cases left, each made concrete from the entry's strategy with
    those values forced (``cbverify.pairs.Plan``); the same for the same seed. ``drop``: pairs left out."""
    space = entry_space(engine, entry)
    if space is None:
        return []
    if entry == "generate_batch":

        def make(row):
            return batch_cases(model=model_name, force=row)
    else:

        def make(row):
            return fuzz_cases(engine=engine, model=model_name, force=row)

    rows = Plan.of(space, drop=drop).rows(examples)
    return [concrete(make(row), seed * 100_003 + k) for k, row in enumerate(rows)]


def explore(model, engine: str, *, model_name: str, examples: int, seed: int = 0, session_factory=None,
            engine_label: str | None = None, entry: str = "manager", replay: tuple[FuzzCase, ...] = (),
            drop: tuple[tuple[str, str], ...] = (), runner=None) -> Report:  # fmt: skip
    """Run ``examples`` cases; ``engine_label`` names a wrapped engine (findings cover only the real one);
    ``entry="generate_batch"`` draws ``model.generate_batch`` programs (transformers CB only). For transformers CB the
    first cases are the plan of the entry's pair space (:func:`planned_cases`: every pair of options acting on one
    quantity set together, then every option value in turn), the rest drawn freely by Hypothesis. ``replay``: cases
    found before (a campaign's shared example database), run first as Hypothesis explicit examples and counted like
    drawn ones. ``drop``: pairs left out of the plan; ``runner(model, case, session_factory) -> Outcome`` in place
    of running the case (tests)."""
    report, pristine, start = Report(engine_label or engine), Pristine(model), time.perf_counter()
    if entry == "generate_batch" and engine != "transformers-cb":
        raise ValueError(f"--entry generate_batch is transformers CB's entry point, not {engine!r}'s")
    space = entry_space(engine, entry)
    report.coverage = Coverage(space) if space is not None else None
    cases = batch_cases(model=model_name) if entry == "generate_batch" else fuzz_cases(engine=engine, model=model_name)
    planned = planned_cases(engine, entry, model_name=model_name, examples=examples, seed=seed, drop=drop)
    run = runner or run_case

    def one(case: FuzzCase) -> None:
        pristine.restore()
        report.add(case, run(model, case, session_factory))

    for case in reversed((*replay, *planned)):  # explicit examples run in the order given
        one = example(case)(one)
    free = examples - len(planned)
    phases = ([Phase.explicit] if replay or planned else []) + ([Phase.generate] if free > 0 else [])
    settings(max_examples=max(1, free), deadline=None, database=None, phases=phases,
             suppress_health_check=list(HealthCheck))(hypothesis_seed(seed)(given(cases)(one)))()  # fmt: skip
    pristine.restore()
    report.seconds = time.perf_counter() - start
    return report


def summary(report: Report, engine: str, entry: str) -> dict:
    """What ``cbverify fuzz --json`` writes: versions, what was explored, the failure classes and the decisive
    counts."""
    from cbverify.fuzz.repro import versions

    classes = [{"check": c.check, "finding": c.finding, "not": c.why or None, "examples": c.examples,
                "detail": c.detail[:300]} for c in report.classes.values()]  # fmt: skip
    return {"versions": versions(), "engine": engine, "entry": entry, "examples": report.examples,
            "seconds": round(report.seconds, 1), "explored": dict(report.explored), "classes": classes,
            "decisive": dict(report.decisive), "failed": dict(report.failed),
            "pairs": report.coverage.to_json() if report.coverage is not None else None,
            "pair_coverage": report.coverage.line() if report.coverage is not None else None}  # fmt: skip


def _config_keys(case: FuzzCase) -> list[str]:
    c = case.config
    names = ("scheduler_type", "allow_block_sharing", "return_logprobs", "per_request_processors",
             "enable_prefix_sharing", "max_num_seqs", "enable_prefix_caching", "enable_chunked_prefill",
             "max_num_batched_tokens")  # fmt: skip
    keys = [f"{k}={c[k]}" for k in names if k in c]
    return keys + ([f"max_batch_tokens={c.get('max_batch_tokens')}"] if "max_num_batched_tokens" not in c else [])


def still_fails(model, case: FuzzCase, check: str, pristine: Pristine, session_factory=None, *,
                like: FailureClass | None = None, engine: str | None = None) -> bool:  # fmt: skip
    """``check`` fails on ``case``; with ``like``, with the same verdict (the same finding explains it, or the
    failure stays unexplained), ``engine`` the label findings are matched against (the case's engine by default)."""
    pristine.restore()
    try:
        failures = [f for f in run_case(model, case, session_factory).failures if f.check == check]
    finally:
        pristine.restore()
    if like is None:
        return bool(failures)
    return any(classify(engine or case.engine, check, f.detail, case)[0] == like.key for f in failures)


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


def shrink(model, cls: FailureClass, *, budget: int, session_factory=None, engine: str | None = None) -> FailureClass:
    """Greedy: take the first smaller candidate that still fails ``cls.check`` with the same verdict (a registered
    class stays its finding's, an unexplained one unexplained); at most ``budget`` runs."""
    pristine, runs, case = Pristine(model), 0, cls.case
    improved = True
    while improved and runs < budget:
        improved = False
        for cand in candidates(case):
            if runs >= budget:
                break
            runs += 1
            if still_fails(model, cand, cls.check, pristine, session_factory, like=cls, engine=engine):
                case, improved = cand, True
                break
    return replace(cls, case=case)
