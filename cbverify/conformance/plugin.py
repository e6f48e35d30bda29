"""The pytest plugin of the conformance suite (``pytest11`` entry point ``cbverify``): options, fixtures, the report.

Options: ``--cbverify-engine NAME`` (repeatable: a built-in name, an installed ``cbverify.engines`` entry point or
``module:factory``), ``--cbverify-model`` (repeatable: bundled name or local checkpoint, float32; ``bundled`` is every
bundled checkpoint, ``reference.models.BUNDLED``), ``--cbverify-option KEY=VALUE`` (passed to every engine's factory;
the value is read as JSON when it parses; a sizing option given here is not drawn), ``--cbverify-examples N``
(Hypothesis examples per property and engine, shared by the models: each gets ``max(1, N // models)``; default: the
loaded profile's when ``HYPOTHESIS_PROFILE`` names one, else 10), ``--cbverify-report PATH`` (the Markdown table of
property x engine), ``--cbverify-outcomes PATH`` (the same outcomes as JSON, which :func:`render_report` turns into
that table: how a campaign merges runs on several nodes).

With several models each engine is one column per model, labelled ``engine@model``. An engine that declares sizing
options (``Capabilities.sizing``) is rebuilt for each drawn example with values drawn from their ranges
(``cbverify.conformance.strategies.sizings``); :func:`sized_engines` keeps the last few built.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest

STATUS = {"passed": "PASS", "failed": "FAIL", "skipped": "NOT-APPLICABLE"}


def pytest_addoption(parser) -> None:
    group = parser.getgroup("cbverify", "cbverify conformance suite")
    group.addoption("--cbverify-engine", action="append", default=[], help="engine to hold to the conformance "
                    "properties (repeatable): a built-in name, an entry point of group cbverify.engines, or "
                    "module:factory")  # fmt: skip
    group.addoption("--cbverify-model", action="append", default=[], help="bundled model name or checkpoint folder "
                    "(repeatable; 'bundled': every bundled checkpoint; default tiny-llama-arith)")  # fmt: skip
    group.addoption("--cbverify-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option for every engine's factory (JSON value when it parses)")  # fmt: skip
    group.addoption("--cbverify-examples", type=int, default=None, help="Hypothesis examples per property and "
                    "engine, shared by the models (default: the profile's named by HYPOTHESIS_PROFILE, else "
                    "10)")  # fmt: skip
    group.addoption("--cbverify-report", type=Path, default=None, help="write the property x engine table here")
    group.addoption("--cbverify-outcomes", type=Path, default=None, help="write the outcomes as JSON here")


def _env_marks(name: str) -> list:
    """An engine served from an environment of its own is marked with the environment's name (``-m vllm`` selects
    it, ``-m 'not vllm'`` leaves it out) and skipped, with the command that builds it, where that is not built."""
    from cbverify.engines import OWN_ENV_ENGINES, envs

    if name not in OWN_ENV_ENGINES:
        return []
    why = envs.problem(name)
    return [getattr(pytest.mark, name), *([pytest.mark.skip(reason=why)] if why else [])]


def pytest_configure(config) -> None:
    from cbverify.engines import OWN_ENV_ENGINES

    for env in OWN_ENV_ENGINES:
        config.addinivalue_line("markers", f"{env}: the conformance properties of the engine served from the {env} "
                                "environment (cbverify env build {env})")  # fmt: skip
    examples = config.getoption("cbverify_examples")
    if examples is None:  # the project's own Hypothesis profile, when it names one (cbverify's CI: 50 examples)
        from hypothesis import settings
        from hypothesis.errors import InvalidArgument

        try:
            examples = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "")).max_examples
        except InvalidArgument:
            examples = 10
    # the budget is per property and engine, whatever the number of models: each model gets its share
    os.environ["CBVERIFY_CONFORMANCE_EXAMPLES"] = str(max(1, examples // len(models(config))))


DEFAULT_MODEL = "tiny-llama-arith"


def models(config) -> list[str]:
    """The models of the run, in order: ``--cbverify-model`` values, ``bundled`` expanded to every bundled
    checkpoint, duplicates dropped; the default model when none is given."""
    from reference.models import BUNDLED

    given = config.getoption("cbverify_model") or [DEFAULT_MODEL]
    return list(dict.fromkeys(m for g in given for m in (BUNDLED if g == "bundled" else (g,))))


def label(engine: str, model: str, several: bool) -> str:
    """An engine's column (and test id): its name, or ``engine@model`` when the run has several models."""
    return f"{engine}@{Path(model).name}" if several else engine


