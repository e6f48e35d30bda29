"""Write a suite result as ``results.json``, ``results.md`` and PNG plots (throughput vs N, memory vs N, per engine).

Every file carries the environment (versions, hardware): the JSON under ``env``, the Markdown in its header, each
PNG in a footer line.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from pathlib import Path

from cbverify.bench.grpo_step import PATHS
from cbverify.bench.grpo_step import WORKLOADS as GRPO_WORKLOADS
from cbverify.bench.grpo_suite import paired_speedups
from cbverify.bench.timebox import cut_text, fmt_s, is_cut, status_of
from cbverify.bench.timed import ENGINES
from cbverify.engines import OWN_ENV_ENGINES

COLORS = {"hf-generate": "#1f77b4", "transformers-cb": "#ff7f0e", "cb_impl": "#2ca02c", "vllm": "#9467bd"}


def env_line(env: dict) -> str:
    parts = [
        f"torch {env.get('torch')}",
        f"transformers {env.get('transformers')}",
        f"trl {env.get('trl')}",
        f"python {env.get('python')}",
        env.get("gpu") or f"{env.get('cpu')} x{env.get('cpu_count')}",
        f"{env.get('torch_threads')} torch threads",
        f"{env.get('ram_gb')} GB RAM",
        env.get("platform", ""),
    ]
    return " | ".join(str(p) for p in parts if p)  # fmt: skip


def _env(result: dict) -> dict:
    rows = [*result["cases"], *(result.get("grpo") or {}).get("rows", [])]  # a GRPO-only run has no cases
    return next((c["env"] for c in rows if "env" in c), {})


def _model(result: dict) -> dict:
    return next((c["model"] for c in result["cases"] if c.get("workload") != "arith" and "model" in c),
                next((c["model"] for c in result["cases"] if "model" in c), {}))  # fmt: skip


def _fmt(value, spec: str = ".2f", none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


def markdown(result: dict) -> str:
    env, model = _env(result), _model(result)
    lines = ["# cbverify bench", "", f"- environment: {env_line(env)}",
             f"- models: {json.dumps(model)}; arith uses tiny-llama-arith",
             f"- config: `{json.dumps(result['config'])}`", "",
             "tok/s = completion tokens / wall time; TTFT = until the batch's first completion token; KV = KV cache "
             "reserved; peak = " + (_model_memory_kind(result)) + "; waste = 1 - necessary / forwarded tokens "
             "(cbverify/bench/measure.py); ovh = engine overhead per step (wall - forward time) / steps. With several "
             "rounds of the matrix, each case is its fastest round (min-max tok/s over the rounds in brackets).",
             ""]  # fmt: skip
    if result.get("time_boxes"):  # runs with time boxes (their plan is in the logs)
        lines[5:5] = [f"- time boxes: {describe_boxes(result['time_boxes'])}; a case past its box is recorded as a "
                      "timeout with what it had done"]  # fmt: skip
    ratio = {(r["workload"], r["n"], r["engine"]): r for r in result["ratios"]}
    for workload in dict.fromkeys(c["workload"] for c in result["cases"]):
        vllm = any(c["engine"] == "vllm" for c in result["cases"])
        lines += [f"## {workload}", "", "| N | engine | tok/s | wall s | TTFT s | KV MB | peak MB | waste "
                  "| ovh ms/step | steps | x hf-generate | x tfm-CB |" + (" x vllm |" if vllm else "") + " checks |",
                  "|" + "---|" * (14 if vllm else 13)]  # fmt: skip
        cases = sorted((c for c in result["cases"] if c["workload"] == workload),
                       key=lambda c: (c["n"], ENGINES.index(c["engine"])))  # fmt: skip
        for c in cases:
            if "error" in c:
                error = c["error"].splitlines()[0][:200].replace("|", "/")  # one table cell
                lines.append(f"| {c['n']} | {c['engine']} | ERROR: {error} |" + " |" * 10)
                continue
            if is_cut(c):  # timed out, interrupted, skipped or missing: what it had done, in one cell
                lines.append(f"| {c['n']} | {c['engine']} | {cut_text(c)} |" + " |" * 10)
                continue
            r = ratio.get((workload, c["n"], c["engine"]), {})
            check = "; ".join(c["check_problems"]) or "ok"
            if c.get("cut_rounds"):
                check += "; rounds without a measurement: " + ", ".join(c["cut_rounds"])
            if "tokens_equal_to_cb_impl" in c:
                check += f"; tokens = cb_impl in {c['tokens_equal_to_cb_impl']:.0%}"
            kv = None if c["kv_reserved_bytes"] is None else c["kv_reserved_bytes"] / 2**20
            lines.append(
                f"| {c['n']} | {c['engine']} | {c['tokens_per_s']:.0f}{_spread(c)} | {c['wall_s']:.2f} "
                f"| {_fmt(c['ttft_s'], '.3f')} "
                f"| {_fmt(kv, '.1f')} | {c['peak_memory_mb']:.0f} | {_fmt(c['wasted_share'], '.0%')} "
                f"| {_fmt(c['overhead_per_step_ms'], '.1f')} | {c['steps']} "
                f"| {_fmt(r.get('throughput_vs_hf-generate'))} "
                f"| {_fmt(r.get('throughput_vs_transformers-cb'))} |"
                + (f" {_fmt(r.get('throughput_vs_vllm'))} |" if vllm else "")
                + f" {check} |"
            )
        lines.append("")
    extras = {c["workload"]: c.get("extra") or {} for c in result["cases"] if c["engine"] in OWN_ENV_ENGINES}
    startups = {w: e["startup_s"] for w, e in extras.items() if "startup_s" in e}
    if startups:
        lines += ["vLLM start-up (worker process, `LLM` construction, first forward; paid once per run, in no wall "
                  "time above), per bench process: " + ", ".join(f"{w} {t:.1f} s" for w, t in startups.items()) + ".",
                  ""]  # fmt: skip
    lines += breakdown_markdown(result)
    if result["targets"]:  # none in a GRPO-only run (--no-matrix)
        lines += ["## Targets (CPU, ratios from this run)", "", "| target | measured | met |", "|---|---|---|"]
    for t in result["targets"]:
        lines.append(f"| {t['target']} | {_fmt(t['value'], '.3f')} | {_met(t['met'])} |")
    if result.get("grpo"):
        lines += ["", grpo_markdown(result["grpo"])]
    return "\n".join(lines) + "\n"


def step_breakdown(case: dict) -> dict[str, float] | None:
    """cb_impl's wall time per step in ms, from its own step timers (``LLMEngine.stats``) and the timed forwards:
    scheduling; the model runner outside the forward (step metadata, copy-on-write block copies); the forward;
    sampling and postprocessing; the rest (the adapter, the forward hooks). None without timed forwards."""
    stats = (case.get("extra") or {}).get("stats") or {}
    if case.get("forward_s") is None or not case.get("steps") or "model_s" not in stats:
        return None
    ms = 1e3 / case["steps"]
    parts = {"schedule": stats["schedule_s"] * ms, "runner": (stats["model_s"] - case["forward_s"]) * ms,
             "forward": case["forward_s"] * ms, "sample": stats["sample_s"] * ms}  # fmt: skip
    return parts | {"rest": case["wall_s"] * ms - sum(parts.values())}


def breakdown_markdown(result: dict) -> list[str]:
    """Where cb_impl's step goes, per workload and N, beside ``generate()``'s overhead per step."""
    rows, hf = [], {(c["workload"], c["n"]): c for c in result["cases"] if c["engine"] == "hf-generate"}
    for c in result["cases"]:
        parts = step_breakdown(c) if c["engine"] == "cb_impl" and status_of(c) == "ok" else None
        if parts:
            overhead = sum(v for k, v in parts.items() if k != "forward")
            other = hf.get((c["workload"], c["n"]), {}).get("overhead_per_step_ms")
            rows.append(f"| {c['workload']} | {c['n']} | " + " | ".join(f"{v:.2f}" for v in parts.values())
                        + f" | {overhead:.2f} | {_fmt(other)} |")  # fmt: skip
    if not rows:
        return []
    return ["## Where cb_impl's step goes (ms per step, its fastest round)", "",
            "schedule = `Scheduler.schedule`; runner = the model runner outside the forward (step metadata, "
            "copy-on-write block copies); sample = sampling and postprocessing; rest = the adapter and forward hooks; "
            "overhead = all but the forward.", "",
            "| workload | N | schedule | runner | forward | sample | rest | overhead | hf-generate overhead |",
            "|---|---|---|---|---|---|---|---|---|", *rows, ""]  # fmt: skip


def _spread(case: dict) -> str:
    """`` (min-max)`` of a case's throughput over its rounds; empty for one round."""
    if case.get("rounds", 1) < 2:
        return ""
    return f" ({case['tokens_per_s_min']:.0f}-{case['tokens_per_s_max']:.0f})"


