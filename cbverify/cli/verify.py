"""``cbverify verify``: every engine against the reference oracle on one checkpoint; a PASS/FAIL row per engine.

Any local checkpoint works: its own tokenizer, chat template, EOS ids and pad token (:mod:`cbverify.checkpoint`),
the user's prompts (``--prompts``, TRL's dataset formats) and GRPO recipe (``--grpo-config``: the sampling config TRL
builds from it, ``num_generations`` as the group size). Workload: :mod:`cbverify.workload`. Own-RNG engines also get
the sampling-distribution test (``--dist-samples`` copies of one sampled request). An engine that cannot be built or
fails while running is that engine's FAIL row (N/A when it refuses the model or workload up front, with the reason).
Exit code: 0 when every engine passes (N/A counts as a pass only with ``--allow-na``), 1 otherwise; bad input is a
one-line error (exit 2) before any model work.

While it runs, stderr (never stdout) shows an estimate of the whole run after the oracle's first request (the cost
of one oracle step measured there, times the forwards the workload asks of the oracle and of each engine), a tqdm
bar per engine and phase, and at the end the wall seconds per engine and phase (also in ``--json``'s ``timing``);
``--quiet`` shows none of it, ``--profile DIR`` writes a cProfile dump per phase.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cbverify import mechanisms, report
from cbverify.checkpoint import Checkpoint, brief, open_checkpoint
from cbverify.cli import MAX_SEED, held_stderr, integer, refuse, seed_type
from cbverify.decisive import render, tally, vacuous
from cbverify.engines import (
    ENGINE_NAMES,
    LOCAL_ENGINES,
    NotApplicable,
    check_unique_ids,
    clock,
    get_engine,
    kv_bytes_per_token,
    load_factory,
    pressure_sizes,
)
from cbverify.grpo_config import RolloutConfig, load_rollout_config
from cbverify.prompts import load_prompts
from cbverify.tolerances import tier_for_model
from cbverify.upstream.env_findings import env_finding
from cbverify.workload import DEFAULT_GROUP_SIZE, Workload, build_workload
from cbverify.zoo.findings import architecture_finding
from reference.models import DEFAULT_MODEL
from reference.spec import Rollout

SMALL_MODEL_PARAMS = 5e7  # below this, one CPU thread is fastest: measured 129 us vs 24 ms per (40x128)@(128x384)
# linear with 2 threads on a loaded 2-core machine (the bundled models have < 1M parameters)
DEFAULT_ENGINE_OPTIONS: dict[str, dict] = {
    "cb_impl": {"block_size": 16, "num_blocks": 256, "max_batch_tokens": 512},  # small explicit cache on any device
    "transformers-cb": {"page_size": 16, "max_batch_tokens": 256},
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name or local checkpoint directory")
    parser.add_argument("--engines", nargs="+", default=list(LOCAL_ENGINES), metavar="ENGINE",
                        help=f"engines to verify: {', '.join(ENGINE_NAMES)}, an engine another package registers "
                        "(entry point group cbverify.engines), or module:factory (docs/engines.md); the reference "
                        "always runs as the oracle; default: all but vllm, which runs in its own environment "
                        "(`cbverify env build vllm`)")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model dtype; the tolerance tier follows it and the model's decode "
                        "(cbverify.tolerances.tier_for_model)")  # fmt: skip
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device to run every engine on")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON to this file")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the report as Markdown to this file")
    parser.add_argument("--prompts", default=None,
                        help="prompts file: .jsonl / .json with a 'prompt' field (string or chat messages, as TRL's "
                        "datasets) or .txt (one per line); default: the task's problems for the bundled arithmetic "
                        "models, else a built-in natural-language set")  # fmt: skip
    parser.add_argument("--grpo-config", default=None,
                        help="TRL recipe YAML (as `trl grpo --config` reads it) or JSON of GRPOConfig fields: verify "
                        "the sampling config and group size TRL would generate with")  # fmt: skip
    parser.add_argument("--num-prompts", type=integer(1), default=8,
                        help="prompts to use, >= 1 (each asked greedy and as a group of samples)")  # fmt: skip
    parser.add_argument("--group-size", type=integer(1), default=None,
                        help=f"samples per prompt, >= 1, each with its own seed (default: the recipe's "
                        f"num_generations, else {DEFAULT_GROUP_SIZE})")  # fmt: skip
    parser.add_argument("--no-pressure", action="store_true",
                        help="skip the CB engines' second run with a KV cache too small for the workload and a "
                        "token budget below the longest prompt (preemption / eviction, chunked prefill)")  # fmt: skip
    parser.add_argument("--no-probes", action="store_true",
                        help="leave out the mechanism probes (groups of 2 and more whose draws differ, requests that "
                        "stop on a later EOS id); their mechanisms are then 'not asked' "
                        "(cbverify.mechanisms)")  # fmt: skip
    parser.add_argument("--seed", type=seed_type(), default=0,
                        help=f"seed of the prompt set and of the sampling seeds, in [0, {MAX_SEED}]")  # fmt: skip
    parser.add_argument(
        "--max-new-tokens",
        type=integer(1),
        default=None,
        help="completion budget per request, >= 1 (default: the recipe's max_completion_length, else 64)",
    )
    parser.add_argument("--dist-samples", type=dist_samples, default=200,
                        help=f"samples for the own-RNG distribution test: 0 skips it, else >= "
                        f"{MIN_DIST_SAMPLES}")  # fmt: skip
    parser.add_argument("--allow-na", action="store_true", help="exit 0 even if an engine is not applicable")
    parser.add_argument("--quiet", action="store_true",
                        help="nothing on stderr while it runs: no estimate, progress bars or timing table (the "
                        "timings stay in --json)")  # fmt: skip
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="run each phase of each engine under cProfile and write DIR/<n>-<engine>-<phase>.prof "
                        "and DIR/summary.txt (each phase's top functions); DIR is created")  # fmt: skip
    parser.add_argument("--threads", type=integer(1, MAX_THREADS), default=None,
                        help=f"torch CPU threads, 1 to {MAX_THREADS}; default: 1 for models under "
                        f"{SMALL_MODEL_PARAMS:.0e} parameters (per-op threading costs more than tiny matmuls save), "
                        "else torch's default")  # fmt: skip


MIN_DIST_SAMPLES = 50  # the distribution test's minimum node size
MAX_THREADS = 1024


def dist_samples(text: str) -> int:
    """``--dist-samples``: 0 (skip the test) or at least :data:`MIN_DIST_SAMPLES`."""
    value = integer(0)(text)
    if 0 < value < MIN_DIST_SAMPLES:
        raise argparse.ArgumentTypeError(f"must be 0 (skip) or >= {MIN_DIST_SAMPLES} (the distribution test's "
                                         f"minimum node size), got {value}")  # fmt: skip
    return value


class _Replay:
    """The reference's own rollouts, replayed so its row goes through the same checks without a second run."""

    def __init__(self, engine, rollouts: list[Rollout]) -> None:
        self.name, self.capabilities, self.rollouts = engine.name, engine.capabilities, rollouts

    def generate(self, requests):
        return self.rollouts