def pytest_generate_tests(metafunc) -> None:
    if "engine_name" in metafunc.fixturenames:
        names, run_models = list(dict.fromkeys(metafunc.config.getoption("cbverify_engine"))), models(metafunc.config)
        with_model = "conformance_model_name" in metafunc.fixturenames
        if names:
            several = len(run_models) > 1
            targets = [(n, m) for n in names for m in (run_models if with_model else run_models[:1])]
            for n, m in targets:
                _TARGETS[label(n, m, several)] = (n, m)
            params = [pytest.param(n, m, marks=_env_marks(n), id=label(n, m, several)) for n, m in targets]
        else:
            why = "no --cbverify-engine given"
            params = [pytest.param(None, run_models[0], marks=pytest.mark.skip(reason=why), id="-")]
        if with_model:
            metafunc.parametrize(("engine_name", "conformance_model_name"), params, scope="session")
        else:
            metafunc.parametrize("engine_name", [pytest.param(*p.values[:1], marks=p.marks, id=p.id) for p in params],
                                 scope="session")  # fmt: skip


def _options(config) -> dict:
    out = {}
    for item in config.getoption("cbverify_option"):
        key, sep, value = item.partition("=")
        if not sep:
            raise pytest.UsageError(f"--cbverify-option takes KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


@pytest.fixture(scope="session")
def conformance_model_name(pytestconfig) -> str:
    """The model of the test (parametrised with the engine; the run's first model otherwise)."""
    return models(pytestconfig)[0]


@pytest.fixture(scope="session")
def conformance_model(conformance_model_name):
    from reference.models import load

    return load(conformance_model_name)[0]


@pytest.fixture(scope="session")
def conformance_options(pytestconfig) -> dict:
    """The ``--cbverify-option`` values (the engines' factory options the user fixed)."""
    return _options(pytestconfig)


class Builder:
    """``build(name, model, **sizing)``: a new engine from ``name``'s factory with ``options`` (the user's, which win
    over drawn ``sizing``: a sizing option the user gave is kept). A factory that raises ``NotApplicable`` makes the
    caller's test NOT-APPLICABLE with the engine's reason, except for drawn sizes: the engine was built at its own
    sizes first, so refusing sizes inside the ranges it declares is a FAIL. Every engine built is closed (where it
    has ``close``: an engine in a worker process) by :meth:`release` or :meth:`close`."""

    def __init__(self, options: dict) -> None:
        self.options, self.opened = options, []

    def __call__(self, name: str, model, **sizing):
        from cbverify.engines import NotApplicable, get_engine

        try:
            engine = get_engine(name, model, **{**sizing, **self.options})
        except NotApplicable as err:
            if sizing:
                pytest.fail(f"the engine refuses sizes inside the ranges it declares ({sizing}): {err.reason}")
            pytest.skip(f"the engine is not applicable here: {err.reason}")
        self.opened.append(engine)
        _DECLARED[name] = engine.capabilities.deviations
        _SIZING[name] = engine.capabilities.sizing
        return engine

    def release(self, engine) -> None:
        """Close ``engine`` now rather than when the session ends."""
        self.opened.remove(engine)
        if hasattr(engine, "close"):
            engine.close()

    def close(self) -> None:
        while self.opened:
            self.release(self.opened[-1])


SIZED_KEPT = 4  # engines built with drawn sizes kept at once (examples often draw the same tight values)


class SizedEngines:
    """``engines(name, model, sizing)``: the engine built by ``build`` with the drawn ``sizing`` (a dict of its
    declared sizing options); the last :data:`SIZED_KEPT` are kept for reuse, an older one is released."""

    def __init__(self, build: Builder) -> None:
        self.build, self.built = build, {}

    def __call__(self, name: str, model, sizing: dict):
        key = (name, id(model), tuple(sorted(sizing.items())))
        if key in self.built:
            self.built[key] = self.built.pop(key)  # most recently used last
        else:
            self.built[key] = self.build(name, model, **sizing)
            while len(self.built) > SIZED_KEPT:
                self.build.release(self.built.pop(next(iter(self.built))))
        return self.built[key]


@pytest.fixture(scope="session")
def conformance_build(pytestconfig):
    """The session's :class:`Builder` (the ``--cbverify-option`` values); its engines are closed at the end."""
    build = Builder(_options(pytestconfig))
    yield build
    build.close()


@pytest.fixture(scope="session")
def conformance_engines(conformance_build):
    """``engine(name, model)``: the engine on that model at its factory's sizes, built once per pair (a failure to
    build is each test's error, named)."""
    built: dict = {}

    def engine(name: str, model):
        if (name, id(model)) not in built:
            built[(name, id(model))] = conformance_build(name, model)
        return built[(name, id(model))]

    return engine


@pytest.fixture(scope="session")
def sized_engines(conformance_build) -> SizedEngines:
    return SizedEngines(conformance_build)


def pytest_runtest_logreport(report) -> None:
    """Each conformance property's outcome per engine, for the report (a skip at setup is NOT-APPLICABLE)."""
    if not report.location[0].endswith("test_conformance.py") or "[" not in report.nodeid:
        return
    if report.when != "call" and report.outcome == "passed":
        return
    name, _, engine = report.nodeid.split("::")[-1].partition("[")
    reason = ""
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2].removeprefix("Skipped: ")
    elif report.outcome == "failed":  # the assertion's own message (pytest's crash line), on one line
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "") or report.longreprtext
        reason = " ".join(crash.split())[:400]
    _OUTCOMES[(name, engine.removesuffix("]"))] = (STATUS.get(report.outcome, report.outcome), reason)


