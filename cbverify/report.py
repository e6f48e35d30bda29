"""One row per engine: run it on a workload, judge it with :mod:`cbverify.compare`, render text / Markdown / JSON.

:func:`evaluate_engine` is what ``cbverify verify`` runs per engine and what the cross-engine tests can call for a
whole-workload verdict; the checks it applies are exactly the functions the property tests use. :class:`Phases`
times each phase of it (the row's ``phase_s``), shows it on stderr as a tqdm bar and can profile it with cProfile.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import platform
import pstats
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from cbverify import compare
from cbverify.distribution import DistributionResult, distribution_test
from cbverify.engines import DEVIATIONS, Engine, NotApplicable, clock
from cbverify.tolerances import Tier
from reference.spec import Rollout, RolloutRequest


@dataclass(slots=True)
class EngineRow:
    """The verdict on one engine. ``status`` is PASS, FAIL or N/A (the engine declared the workload not applicable)."""

    engine: str
    status: str = "FAIL"
    tokens_equal: int = 0
    tokens_compared: int = 0
    near_ties: int = 0
    logprob_max_diff: float = float("nan")
    logprob_mean_diff: float = float("nan")
    logprob_max_units: float = float("nan")  # in the tier's units (Tier.unit per position); = max |dlogp| in fp32
    logprob_mean_units: float = float("nan")
    at_cut: int = 0  # positions not judged on their log-prob: at a processor cut within the tier's noise
    units_tier: bool = False  # the tier's bounds are in units of the logit scale (bf16 / fp16): shown as "= Nu"
    mismatch_kl: float = float("nan")
    ess: float = float("nan")
    distribution: str = "-"
    wall_s: float = 0.0
    completion_tokens: int = 0
    problems: list[str] = field(default_factory=list)
    divergences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the run exercised (e.g. preemptions): facts, not verdicts
    # each check's (name, PASS / FAIL / NOT-APPLICABLE, reason) on this engine: what the verdict rests on
    checks: list[tuple[str, str, str]] = field(default_factory=list)
    # wall seconds per phase (build, generate, tokens, teacher forcing, judge, distribution test), device synced
    phase_s: dict[str, float] = field(default_factory=dict)
    teacher_forced_forwards: int = 0  # model forwards the teacher forcing of this row's rollouts took
    # what the engine's declared mechanisms did to each request ({request_id: {mechanism: times}}), as it reported
    # in last_run.extra["mechanisms"]; None when it reported nothing
    mechanisms: dict[str, dict[str, int]] | None = None
    declared: list[str] = field(default_factory=list)  # the engine's Capabilities.mechanisms
    spec_sampling: bool = False  # its tokens follow the spec's noise (compared with the oracle's)
    sizing: list[dict] = field(default_factory=list)  # its Capabilities.sizing, as dicts

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else float("nan")


def evaluate_engine(
    engine: Engine,
    model,
    requests: Sequence[RolloutRequest],
    reference: Sequence[Rollout],
    tier: Tier,
    *,
    repro: str = "",
    dist_requests: Sequence[RolloutRequest] = (),
    dist_samples: int = 200,
    phases: Phases | None = None,
    label: str | None = None,
    tags: dict[str, dict[str, int]] | None = None,
) -> EngineRow:
    """Run ``engine`` on ``requests`` and judge it against the reference's rollouts ``reference`` under ``tier``.

    PASS needs: complete, ordered results; the rollout conventions; identical tokens where comparable (divergences only
    at accepted near-ties); returned log-probs within the tier of the reference's teacher-forced ones (unless the
    engine returns none); and, for own-RNG engines given ``dist_requests``, the distribution test.

    The rollouts are teacher-forced once (:func:`compare.teacher_force`: one forward per rollout) and every log-prob
    comparison reads that. ``phases`` times (and shows) each phase under ``label`` (default: the engine's name).
    A request a problem names is named with the mechanisms it exercised: ``tags`` (``{request_id: {mechanism: n}}``,
    the workload's, ``cbverify.mechanisms.workload_touches``) and those the engine reports (``row.mechanisms``).
    """
    row = EngineRow(engine.name)
    phases = phases if phases is not None else Phases()
    phase = lambda name, total=None: phases(label or engine.name, name, total, row)  # noqa: E731
    engine = _StateGuard(engine, model)
    try:
        with phase("generate", len(requests)) as advance:
            start = time.perf_counter()
            rollouts = engine.generate(requests)
            row.wall_s = time.perf_counter() - start
            advance(len(rollouts))
    except NotApplicable as err:
        row.status, row.problems = "N/A", [err.reason]
        return row
    except Exception as err:  # surfaced in the report as a FAIL with the error, never swallowed silently
        row.problems = [f"generate raised {type(err).__name__}: {err}"]
        return row
    last_run = getattr(engine.engine, "last_run", None)
    reported = getattr(last_run, "extra", {}).get("mechanisms") if last_run is not None else None
    row.mechanisms = dict(reported) if isinstance(reported, dict) else None
    caps = engine.capabilities
    row.declared, row.spec_sampling = list(caps.mechanisms), caps.spec_sampling
    row.sizing = [asdict(o) for o in caps.sizing]
    names = mechanism_tags(tags, row.mechanisms)
    said = lambda rid: f"{rid!r}" + (f" ({', '.join(names[rid])})" if names.get(rid) else "")  # noqa: E731
    row.completion_tokens = sum(len(r.completion_ids) for r in rollouts)
    row.problems = compare.check_results(requests, rollouts)
    if row.problems:
        return row
    for request, rollout in zip(requests, rollouts, strict=True):
        row.problems += compare.check_conventions(request, rollout)
    row.checks.append(("conventions", "FAIL" if row.problems else "PASS", f"{len(rollouts)} rollouts"))
    with phase("tokens", len(requests)) as advance:
        for request, ref, got in zip(requests, reference, rollouts, strict=True):
            advance(1)
            if not compare.tokens_comparable(caps, request):
                continue
            row.tokens_compared += 1
            div = compare.compare_tokens(model, request, ref, got, engine=engine.name, tier=tier, repro=repro)
            if div is None:
                row.tokens_equal += 1
            else:
                row.near_ties += div.accepted
                row.divergences.append(div.describe())
                if not div.accepted:
                    row.problems.append(f"request {said(request.request_id)}: tokens diverge at position "
                                        f"{div.position}")  # fmt: skip
    diverged = any(p.startswith("request ") and "tokens diverge" in p for p in row.problems)
    row.checks.append(("tokens", "FAIL" if diverged else "PASS", f"{row.tokens_compared} requests") if
                      row.tokens_compared else ("tokens", "NOT-APPLICABLE", "no request's tokens are fixed by the "
                                                "spec (own RNG, sampled)"))  # fmt: skip
    if caps.logprob_semantics != "none":
        with phase("teacher forcing", len(rollouts)) as advance:
            forced = compare.teacher_force(model, requests, rollouts, caps.logprob_semantics, tier, progress=advance,
                                           deviations=caps.deviations)  # fmt: skip
        for deviation in sorted(set(forced.deviated.values())):
            n = sum(d == deviation for d in forced.deviated.values())
            row.notes.append(f"declared deviation {deviation}: {n} request(s) judged in the engine's own processing "
                             f"({DEVIATIONS[deviation].description})")  # fmt: skip
        row.teacher_forced_forwards = forced.forwards
        with phase("judge"):
            diff = compare.judge_logprobs(model, requests, rollouts, caps.logprob_semantics, tier, forced=forced)
            metrics = compare.mismatch(model, requests, rollouts, forced=forced)
        row.logprob_max_diff, row.logprob_mean_diff = diff.max_abs, diff.mean_abs
        row.logprob_max_units, row.logprob_mean_units, row.at_cut = (
            diff.max_units,
            diff.mean_units,
            diff.skipped_at_cut,
        )
        row.units_tier = tier.ulp > 0
        units = "" if tier.ulp == 0 else f" = {diff.max_units:.3g} units (mean {diff.mean_units:.3g})"
        row.checks.append(("logprobs", "PASS" if diff.within(tier) else "FAIL", f"max {diff.max_abs:.3g}"))
        if not diff.within(tier):
            row.problems.append(
                f"log-probs off: max {diff.max_abs:.3g}{units} (at {said(diff.worst_request)} position "
                f"{diff.worst_position}), mean {diff.mean_abs:.3g}; tier {tier.name} allows "
                f"{tier.logprob_max_abs:g}/{tier.logprob_mean_abs:g}" + (" units" if tier.ulp else "")
            )
        row.mismatch_kl, row.ess = metrics["mismatch_kl"], metrics["ess"]
    if dist_requests and not caps.spec_sampling:
        with phase("distribution test"):
            result: DistributionResult = distribution_test(engine, model, dist_requests, num_samples=dist_samples,
                                                         tier=tier)  # fmt: skip
        row.distribution = f"{len(result.tests) - len(result.rejected)}/{len(result.tests)} ok"
        row.notes.append(f"distribution test: {result.power()}")
        if not result.passed:
            row.problems.append("sampling distribution: " + result.describe())
        row.checks.append(("distribution", "PASS" if result.passed else "FAIL", f"{len(result.tests)} node tests")
                          if result.tests else ("distribution", "NOT-APPLICABLE", "no prefix was seen often enough "
                                                "for a chi-square test: too few samples for any power"))  # fmt: skip
    row.problems += [f"model state changed by the engine: {c} (put back for judging)" for c in engine.changes]
    row.checks.append(("model state", "FAIL" if engine.changes else "PASS", ", ".join(engine.changes) or "unchanged"))
    row.status = "PASS" if not row.problems else "FAIL"
    return row


def mechanism_tags(*touched: dict[str, dict[str, int]] | None) -> dict[str, list[str]]:
    """``{request_id: [mechanism, ...]}`` merged over ``{request_id: {mechanism: times}}`` maps."""
    out: dict[str, list[str]] = {}
    for t in touched:
        for rid, events in (t or {}).items():
            out.setdefault(rid, []).extend(m for m in events if m not in out[rid])
    return out


class Phases:
    """Wall seconds per (engine, phase) of a run; the phases that can take long (:attr:`BARS`) shown on stderr as a
    tqdm bar while they run, once they have run :attr:`DELAY` seconds.

    ``phases(engine, name, total, row)`` is a context manager yielding the bar's ``update`` (call it with the units
    done); on exit the seconds (device synced, :func:`cbverify.engines.clock`) are added to ``seconds[(engine, name)]``
    and to ``row.phase_s[name]`` when a row is given. ``progress=False`` (``--quiet``, the library default) shows
    nothing; ``profile_dir`` also runs each phase under cProfile and writes ``<n>-<engine>-<phase>.prof`` there plus
    ``summary.txt`` (each phase's top functions by own and by cumulative time). Nothing is ever written to stdout.
    """

    BARS = ("generate", "teacher forcing", "distribution test")  # the phases that can take long: a bar each
    ORDER = ("build", "generate", "tokens", "teacher forcing", "judge", "distribution test")  # the table's columns

    DELAY = 0.2  # seconds a phase runs before its bar appears: the many short phases of a small run stay quiet

    def __init__(self, *, progress: bool = False, profile_dir: Path | None = None, device: str = "cpu") -> None:
        self.progress, self.profile_dir, self.device = progress, profile_dir, device
        self.seconds: dict[tuple[str, str], float] = {}
        self._profiled = 0

    @contextlib.contextmanager
    def __call__(
        self, engine: str, name: str, total: int | None = None, row: EngineRow | None = None
    ) -> Iterator[Callable[[int], object]]:
        shown = self.progress and name in self.BARS
        bar = tqdm(total=total, desc=f"{engine}: {name}", disable=not shown, file=sys.stderr, leave=True,
                   dynamic_ncols=True, delay=self.DELAY)  # fmt: skip
        profiler = cProfile.Profile() if self.profile_dir is not None else None
        start = clock(self.device)
        if profiler is not None:
            profiler.enable()
        try:
            yield bar.update
        finally:
            if profiler is not None:
                profiler.disable()
            seconds = clock(self.device) - start
            bar.close()
            self.seconds[(engine, name)] = self.seconds.get((engine, name), 0.0) + seconds
            if row is not None:
                row.phase_s[name] = row.phase_s.get(name, 0.0) + seconds
            if profiler is not None:
                self._dump(profiler, engine, name, seconds)

    def note(self, line: str) -> None:
        """One line on stderr (above any bar), unless progress is off."""
        if self.progress:
            tqdm.write(line, file=sys.stderr)

    def _dump(self, profiler: cProfile.Profile, engine: str, name: str, seconds: float) -> None:
        self._profiled += 1
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{self._profiled:02d}-{engine}-{name}")
        profiler.dump_stats(self.profile_dir / f"{stem}.prof")
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        for key in ("tottime", "cumulative"):
            stats.sort_stats(key).print_stats(15)
        with (self.profile_dir / "summary.txt").open("a") as out:
            out.write(f"===== {engine}: {name}: {seconds:.3f} s ({stem}.prof) =====\n{text.getvalue()}\n")

    def table(self) -> str:
        """Seconds per engine (rows) and phase (columns), in the order they ran, with each engine's total."""
        engines = list(dict.fromkeys(e for e, _ in self.seconds))
        seen = list(dict.fromkeys(n for _, n in self.seconds))
        names = [n for n in self.ORDER if n in seen] + [n for n in seen if n not in self.ORDER]
        head = ["engine", *names, "total"]
        lines = [head]
        for e in engines:
            cells = [self.seconds.get((e, n)) for n in names]
            lines.append([e, *("-" if c is None else f"{c:.2f}" for c in cells), f"{sum(c or 0 for c in cells):.2f}"])
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


class _StateGuard:
    """``engine`` whose every ``generate`` call must leave the caller's model as it found it (attention
    implementation, train / eval mode). A change is recorded and undone at once, so the oracle's teacher forcing and
    the engines judged later see the caller's model (transformers 5.8 leaves its paged attention installed)."""

    def __init__(self, engine, model) -> None:
        self.engine, self.model, self.changes = engine, model, []
        self.name, self.capabilities = engine.name, engine.capabilities

    def _state(self) -> dict:
        return {"attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                "training": self.model.training}  # fmt: skip

    def generate(self, requests):
        before = self._state()
        try:
            return self.engine.generate(requests)
        finally:
            after = self._state()
            for key in (k for k in before if before[k] != after[k]):
                change = f"{key} {before[key]!r} -> {after[key]!r}"
                self.changes += [change] if change not in self.changes else []
            if after["attn_implementation"] != before["attn_implementation"]:
                self.model.set_attn_implementation(before["attn_implementation"])
            self.model.train(before["training"])


def environment(device: str, dtype: str, model_name: str, tier: Tier) -> dict[str, str]:
    """The versions and setup printed at the top of every report."""
    import transformers
    import trl

    import cbverify

    return {
        "cbverify": cbverify.__version__, "model": model_name, "device": device, "dtype": dtype, "tier": tier.name,
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
        "python": platform.python_version(),
        # the kernels torch dispatches to (ATEN_CPU_CAPABILITY chooses others): a verdict must not depend on them
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
    }  # fmt: skip


COLUMNS = ("engine", "verdict", "tokens equal", "near ties", "max |dlogp|", "mean |dlogp|", "mismatch KL", "ESS",
           "distribution", "wall s", "tok/s")  # fmt: skip


def _cells(row: EngineRow) -> list[str]:
    f = lambda x, spec: "-" if x != x else format(x, spec)  # noqa: E731  (NaN -> "-")
    equal = f"{row.tokens_equal}/{row.tokens_compared}" if row.tokens_compared else "-"
    units = (
        f" = {row.logprob_max_units:.2g}u" if row.units_tier and row.logprob_max_units == row.logprob_max_units else ""
    )
    return [row.engine, row.status, equal, str(row.near_ties), f(row.logprob_max_diff, ".2e") + units,
            f(row.logprob_mean_diff, ".2e"), f(row.mismatch_kl, ".2e"), f(row.ess, ".4f"), row.distribution,
            f(row.wall_s, ".2f"), f(row.tokens_per_s, ".0f")]  # fmt: skip


def render_text(env: dict[str, str], rows: Sequence[EngineRow], *, color: bool) -> str:
    """A fixed-width table, then every problem and divergence; verdicts coloured only when ``color``."""
    table = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    paint = {"PASS": "\033[32m", "FAIL": "\033[31m", "N/A": "\033[33m"}
    out = ["  ".join(f"{k}={v}" for k, v in env.items()), ""]
    for n, line in enumerate(table):
        cells = [c.ljust(w) for c, w in zip(line, widths, strict=True)]
        if color and n > 0:
            cells[1] = paint.get(line[1], "") + cells[1] + "\033[0m"
        out.append("  ".join(cells).rstrip())
    for row in rows:
        out += [f"\n[{row.engine}] {item}" for item in row.problems]
        out += [f"\n[{row.engine}] note: {item}" for item in row.notes]
        if row.at_cut:
            out.append(
                f"\n[{row.engine}] {row.at_cut} position(s) at a sampling-processor cut within the tier's noise: "
                "log-probs there not judged (the two sides renormalise over different kept sets)"
            )
        out += [f"\n{item}" for item in row.divergences]  # Divergence.describe() names the engine itself
    return "\n".join(out)


def render_markdown(env: dict[str, str], rows: Sequence[EngineRow]) -> str:
    head = " · ".join(f"**{k}** {v}" for k, v in env.items())
    lines = [head, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    details = [f"- `{r.engine}`: {item}" for r in rows for item in r.problems + r.notes + r.divergences]
    return "\n".join(lines + ([""] + details if details else [])) + "\n"


def to_json(env: dict[str, str], rows: Sequence[EngineRow], timing: dict | None = None,
            mechanisms: Sequence | None = None) -> str:  # fmt: skip
    """``{"environment", "engines"}`` (each row with its ``phase_s``), and ``timing`` (the run's estimate and
    measured seconds per phase) and ``mechanisms`` (:class:`cbverify.mechanisms.Reach` rows) when given."""

    def clean(row: EngineRow) -> dict:
        d = asdict(row) | {"tokens_per_s": row.tokens_per_s}
        return {k: (None if isinstance(v, float) and v != v else v) for k, v in d.items()}

    out = {"environment": env, "engines": [clean(r) for r in rows]}
    out |= {"timing": timing} if timing is not None else {}
    out |= {"mechanisms": [asdict(m) for m in mechanisms]} if mechanisms is not None else {}
    return json.dumps(out, indent=2)