def most_testable(model, requests: list, num_samples: int):
    """The request the distribution test samples: one of the workload's sampled configurations on the prompt prefix
    (its first k tokens, k >= 1) whose next-token distribution gives the chi-square test the most bins at
    ``num_samples`` samples. A trained model sure of its answer leaves one bin at every position of the completion
    (only a token outside the support could fail there: no power against a wrong distribution); inside a prompt it is
    unsure (the operands of a question, the words of a sentence), and the engine is still asked with the user's
    sampling configuration."""
    from cbverify.distribution import chi_square_bins
    from reference.generate import process_logits
    from reference.logprobs import completion_logits

    best, best_bins = None, 0
    for request in {(r.prompt_ids, r.sampling): r for r in requests if not r.sampling.greedy}.values():
        ids = list(request.prompt_ids)
        rows = completion_logits(model, ids[:1], ids[1:] + [0]).cpu()  # row k: the next token after ids[: k + 1]
        for k, row in enumerate(rows):  # on the host: one copy per prompt, no device sync per row or processor op
            probs = process_logits(row, request.sampling).exp().double()
            bins = len(chi_square_bins(probs * max(num_samples, 1))[1])
            if bins > best_bins:
                best, best_bins = replace(request, prompt_ids=tuple(ids[: k + 1])), bins
    return best if best is not None else requests[0]