_OUTCOMES: dict[tuple[str, str], tuple[str, str]] = {}
_DECLARED: dict[str, tuple[str, ...]] = {}  # engine -> the deviations it declares (for the report)
_SIZING: dict[str, tuple] = {}  # engine -> the sizing options it declares (for the report)
_TARGETS: dict[str, tuple[str, str]] = {}  # column label -> (engine, model)


def pytest_sessionfinish(session) -> None:
    config = session.config
    path, outcomes_path = config.getoption("cbverify_report"), config.getoption("cbverify_outcomes")
    outcomes = [[name, engine, status, reason] for (name, engine), (status, reason) in _OUTCOMES.items()]
    declared = {engine: list(ds) for engine, ds in _DECLARED.items()}
    sizing = {engine: [[o.name, o.role, o.min, o.max] for o in options] for engine, options in _SIZING.items()}
    targets = {column: list(target) for column, target in _TARGETS.items()}
    model = ", ".join(models(config))
    if outcomes_path is not None:
        payload = {"outcomes": outcomes, "declared": declared, "versions": _versions(config), "model": model,
                   "targets": targets, "sizing": sizing}  # fmt: skip
        Path(outcomes_path).write_text(json.dumps(payload, indent=1))
    if path is not None:
        Path(path).write_text(render_report(outcomes, declared, _versions(config), model, targets, sizing))


def render_report(outcomes: list[list[str]], declared: dict[str, list[str]], versions: str, model: str,
                  targets: dict[str, list[str]] | None = None,
                  sizing: dict[str, list] | None = None) -> str:  # fmt: skip
    """The Markdown report: ``outcomes`` rows ``[property, column, status, reason]`` (properties and columns in order
    of first appearance; a column is an engine, or ``engine@model`` with its pair in ``targets``), the deviations
    and sizing options each engine declares, the details of every non-PASS and the decisiveness list."""
    targets, sizing = targets or {}, sizing or {}

    def engine_model(column: str) -> tuple[str, str]:
        return tuple(targets.get(column, (column, model)))

    by = {(name, engine): (status, reason) for name, engine, status, reason in outcomes}
    order = {column: i for i, column in enumerate(targets)}  # engine by engine, models in the order given
    engines = sorted(dict.fromkeys(engine for _, engine in by), key=lambda c: order.get(c, len(order)))
    properties = list(dict.fromkeys(name for name, _ in by))
    lines = ["# cbverify conformance report", "", versions, "",
             "| property | " + " | ".join(f"`{e}`" for e in engines) + " |",
             "|---|" + "---|" * len(engines)]  # fmt: skip
    details = []
    for prop in properties:
        cells = []
        for engine in engines:
            status, reason = by.get((prop, engine), ("-", ""))
            cells.append(status)
            if status != "PASS" and reason:
                details.append(f"- `{prop}` on `{engine}`: {status}: {reason}")
            if status == "FAIL":
                name, on = engine_model(engine)
                details.append(f"  repro: `pytest --pyargs cbverify.conformance --cbverify-engine {name} "
                               f"--cbverify-model {on} -k {prop}`")  # fmt: skip
        lines.append(f"| {prop.removeprefix('test_').replace('_', ' ')} | " + " | ".join(cells) + " |")
    from cbverify.engines import DEVIATIONS

    names = list(dict.fromkeys(engine_model(column)[0] for column in engines))
    declarations = [f"- `{engine}` declares the deviation `{d}`: {DEVIATIONS[d].description}. The properties draw "
                  "outside its domain; `declared deviations are real` holds the declaration to it."
                  for engine in names for d in declared.get(engine, ())]  # fmt: skip
    declarations += [f"- `{engine}` declares its sizing: " + ", ".join(f"`{n}` ({role}) {lo}-{hi}"
                                                                    for n, role, lo, hi in sizing[engine])
                   + ". The properties build it with values drawn from these ranges, their tight end included."
                   for engine in names if sizing.get(engine)]  # fmt: skip
    from cbverify.decisive import tally

    tallies = tally((prop, status, reason) for (prop, _), (status, reason) in by.items())
    judged = ["## Decisiveness", "", "Engines each property judged (PASS / FAIL) and could not (NOT-APPLICABLE, by "
              "capability or by the engine's own refusal). A property judged by no engine verified nothing here.", "",
              *(f"- `{t.check}`: {t.judged} judged, {sum(t.not_applicable.values())} not applicable"
                + (" **(judged by no engine)**" if t.vacuous else "") for t in tallies)]  # fmt: skip
    return "\n".join([*lines, "", *declarations, *([""] if declarations else []), *details, "", *judged, ""])


def _versions(config) -> str:
    from importlib.metadata import PackageNotFoundError, version

    import cbverify

    parts = [f"cbverify {cbverify.__version__}", f"python {platform.python_version()}"]
    for package in ("torch", "transformers"):
        try:
            parts.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            pass
    run_models = models(config)
    return ", ".join(parts) + f"; model{'s' if len(run_models) > 1 else ''} {', '.join(run_models)}"
