"""The pytest plugin of the conformance suite (``pytest11`` entry point ``cbverify``): options, fixtures, the report.

Options: ``--cbverify-engine NAME`` (repeatable: a built-in name, an installed ``cbverify.engines`` entry point or
``module:factory``), ``--cbverify-model`` (bundled name or local checkpoint, float32), ``--cbverify-option KEY=VALUE``
(passed to every engine's factory; the value is read as JSON when it parses), ``--cbverify-examples N`` (Hypothesis
examples per property; default: the loaded profile's when ``HYPOTHESIS_PROFILE`` names one, else 10),
``--cbverify-report PATH`` (the Markdown table of property x engine), ``--cbverify-outcomes PATH`` (the same outcomes
as JSON, which :func:`render_report` turns into that table: how a campaign merges runs on several nodes).
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
    group.addoption("--cbverify-model", default="tiny-llama-arith", help="bundled model name or checkpoint folder")
    group.addoption("--cbverify-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option for every engine's factory (JSON value when it parses)")  # fmt: skip
    group.addoption("--cbverify-examples", type=int, default=None, help="Hypothesis examples per property (default: "
                    "the profile's named by HYPOTHESIS_PROFILE, else 10)")  # fmt: skip
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
    os.environ["CBVERIFY_CONFORMANCE_EXAMPLES"] = str(examples)


def pytest_generate_tests(metafunc) -> None:
    if "engine_name" in metafunc.fixturenames:
        names = metafunc.config.getoption("cbverify_engine")
        if names:
            params = [pytest.param(n, marks=_env_marks(n), id=n) for n in names]
            metafunc.parametrize("engine_name", params, scope="session")
        else:
            why = "no --cbverify-engine given"
            metafunc.parametrize("engine_name", [pytest.param(None, marks=pytest.mark.skip(reason=why))], ids=["-"])


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
def conformance_model(pytestconfig):
    from reference.models import load

    return load(pytestconfig.getoption("cbverify_model"))[0]


@pytest.fixture(scope="session")
def conformance_build(pytestconfig):
    """``build(name, model)``: a new engine from ``name``'s factory with the session's options, closed (where it has
    ``close``: an engine in a worker process) when the session ends. A factory that raises ``NotApplicable`` makes
    the caller's test NOT-APPLICABLE with the engine's reason."""
    from cbverify.engines import NotApplicable, get_engine

    options, opened = _options(pytestconfig), []

    def build(name: str, model):
        try:
            engine = get_engine(name, model, **options)
        except NotApplicable as err:
            pytest.skip(f"the engine is not applicable here: {err.reason}")
        opened.append(engine)
        _DECLARED[name] = engine.capabilities.deviations
        return engine

    yield build
    for engine in opened:
        if hasattr(engine, "close"):
            engine.close()


@pytest.fixture(scope="session")
def conformance_engines(conformance_build, conformance_model):
    """Engine name -> engine on the session's model, built once (a failure to build is each test's error, named)."""
    built: dict = {}

    def engine(name: str):
        if name not in built:
            built[name] = conformance_build(name, conformance_model)
        return built[name]

    return engine


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


def pytest_sessionfinish(session) -> None:
    config = session.config
    path, outcomes_path = config.getoption("cbverify_report"), config.getoption("cbverify_outcomes")
    outcomes = [[name, engine, status, reason] for (name, engine), (status, reason) in _OUTCOMES.items()]
    declared = {engine: list(ds) for engine, ds in _DECLARED.items()}
    model = config.getoption("cbverify_model")
    if outcomes_path is not None:
        payload = {"outcomes": outcomes, "declared": declared, "versions": _versions(config), "model": model}
        Path(outcomes_path).write_text(json.dumps(payload, indent=1))
    if path is not None:
        Path(path).write_text(render_report(outcomes, declared, _versions(config), model))


def render_report(outcomes: list[list[str]], declared: dict[str, list[str]], versions: str, model: str) -> str:
    """The Markdown report: ``outcomes`` rows ``[property, engine, status, reason]`` (properties and engines in order
    of first appearance), the deviations each engine declares, the details of every non-PASS and the
    decisiveness list."""
    by = {(name, engine): (status, reason) for name, engine, status, reason in outcomes}
    engines = list(dict.fromkeys(engine for _, engine in by))
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
                details.append(f"  repro: `pytest --pyargs cbverify.conformance --cbverify-engine {engine} "
                               f"--cbverify-model {model} -k {prop}`")  # fmt: skip
        lines.append(f"| {prop.removeprefix('test_').replace('_', ' ')} | " + " | ".join(cells) + " |")
    from cbverify.engines import DEVIATIONS

    deviations = [f"- `{engine}` declares the deviation `{d}`: {DEVIATIONS[d].description}. The properties draw "
                  "outside its domain; `declared deviations are real` holds the declaration to it."
                  for engine in engines for d in declared.get(engine, ())]  # fmt: skip
    from cbverify.decisive import tally

    tallies = tally((prop, status, reason) for (prop, _), (status, reason) in by.items())
    judged = ["## Decisiveness", "", "Engines each property judged (PASS / FAIL) and could not (NOT-APPLICABLE, by "
              "capability or by the engine's own refusal). A property judged by no engine verified nothing here.", "",
              *(f"- `{t.check}`: {t.judged} judged, {sum(t.not_applicable.values())} not applicable"
                + (" **(judged by no engine)**" if t.vacuous else "") for t in tallies)]  # fmt: skip
    return "\n".join([*lines, "", *deviations, *([""] if deviations else []), *details, "", *judged, ""])


def _versions(config) -> str:
    from importlib.metadata import PackageNotFoundError, version

    import cbverify

    parts = [f"cbverify {cbverify.__version__}", f"python {platform.python_version()}"]
    for package in ("torch", "transformers"):
        try:
            parts.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            pass
    return ", ".join(parts) + f"; model {config.getoption('cbverify_model')}"