def run(args: argparse.Namespace) -> int:
    try:
        with held_stderr(), _loader_bars(not args.quiet):  # a refusal is then the only line on stderr
            plan = _prepare(args)
    except (ValueError, FileNotFoundError) as err:
        return refuse("verify", err)
    ckpt, model, workload, rollout_config = plan
    started = time.perf_counter()
    phases = report.Phases(progress=not args.quiet, profile_dir=args.profile, device=args.device)
    requests = list(workload.requests)
    try:
        with phases("setup", "tier"):  # a float32 model with a recurrent decode: a tier that grows with length
            longest = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
            tier = tier_for_model(model, args.dtype, max_length=longest)
        with phases("setup", "distribution request"):
            sampled = most_testable(model, requests, args.dist_samples)
        if workload.probes:
            with phases("setup", "mechanism probes"):
                requests += mechanisms.group_probes(
                    model,
                    [r.prompt_ids for r in requests],
                    seed=args.seed,
                    group_size=workload.group_size,
                    max_new_tokens=requests[0].sampling.max_new_tokens,
                    eos_token_ids=requests[0].eos_token_ids,
                )
    except Exception as err:  # the oracle's own forward pass fails on this checkpoint: nothing can be judged
        return _oracle_fails(args.model, err)
    short = replace(sampled.sampling, max_new_tokens=4)  # a few positions suffice; the nodes thin out fast
    dist = [replace(sampled, request_id="dist", sampling=short)] if args.dist_samples else []
    repro = f"cbverify verify --model {args.model} --dtype {args.dtype} --device {args.device} " \
        f"--num-prompts {args.num_prompts} --seed {args.seed} --max-new-tokens {sampled.sampling.max_new_tokens}" \
        + (f" --prompts {args.prompts}" if args.prompts else "") \
        + (f" --grpo-config {args.grpo_config}" if args.grpo_config else "")  # fmt: skip
    names = ["reference"] + [n for n in args.engines if n != "reference"]
    runs = [n for n in names[1:] for _ in range(1 + (n in PRESSURE_ENGINES and not args.no_pressure))]  # estimate
    rows, estimate = [], None
    ref_engine = get_engine("reference", model)
    try:
        check_unique_ids("reference", requests)
        reference: list[Rollout] = []
        with phases("reference", "generate", len(requests)) as advance:
            for k, request in enumerate(requests):  # one at a time, as the oracle runs anyway: progress per request
                with StepTimer(model, args.device) if k == 0 else contextlib.nullcontext() as timer:
                    reference += ref_engine.generate([request])
                if k == 0:
                    steps = timer.steps
                    estimate = estimate_run(model, requests, steps, runs, args.dist_samples, dist)
                    phases.note(f"verify: estimated ~{estimate.seconds:.0f}s ({estimate.basis})")
                advance(1)
        if workload.probes:  # requests that stop on a later EOS id, derived from the oracle's rollouts
            probes = mechanisms.eos_probes(requests, reference)
            with phases("reference", "generate", len(probes)) as advance:
                for request in probes:
                    reference += ref_engine.generate([request])
                    advance(1)
            requests += probes
    except Exception as err:  # nothing can be judged without the oracle: say so in one line
        return _oracle_fails(args.model, err)
    touched = mechanisms.workload_touches(requests, reference)
    ref_wall = phases.seconds[("reference", "generate")]
    lengths = [len(r.completion_ids) for r in reference]
    rest = estimate_run(model, requests, steps, runs, args.dist_samples, dist, lengths=lengths)
    phases.note(f"verify: oracle done in {ref_wall:.1f}s; estimated ~{rest.seconds:.0f}s to go ({rest.basis})")
    for name in names:
        if name == "reference":
            row = report.evaluate_engine(_Replay(ref_engine, reference), model, requests, reference, tier,
                                         phases=phases, tags=touched)  # fmt: skip
            row.wall_s = row.phase_s["generate"] = ref_wall
            if "reference" not in args.engines:
                continue
        else:
            row = _evaluate(name, model, requests, reference, tier, repro, dist, args.dist_samples, phases=phases,
                            tags=touched)  # fmt: skip
        rows.append(row)
        if not args.no_pressure and row.status != "N/A" and (name == "vllm" or sizable(row.sizing)):
            options, why = pressure_options(name, replace(workload, requests=tuple(requests)), model, row.sizing)
            label = f"{name}[pressure]"
            row = _evaluate(name, model, requests, reference, tier, repro, (), 0, options, phases=phases, label=label,
                            tags=touched)  # fmt: skip
            row.engine, row.notes = label, [why, *row.notes]
            rows.append(row)
    total = time.perf_counter() - started
    timing = {
        "estimated_s": None if estimate is None else round(estimate.seconds, 3),
        "estimate_basis": None if estimate is None else estimate.basis,
        "total_s": round(total, 3),
        "phases": [{"engine": e, "phase": n, "seconds": round(t, 4)} for (e, n), t in phases.seconds.items()],
    }
    env = report.environment(args.device, args.dtype, str(args.model), tier)
    env |= _workload_summary(ckpt, workload, rollout_config)
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    print(report.render_text(env, rows, color=color))
    tallies = tally(c for r in rows if r.engine != "reference" for c in r.checks)
    print(render(tallies, title="decisiveness over the engines"))
    if empty := vacuous(tallies):
        print(f"FAIL: {len(empty)} check(s) judged no engine (NOT-APPLICABLE on every one): {', '.join(empty)}")
    ran = [(r.engine.split("[")[0], r.spec_sampling, r.declared, r.mechanisms) for r in rows
           if r.engine != "reference" and r.status != "N/A" and r.completion_tokens]  # fmt: skip
    coverage = mechanisms.reach(touched, ran, probes=workload.probes, pressure=not args.no_pressure)
    print(mechanisms.render(coverage))
    guess = "" if estimate is None else f", estimated ~{estimate.seconds:.0f}s"
    phases.note(f"verify: wall seconds per engine and phase ({total:.1f}s in all{guess}):\n{phases.table()}")
    if args.profile is not None:
        phases.note(f"verify: cProfile per phase in {args.profile} (summary.txt: the top functions of each)")
    for path, render_file in (
        (args.json, lambda e, r: report.to_json(e, r, timing, coverage)),
        (args.markdown, lambda e, r: report.render_markdown(e, r) + _markdown_table(coverage)),
    ):
        if path is not None:
            try:
                path.write_text(render_file(env, rows))
            except OSError as err:
                return refuse("verify", f"cannot write {path}: {brief(err)}")
    ok = all(r.status == "PASS" or r.status.startswith("XFAIL") or (r.status == "N/A" and args.allow_na) for r in rows)
    return 0 if ok and not empty and not mechanisms.unreached(coverage) else 1


