"""``cbverify upstream``: the findings registry, and (with ``--run``) every upstream invariant on the installed stack.

Without flags it prints :data:`cbverify.upstream.findings.FINDINGS` (id, path, checks, condition, affected versions,
evidence). ``--run`` drives TRL's trainers through :data:`cbverify.upstream.suite.DEFAULT_SCENARIOS` with a progress
bar and prints one line per (scenario, check): PASS / NOT-APPLICABLE / XFAIL(<finding>) are fine; FAIL (not covered by
a finding) and FIXED?(<finding>) (a finding that stopped reproducing) make the exit code 1. ``--json`` writes the
results for ``cbverify matrix``.

``--path vllm`` runs :data:`cbverify.upstream.suite.VLLM_SCENARIOS` (TRL's colocated vLLM). vLLM's pins conflict with
ours, so from the main venv the command re-runs itself with the ``vllm`` environment's python
(``cbverify.engines.envs``); a missing environment is NOT-APPLICABLE with the command that builds it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from cbverify.cli import integer


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", action="store_true", help="run the upstream checks (default: only list findings)")
    parser.add_argument("--model", default="tiny-llama-arith", help="bundled model name or local checkpoint path")
    parser.add_argument(
        "--random-model",
        action="store_true",
        help="--model's architecture and tokenizer with seeded random weights instead of its trained ones",
    )
    parser.add_argument(
        "--path",
        choices=("generate", "cb", "rollout_func", "vllm"),
        help="only scenarios on this path; vllm: TRL's colocated vLLM, one scenario per importance-sampling mode, "
        "run in the vllm environment (cbverify env build vllm)",
    )
    parser.add_argument(
        "--nproc",
        type=integer(1, 64),
        default=1,
        help="data-parallel CPU processes (torch.distributed, gloo): >1 runs the multi-process scenarios, each also "
        "on one process for comparison (cbverify.upstream.distributed)",
    )
    parser.add_argument(
        "--launcher",
        choices=("torchrun", "accelerate"),
        default="torchrun",
        help="with --nproc: torch's launcher, or `accelerate launch --cpu --num_processes N` as typed by a user",
    )
    parser.add_argument("--json", type=Path, help="write the results (and versions) to this JSON file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, print only the summary table")


def findings_table() -> str:
    from cbverify.upstream.env_findings import ENV_FINDINGS
    from cbverify.upstream.findings import FINDINGS

    lines = [f"{len(FINDINGS)} upstream findings (each asserted to still reproduce by the upstream tests):", ""]
    for f in FINDINGS:
        lines.append(f"[{f.id}]  path={f.path}  when: {f.when}")
        lines.append(f"    checks:   {', '.join(f.checks)}")
        lines.append(f"    affected: {f.affected}")
        lines += textwrap.wrap(f.evidence, 116, initial_indent="    evidence: ", subsequent_indent="              ")
        lines.append("")
    lines += [f"{len(ENV_FINDINGS)} in engine environments (each script asserted to reproduce by make test-vllm):", ""]
    for f in ENV_FINDINGS:
        lines.append(f"[{f.id}]  environment={f.env}  script: cbverify/upstream/repros/{f.script}")
        lines.append(f"    affected: {f.affected}")
        lines += textwrap.wrap(f.evidence, 116, initial_indent="    evidence: ", subsequent_indent="              ")
        lines.append("")
    return "\n".join(lines)


def load_model(args: argparse.Namespace):
    """``(model, tokenizer)``: the checkpoint, or with ``--random-model`` its architecture with random weights."""
    from reference.models import load, random_like

    return random_like(args.model, seed=0) if args.random_model else load(args.model)


def results_payload(rows, elapsed: float, model_name: str, model_type: str, facts: dict | None = None) -> dict:
    """The run as JSON: versions, one entry per (scenario, check) with its judged label, what each scenario exercised
    (``facts``), and the decisiveness of every check (:mod:`cbverify.decisive`)."""
    from cbverify.upstream import checks
    from cbverify.upstream.run import versions
    from cbverify.upstream.suite import judge, release_lacks

    out = []
    for scenario, result in rows:
        ok, label = (
            judge(result, scenario, model_type) if scenario is not None else (result.status != "FAIL", result.status)
        )
        out.append({"check": result.check, "path": result.path, "status": result.status, "label": label, "ok": ok,
                    "scenario": result.scenario, "reason": result.reason})  # fmt: skip
    tallies = decisiveness(out)
    lacking = {t.check: why for t in tallies if t.vacuous and (why := release_lacks(t.check))}
    by_label = {scenario.describe(): scenario for scenario, _ in rows if scenario is not None}
    unexercised = {label: why for label, f in (facts or {}).items() if (why := checks.unexercised(by_label[label], f))}
    import torch

    return {"versions": versions(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "model": model_name,
            "elapsed_s": round(elapsed, 1), "results": out,
            "exercised": facts or {}, "unexercised": unexercised, "decisiveness": [t.to_json() for t in tallies],
            "vacuous": [t.check for t in tallies if t.vacuous and t.check not in lacking],
            "release_lacks": lacking}  # fmt: skip


def decisiveness(results: list[dict]) -> list:
    """Per check, the scenarios it judged and could not (:func:`cbverify.decisive.tally`). A NOT-APPLICABLE that
    names another check (``(see run_completes)``) which is an expected failure in the same scenario is BLOCKED by
    that finding: the check had nothing to judge because the registered upstream failure came first."""
    import re

    from cbverify.decisive import tally

    labels = {(r["scenario"], r["check"]): r["label"] for r in results}
    triples = []
    for r in results:
        status, reason = r["status"], r["reason"]
        seen = re.search(r"\(see (\w+)\)", reason)
        cause = labels.get((r["scenario"], seen.group(1)), "") if seen and status == "NOT-APPLICABLE" else ""
        if cause.startswith("XFAIL("):
            status, reason = "BLOCKED", cause[len("XFAIL(") : -1]
        triples.append((r["check"], status, reason))
    return tally(triples)


def summary_table(payload: dict) -> str:
    from cbverify.decisive import Tally, render

    lines = [" ".join(f"{k} {v}" for k, v in payload["versions"].items()) + f" | model {payload['model']}"
             + (f" | cpu {payload['cpu_capability']}" if "cpu_capability" in payload else ""), ""]  # fmt: skip
    width = max(len(r["check"]) for r in payload["results"])
    for r in payload["results"]:
        mark = "  " if r["ok"] else "!!"
        lines.append(f"{mark} {r['path']:<12} {r['check']:<{width}} {r['label']:<46} {r['reason'][:110]}")
        lines.append(f"{'':3}{'':12} {'':{width}} scenario: {r['scenario']}")
    if payload.get("exercised"):
        lines += ["", "what each scenario exercised:"]
        lines += [f"  {', '.join(f'{k} {v}' for k, v in facts.items())}  <- {label}"
                  for label, facts in payload["exercised"].items()]  # fmt: skip
    for check, why in payload.get("release_lacks", {}).items():
        lines.append(f"   N/A on this release: {check}: {why}")
    for label, why in payload.get("unexercised", {}).items():
        lines.append(f"!! UNEXERCISED: {'; '.join(why)}  <- {label}")
    tallies = [_tally_from_json(t, Tally) for t in payload["decisiveness"]]
    lines += ["", render(tallies)]
    bad = [r for r in payload["results"] if not r["ok"]]
    lines.append("")
    counts: dict[str, int] = {}
    for r in payload["results"]:
        key = r["label"].split("(")[0]
        counts[key] = counts.get(key, 0) + 1
    lines.append(f"{len(payload['results'])} results in {payload['elapsed_s']} s: "
                 + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f"; {len(bad)} unexpected"
                 + (f"; {len(payload['vacuous'])} vacuous check(s)" if payload["vacuous"] else ""))  # fmt: skip
    return "\n".join(lines)


def _tally_from_json(data: dict, cls):
    from collections import Counter

    return cls(data["check"], data["passed"], data["failed"], Counter(data["not_applicable_reasons"]),
               Counter(data["blocked_by"]))  # fmt: skip


def run_in_vllm_environment(args: argparse.Namespace) -> int:
    """This command again, with the ``vllm`` environment's python (its exit code), or NOT-APPLICABLE (0)."""
    from cbverify import data
    from cbverify.engines import envs

    if (why := envs.problem("vllm")) is not None:
        print(f"NOT-APPLICABLE: the vllm path needs the vllm environment: {why}")
        return 0
    model = args.model if not Path(args.model).exists() else str(Path(args.model).resolve())
    # this module alone (the whole CLI imports scipy and more, which the vllm environment does not pin)
    command = [str(envs.python("vllm")), "-m", "cbverify.cli.upstream", "--run", "--path", "vllm", "--model", model]
    command += ["--random-model"] * args.random_model + ["--quiet"] * args.quiet
    command += ["--json", str(args.json.resolve())] if args.json else []
    print(f"running in the vllm environment: {' '.join(command)}", file=sys.stderr, flush=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(data.import_path()),
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    return subprocess.run(command, env=env).returncode


def run(args: argparse.Namespace) -> int:
    if args.run and args.path == "vllm" and importlib.util.find_spec("vllm") is None:
        return run_in_vllm_environment(args)
    print(findings_table())
    if not args.run:
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from cbverify.upstream.suite import DEFAULT_SCENARIOS, VLLM_SCENARIOS, run_suite

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model, tokenizer = load_model(args)
    start = time.perf_counter()
    if args.nproc > 1:
        from dataclasses import replace

        from cbverify.upstream.distributed import DISTRIBUTED_SCENARIOS, run_distributed

        scenarios = [replace(s, nproc=args.nproc) for s in DISTRIBUTED_SCENARIOS if args.path in (None, s.path)]
        rows, facts = run_distributed(scenarios, args.model, model, random_model=args.random_model,
                                      progress=not args.quiet, launcher=args.launcher)  # fmt: skip
    else:
        if args.path == "vllm":
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in the trainer's process, as colocate
            scenarios = list(VLLM_SCENARIOS)
        else:
            scenarios = [s for s in DEFAULT_SCENARIOS if args.path in (None, s.path)]
        rows, facts = run_suite(model, tokenizer, scenarios, progress=not args.quiet)
    name = "random-llama" if args.random_model else args.model
    payload = results_payload(rows, time.perf_counter() - start, name, model.config.model_type, facts)
    print(summary_table(payload))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    # a subset of the scenarios (--path) is not the set built for every check: vacuous checks are then reported only
    vacuous = payload["vacuous"] if args.path is None else []
    if vacuous:
        print(f"FAIL: {len(vacuous)} check(s) judged no scenario (NOT-APPLICABLE in all): {', '.join(vacuous)}")
    elif payload["vacuous"]:
        print(f"note: --path {args.path} runs only part of the scenarios; {', '.join(payload['vacuous'])} judged none "
              "of them, which fails only a run of every path")  # fmt: skip
    if payload["unexercised"]:
        print(f"FAIL: {len(payload['unexercised'])} scenario(s) did not exercise what they were built for")
    return 0 if all(r["ok"] for r in payload["results"]) and not vacuous and not payload["unexercised"] else 1


if __name__ == "__main__":  # how run_in_vllm_environment runs it there
    parser = argparse.ArgumentParser(prog="cbverify upstream")
    configure(parser)
    sys.exit(run(parser.parse_args()))