def _model_memory_kind(result: dict) -> str:
    kinds = {c.get("memory_kind") for c in result["cases"] if c.get("memory_kind")}
    return ", ".join(sorted(kinds)) or "n/a"


def grpo_markdown(grpo: dict) -> str:
    """Per workload, the published table's shape: step time, speedup and peak-memory delta versus ``generate()``, with
    the spread of the step times, the generation share and the completion lengths the trainer logged, then the
    GRPO-step targets. Rows are TRL's trainer generation paths (``cbverify.bench.grpo_step.PATHS``: ``generate`` is
    the trainer's default path)."""
    setup = grpo.get("setup", "")
    lines: list[str] = []
    for workload in sorted({r.get("workload", "arith") for r in grpo["rows"]}, key=GRPO_WORKLOADS.index):
        rows = [r for r in grpo["rows"] if r.get("workload", "arith") == workload]
        text = setup.get(workload, "") if isinstance(setup, dict) else setup
        lines += [f"## GRPO step (TRL GRPOTrainer): {workload}", "", f"- {text}", "", *_grpo_table(rows), ""]
        targets = grpo_targets(rows)
        if targets:
            lines += ["| GRPO-step target | measured | met | generation speedup it needs (generate()'s share) "
                      "| generation speedup measured |", "|---|---|---|---|---|"]  # fmt: skip
            lines += [f"| {t['target']} | {_fmt(t['value'], '.3f')} | {_met(t['met'])} | {_needed(t)} | "
                      f"{_fmt(t['generation_speedup'])} |" for t in targets] + [""]  # fmt: skip
    return "\n".join(lines).rstrip("\n")


