"""The conformance suite: the cross-engine properties as a pytest plugin any engine's own CI can run.

    pytest --pyargs cbverify.conformance --cbverify-engine mypkg.rollouts:make_engine [--cbverify-model PATH]
        [--cbverify-option key=value ...] [--cbverify-report conformance.md]

``plugin`` (registered with pytest's ``pytest11`` entry point, so it loads wherever cbverify is installed) adds the
options and the fixtures; ``test_conformance`` holds the properties, each parametrised by the engines given and
skipped, with the capability named, where the engine does not claim what the property checks; ``strategies`` draws
the requests. ``--cbverify-report`` writes the property x engine table (PASS / FAIL / NOT-APPLICABLE and why, the
versions, the command that reproduces a failure). The engine protocol is docs/engines.md.
"""

from pathlib import Path


def suite_argv(tmp: Path, model: str, examples: int, engines: list[str], options: list[str], keyword: str | None,
               report: Path) -> list[str]:  # fmt: skip
    """pytest's arguments for a run of the suite kept apart from the pytest configuration of the directory it is
    started in (a bare ``pytest.ini`` written in ``tmp``), its report written to ``report``."""
    ini = tmp / "pytest.ini"
    ini.write_text("[pytest]\n")  # none of the current directory's addopts, markers or conftest files
    argv = ["-q", "-c", str(ini), "--rootdir", str(tmp), "--confcutdir", str(Path(__file__).parent), "-p",
            "no:cacheprovider", "--pyargs", "cbverify.conformance", "--cbverify-model", model, "--cbverify-examples",
            str(examples), "--cbverify-report", str(report)]  # fmt: skip
    for engine in engines:
        argv += ["--cbverify-engine", engine]
    for option in options:
        argv += ["--cbverify-option", option]
    return argv + (["-k", keyword] if keyword else [])