def _markdown_table(coverage: list[mechanisms.Reach]) -> str:
    """The mechanism table as Markdown, after the engines' rows."""
    lines = ["", "| mechanism | source | claimed by | times | sequences | status |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.mechanism} | {r.source} | {', '.join(r.engines) or '-'} | {r.times} | {r.sequences} "
              f"| {r.status} |" for r in coverage]  # fmt: skip
    return "\n".join(lines) + "\n"


class StepTimer:
    """While active, the start of every forward of ``model`` (its length in tokens and the device-synced time):
    ``steps`` is then ``[(tokens, seconds)]``, one per forward, each step lasting until the next forward starts or
    the block ends (so the oracle's sampling and host syncs after a forward count in its step)."""

    def __init__(self, model, device: str) -> None:
        self.model, self.device = model, device
        self.starts: list[tuple[int, float]] = []
        self.steps: list[tuple[int, float]] = []

    def __enter__(self) -> StepTimer:
        def before(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.starts.append((int(ids.shape[-1]) if ids is not None else 0, clock(self.device)))

        self.handle = self.model.register_forward_pre_hook(before, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()
        ends = [t for _, t in self.starts[1:]] + [clock(self.device)]
        self.steps = [(n, end - t) for (n, t), end in zip(self.starts, ends, strict=True)]


@dataclass(frozen=True, slots=True)
class Estimate:
    seconds: float
    basis: str


def step_cost(steps: list[tuple[int, float]]) -> tuple[float, float]:
    """``(a, b)``: one forward of T tokens costs about ``a + b * T`` seconds, fitted robustly to the measured
    ``steps`` (the first left out when there are 3 or more: it carries the warm-up): ``b`` the median of the pairwise
    slopes (Theil-Sen), kept between 0 and the cost per token of a forward through the origin (median seconds over
    median tokens), ``a`` the median of what is left (>= 0). Medians, because an accelerator's first forwards of a
    shape or kernel are slower than the rest."""
    steps = steps[1:] if len(steps) >= 3 else steps
    if not steps:
        return 0.0, 0.0
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    slopes = [(s2 - s1) / (t2 - t1) for i, (t1, s1) in enumerate(steps) for t2, s2 in steps[i + 1 :] if t2 != t1]
    through_origin = median([s for _, s in steps]) / max(1, median([t for t, _ in steps]))
    b = min(max(0.0, median(slopes)), through_origin) if slopes else 0.0
    return max(0.0, median([s - b * t for t, s in steps])), b


def estimate_run(model, requests, steps, runs: list[str], dist_samples: int, dist, lengths=None) -> Estimate:
    """The run's seconds, from the oracle's measured step cost (:func:`step_cost`, on its first request) and the
    forwards the workload asks for: the oracle's one forward per token over the growing prefix; per engine run
    (``runs``, pressure reruns included) a prefill of every prompt, one batched decode step per token of the longest
    completion and one teacher-forced forward per rollout; the reference's own teacher forcing; and the distribution
    test (a prefill and 4 decode steps of ``dist_samples`` copies, a forward per tested prefix) for every engine, as
    if none followed the spec's sampling. Without ``lengths`` every completion is assumed to use its whole budget (an
    upper bound on the tokens); with the oracle's completion ``lengths`` it is what is left after the oracle. Engine
    start-up and per-step overheads other than the oracle's are not in it."""
    a, b = step_cost(steps)
    cost = lambda tokens: a + b * tokens  # noqa: E731
    budgets = [(len(r.prompt_ids), r.sampling.max_new_tokens) for r in requests]
    if lengths is not None:
        budgets = [(p, n) for (p, _), n in zip(budgets, lengths, strict=True)]
    oracle = sum(m * a + b * (m * p + m * (m - 1) / 2) for p, m in budgets) if lengths is None else 0.0
    forced = sum(cost(p + m) for p, m in budgets)
    decode = cost(sum(p for p, _ in budgets)) + max(m for _, m in budgets) * cost(len(requests))
    dist_s = 0.0
    if dist_samples and dist:
        p = len(dist[0].prompt_ids)
        dist_s = cost(dist_samples * p) + 4 * cost(dist_samples) + 4 * cost(p + 4)
    seconds = oracle + forced + len(runs) * (decode + forced + dist_s)
    params = sum(p.numel() for p in model.parameters())
    tokens = (f"{len(requests)} requests x <= {max(m for _, m in budgets)} new tokens"
              if lengths is None else f"the oracle's {sum(lengths)} completion tokens")  # fmt: skip
    basis = (f"{params / 1e6:.3g}M parameters; {tokens} for {'the oracle and ' * (lengths is None)}{len(runs)} "
             f"engine run(s); an oracle step measured at {a * 1e3:.3g} ms + {b * 1e6:.3g} us/token over "
             f"{len(steps)} forward(s) of its first request; "
             + ("every completion assumed to use its whole budget, " if lengths is None else "")
             + "engine start-up and engines' own per-step overheads not counted")  # fmt: skip
    return Estimate(seconds, basis)


@contextlib.contextmanager
def _loader_bars(shown: bool):
    """transformers' weight-loading bar shown or not (``--quiet``), as it was afterwards."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not shown:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not shown:
            hf_logging.enable_progress_bar()


def _oracle_fails(model: str, err: Exception) -> int:
    """Nothing can be judged without the oracle: say so in one line; exit 1 (the checkpoint loaded, so this is a
    verdict on it, e.g. weights that give NaN logits, not a refusal of the input)."""
    print(f"cbverify verify: error: the reference oracle cannot run {model}: {brief(err)}", file=sys.stderr)
    return 1


def _prepare(args: argparse.Namespace):
    """Everything that can be checked before model work, then the checkpoint and the workload."""
    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
        if path is not None and (path.is_dir() or not path.parent.is_dir()):
            raise ValueError(f"{flag} {path}: " + ("is a directory" if path.is_dir() else "its folder does not exist"))
    if args.profile is not None:
        if args.profile.exists() and not args.profile.is_dir():
            raise ValueError(f"--profile {args.profile}: is not a directory")
        if not args.profile.parent.is_dir():
            raise ValueError(f"--profile {args.profile}: its folder does not exist")
    for name in args.engines:
        load_factory(name)  # an unknown name or a plugin that does not import: said before any weights are read
    rollout_config = load_rollout_config(args.grpo_config) if args.grpo_config else None
    if args.prompts:
        load_prompts(args.prompts)  # parse errors before the weights are read
    ckpt = open_checkpoint(args.model)
    max_new = args.max_new_tokens or (rollout_config.sampling.max_new_tokens if rollout_config else 64)
    workload = build_workload(
        ckpt, prompts_file=args.prompts, num_prompts=args.num_prompts, seed=args.seed, max_new_tokens=max_new,
        sampled=rollout_config.sampling if rollout_config else None,
        group_size=args.group_size or (rollout_config.num_generations if rollout_config else DEFAULT_GROUP_SIZE),
        eos_token_ids=rollout_config.eos_token_ids if rollout_config else None, probes=not args.no_probes,
    )  # fmt: skip
    if args.profile is not None:
        args.profile.mkdir(exist_ok=True)
        (args.profile / "summary.txt").write_text("")  # one run's phases: what an earlier run left is overwritten
    torch.manual_seed(args.seed)
    model = ckpt.load_model(dtype=args.dtype, device=args.device)
    threads = args.threads or (1 if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS else None)
    if threads:
        torch.set_num_threads(threads)
    return ckpt, model, workload, rollout_config


def _evaluate(name, model, requests, reference, tier, repro, dist, dist_samples, options=None, *, phases=None,
              label=None, tags=None) -> report.EngineRow:  # fmt: skip
    """One engine's row; building it is part of the verdict (a refusal is N/A, any other failure a FAIL)."""
    phases = phases if phases is not None else report.Phases()
    built = report.EngineRow(name)
    try:
        with phases(label or name, "build", row=built):
            engine = get_engine(name, model, **(options or default_options(name, [*requests, *dist])))
    except NotApplicable as err:
        built.status, built.problems = "N/A", [err.reason]
        return built
    except Exception as err:  # a construction failure is this engine's FAIL, never a traceback out of the command
        built.problems = [f"construction failed: {type(err).__name__}: {err}"]
        return built
    row = report.evaluate_engine(engine, model, requests, reference, tier, repro=repro, dist_requests=dist,
                                 dist_samples=dist_samples, phases=phases, label=label, tags=tags)  # fmt: skip
    row.phase_s = built.phase_s | row.phase_s
    finding = architecture_finding(name, model.config.model_type, row.problems) if row.status == "FAIL" else None
    if finding is not None:  # a registered upstream failure on this transformers release: reported, not hidden
        row.status = f"XFAIL({finding.id})"
        row.notes.append(
            f"registered upstream finding {finding.id} (transformers {finding.transformers or 'every version seen'}): "
            f"{finding.evidence}"
        )
    env_found = env_finding(name, row.problems) if row.status == "FAIL" else None
    if env_found is not None:  # a registered failure of an engine in its own environment (versions: its pins)
        row.status = f"XFAIL({env_found.id})"
        row.notes.append(f"registered upstream finding {env_found.id} ({env_found.affected}): {env_found.evidence}")
    extra = engine.last_run.extra if getattr(engine, "last_run", None) else {}
    if extra.get("stats"):
        row.notes.append(", ".join(f"{extra['stats'].get(k, 0)} {label}" for k, label in CB_IMPL_EVENTS.items()))
    if "evictions" in extra:  # transformers CB: requests offloaded or soft-reset for lack of KV blocks
        row.notes.append(f"{extra['evictions']} eviction events")
    if "vllm_events" in extra:  # vLLM's own counters
        row.notes.append(", ".join(f"{n} {label}" for label, n in extra["vllm_events"].items()))
    return row


PRESSURE_ENGINES = ("cb_impl", "transformers-cb", "vllm")  # the built-in engines that get a pressure row
CB_IMPL_EVENTS = {
    "num_partial_prefills": "chunked prefills",
    "num_preemptions": "preemptions",
    "num_shared_prefills": "shared-prompt prefills",
    "num_cow_copies": "copy-on-write block copies",
}


def default_options(name: str, requests) -> dict:
    """An engine's options for the ordinary (not pressure) run. vLLM's context is the workload's longest request: its
    own default, the checkpoint's ``max_position_embeddings``, needs a KV cache for one whole context, which its 10 %
    of RAM can lack on a real checkpoint (8192 positions), and it then refuses to start."""
    if name == "vllm":
        return {"max_model_len": max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)}
    return DEFAULT_ENGINE_OPTIONS.get(name, {})


def sizable(sizing: list[dict]) -> bool:
    """Whether an engine's declared sizing (``Capabilities.sizing`` as dicts) can put it under pressure: a KV-cache
    or a per-step token budget it lets the caller set. Such an engine, ours, transformers CB's or a plug-in's, gets a
    pressure row."""
    return any(o["role"] in ("kv_blocks", "batch_tokens") for o in sizing)


def pressure_options(name: str, workload: Workload, model, sizing: list[dict] = ()) -> tuple[dict, str]:
    """The CB engine's options for a second run under pressure: KV blocks for the longest request alone (so the
    rest are preempted / evicted and recomputed) and a per-step token budget of half the longest prompt (so every
    long prompt is prefilled in chunks), each option named and clamped to its range by the engine's ``sizing``
    (vLLM's in its own terms); and the sentence saying so."""
    roles = {o["role"]: o for o in sizing}
    clamp = lambda o, v: max(o["min"], min(o["max"], v))  # noqa: E731
    block = 32 if name == "vllm" else clamp(roles["block_size"], 16) if "block_size" in roles else 16  # vLLM-CPU's
    # attention takes multiples of 32 only
    longest = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in workload.requests)
    needed = sum(-(-(len(r.prompt_ids) + r.sampling.max_new_tokens) // block) for r in workload.requests)
    blocks, budget = pressure_sizes(workload.requests, block)  # the conformance suite's tight end too
    if name == "vllm":  # the same budgets in vLLM's terms: KV bytes, its scheduler's token and sequence limits
        options = {"block_size": block, "kv_cache_memory_bytes": blocks * block * kv_bytes_per_token(model),
                   "max_num_batched_tokens": budget, "max_num_seqs": budget, "max_model_len": longest,
                   "enable_chunked_prefill": True}  # fmt: skip
    else:
        values = {"block_size": block, "kv_blocks": blocks, "batch_tokens": budget}
        options = {o["name"]: clamp(o, values[role]) for role, o in roles.items() if role in values}
    why = (f"pressure: {blocks} KV blocks of {block} for a workload that needs up to {needed}; {budget} tokens per "
           f"step, longest prompt {workload.longest_prompt}")  # fmt: skip
    return options, why


def _workload_summary(ckpt: Checkpoint, workload: Workload, config: RolloutConfig | None) -> dict[str, str]:
    """What was asked, in the report's header: prompts, sampling, EOS, and every option no engine was given."""
    samplings = sorted(
        {f"T={s.temperature:g}/k={s.top_k}/p={s.top_p:g}/min_p={s.min_p:g}" for s in workload.samplings}
    )
    groups = f"each greedy + a group of {workload.group_size}" + (
        f"; probes: groups of 2 and {max(3, workload.group_size)} at T={mechanisms.PROBE_SAMPLING.temperature:g}, "
        "requests that stop on a later EOS id" if workload.probes else "")  # fmt: skip
    out = {
        "prompts": f"{workload.num_prompts} ({workload.prompt_source}), {groups}",
        "sampled": ", ".join(samplings),
        "eos_token_ids": str(list(workload.requests[0].eos_token_ids)),
    }
    if config is not None:
        out["grpo_config"] = config.source
        if config.unused_keys:
            out["unused (not sampling)"] = ", ".join(config.unused_keys)
        if config.extra_options:
            ignored = ", ".join(f"{k}={v!r}" for k, v in config.extra_options.items())
            out["ignored by every engine (outside the sampling spec, not verified)"] = ignored
    return out