def _grpo_table(rows: list[dict]) -> list[str]:
    lines = ["| N | generation path | step s (median) | min - max s | speedup vs generate() | paired speedup: "
             "median (min - max) | generation speedup (paired median) | generation share | completion tokens: mean "
             "(max, cut) | peak MB | delta vs generate() MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    by = {(r["n"], r["path"]): r for r in rows}
    for (n, path), r in sorted(by.items(), key=lambda kv: (kv[0][0], PATHS.index(kv[0][1]))):
        if "error" in r:
            lines.append(f"| {n} | {path} | ERROR: {r['error'][:200]} | | | | | | | | |")
            continue
        if is_cut(r):
            lines.append(f"| {n} | {path} | {cut_text(r)} | | | | | | | | |")
            continue
        base = by.get((n, "generate"))
        ok = base is not None and status_of(base) == "ok"
        speed = _fmt(base["step_s"] / r["step_s"] if ok else None)
        delta = _fmt(r["peak_memory_mb"] - base["peak_memory_mb"] if ok else None, "+.0f")
        spread = f"{_fmt(r.get('step_min_s'))} - {_fmt(r.get('step_max_s'))}"
        paired = paired_speedups(base["step_times_s"], r["step_times_s"]) if ok else None
        paired_text = f"{statistics.median(paired):.2f} ({min(paired):.2f} - {max(paired):.2f})" if paired else "n/a"
        gen = _fmt(_generation_speedup(base, r) if ok else None)
        label = f"{path} ({r['note']})" if r.get("note") else path
        lines.append(f"| {n} | {label} | {r['step_s']:.2f} | {spread} | {speed} | {paired_text} | {gen} | "
                     f"{_fmt(r.get('generation_share'), '.0%')} | {_lengths(r)} | {r['peak_memory_mb']:.0f} | "
                     f"{delta} |")  # fmt: skip
    return lines


def _lengths(row: dict) -> str:
    """The completion lengths the trainer logged over a row's timed steps: mean, longest, share cut at the cap."""
    logged = row.get("completion_lengths") or {}
    means, longest, cut = (logged.get(k) or [] for k in ("mean_length", "max_length", "clipped_ratio"))
    if not means:
        return f"{row['mean_completion_length']:.0f}" if row.get("mean_completion_length") else "n/a"
    return f"{statistics.mean(means):.0f} ({max(longest):.0f}, {statistics.mean(cut):.0%})"


def _generation_speedup(base: dict, row: dict) -> float | None:
    """The median of ``generate()``'s generation time over ``row``'s, step by step (None without both)."""
    gen = paired_speedups(base.get("generation_times_s"), row.get("generation_times_s"))
    return statistics.median(gen) if gen else None


def generation_speedup_needed(share: float, target: float) -> float:
    """Amdahl's bound: the generation speedup ``x`` that makes a step ``target`` times faster when generation is
    ``share`` of it and the rest of the step is unchanged, ``1 / ((1 - share) + share / x) = target``; infinite when
    the rest alone takes more than ``1 / target`` of the step (no generation speed reaches the target)."""
    if not 0.0 <= share <= 1.0 or target <= 0:
        raise ValueError(f"need 0 <= share <= 1 and target > 0, got share={share}, target={target}")
    slack = 1.0 / target - (1.0 - share)
    return share / slack if slack > 0 else math.inf


def _needed(target: dict) -> str:
    needed, share = target["generation_speedup_needed"], target["generate_share"]
    if needed is None:
        return "n/a"
    text = "unreachable" if math.isinf(needed) else f"{needed:.2f}"
    return f"{text} ({share:.0%})"


# (workload, N, path, minimum speedup of the median step versus generate()): on the reasoning workload, where
# generation is a large share of the step; on the arithmetic one (completions ~40 tokens) Amdahl's bound puts them
# out of reach whatever the engine does, and the table's share column says so
GRPO_TARGETS = (("reasoning", 8, "cb_impl", 1.0), ("reasoning", 32, "cb_impl", 1.25),
                ("reasoning", 64, "cb_impl", 1.25))  # fmt: skip


def grpo_targets(rows: list[dict]) -> list[dict]:
    """The GRPO-step targets that rows of their workload bear on, measured; rows carry ``workload`` (absent: arith)."""
    by = {(r.get("workload", "arith"), r["n"], r["path"]): r for r in rows if status_of(r) == "ok"}
    out = []
    for workload, n, path, threshold in GRPO_TARGETS:
        a, b = by.get((workload, n, path)), by.get((workload, n, "generate"))
        if a is None and b is None:
            continue
        value = b["step_s"] / a["step_s"] if a and b else None
        share = b.get("generation_share") if b else None
        needed = None if share is None else generation_speedup_needed(share, threshold)
        out.append({"target": f"GRPO step ({workload}) N={n}: {path} speedup vs generate() >= {threshold}",
                    "value": value,
                    "met": None if value is None else value >= threshold, "generate_share": share,
                    "generation_speedup_needed": needed,
                    "generation_speedup": _generation_speedup(b, a) if a and b else None})  # fmt: skip
    return out


def describe_boxes(boxes: dict) -> str:
    """A run's time boxes in words (the report's header)."""

    def one(value) -> str:
        return "none" if value is None else fmt_s(value)

    return (f"a case {one(boxes.get('case_timeout_s'))}, a worker's start {one(boxes.get('start_timeout_s'))}, "
            f"time budget {one(boxes.get('time_budget_s'))}")  # fmt: skip


def _met(met: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "n/a"}[met]


def plots(result: dict, out_dir: Path) -> list[Path]:
    """``throughput.png`` and ``memory.png``: one panel per workload, one line per engine, N on a log2 axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    footer = env_line(_env(result))
    cases = [c for c in result["cases"] if status_of(c) == "ok"]
    workloads = list(dict.fromkeys(c["workload"] for c in cases))
    panels = {
        "throughput.png": [("tokens_per_s", "completion tokens / s", 1.0)],
        "memory.png": [("kv_reserved_bytes", "KV cache reserved (MiB)", 2**-20),
                       ("peak_memory_mb", _model_memory_kind(result) + " (MiB)", 1.0)],
    }  # fmt: skip
    paths = []
    for name, metrics in panels.items():
        fig, axes = plt.subplots(len(metrics), max(1, len(workloads)), figsize=(4.6 * max(1, len(workloads)),
                                 3.6 * len(metrics)), squeeze=False)  # fmt: skip
        for i, (metric, label, scale) in enumerate(metrics):
            for j, workload in enumerate(workloads):
                ax = axes[i][j]
                for engine in ENGINES:
                    pts = sorted(
                        (c["n"], c[metric] * scale)
                        for c in cases
                        if c["workload"] == workload and c["engine"] == engine and c.get(metric) is not None
                    )
                    if pts:
                        ax.plot(*zip(*pts, strict=False), marker="o", label=engine, color=COLORS[engine])
                ax.set_xscale("log", base=2)
                ns = sorted({c["n"] for c in cases if c["workload"] == workload})
                ax.set_xticks(ns, [str(n) for n in ns])
                ax.minorticks_off()
                ax.set_xlabel("N (generations per prompt)")
                ax.set_ylabel(label)
                ax.set_title(workload)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        wrapped = textwrap.fill(footer, width=int(fig.get_figwidth() * 24))
        fig.text(0.01, 0.005, wrapped, fontsize=6, color="gray")
        fig.tight_layout(rect=(0, 0.025 * (1 + wrapped.count("\n")) * 4 / fig.get_figheight(), 1, 1))
        fig.savefig(out_dir / name, dpi=110, metadata={"Description": footer})
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def write(result: dict, out_dir: Path, *, png: bool = True) -> list[Path]:
    """``results.json``, ``results.md`` and (with ``png``) the plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    slim = result | {
        "env": _env(result),
        "cases": [{k: v for k, v in c.items() if k != "completions"} for c in result["cases"]],
    }
    (out_dir / "results.json").write_text(json.dumps(slim, indent=1) + "\n")
    (out_dir / "results.md").write_text(markdown(result))
    return [out_dir / "results.json", out_dir / "results.md", *(plots(result, out_dir) if png else [])]
