"""``cbverify verify``: every engine against the reference oracle on one model; a PASS/FAIL row per engine.

Workload (:func:`default_requests`): ``--num-prompts`` arithmetic questions from ``reference.tasks`` (seed
``--seed``), each asked twice: greedy, and sampled at T=1 with top-k 10 / top-p 0.95 (per-request seeds). Own-RNG
engines additionally get the sampling-distribution test (``--dist-samples`` copies of one sampled request).
Exit code: 0 when every engine passes (N/A counts as a pass only if ``--allow-na``), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from cbverify import report
from cbverify.engines import ENGINE_NAMES, get_engine
from cbverify.tolerances import tier_for
from reference import tasks
from reference.models import DEFAULT_MODEL, load
from reference.spec import Rollout, RolloutRequest, SamplingParams

SMALL_MODEL_PARAMS = 5e7  # below this, one CPU thread is fastest: measured 129 us vs 24 ms per (40x128)@(128x384)
# linear with 2 threads on a loaded 2-core machine (the bundled models have < 1M parameters)
DEFAULT_ENGINE_OPTIONS: dict[str, dict] = {
    "cb_impl": {"block_size": 16, "num_blocks": 256, "max_batch_tokens": 512},  # small explicit cache on any device
    "transformers-cb": {"page_size": 16, "max_batch_tokens": 256},
}


def default_requests(num_prompts: int, seed: int, max_new_tokens: int) -> list[RolloutRequest]:
    """Greedy + sampled requests over ``num_prompts`` arithmetic prompts (see module docstring)."""
    sampled = SamplingParams(temperature=1.0, top_k=10, top_p=0.95, max_new_tokens=max_new_tokens)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    requests = []
    for i, problem in enumerate(tasks.make_problems(num_prompts, seed=seed, max_terms=4)):
        prompt = tuple(tasks.prompt_ids(problem))
        for kind, sampling in (("greedy", greedy), ("sampled", sampled)):
            requests.append(RolloutRequest(f"q{i}-{kind}", prompt, sampling, seed=seed * 1000 + i, eos_token_ids=(2,)))
    return requests


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name or local checkpoint directory")
    parser.add_argument("--engines", nargs="+", default=list(ENGINE_NAMES), choices=ENGINE_NAMES,
                        help="engines to verify (the reference is always run as the oracle)")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device to run every engine on")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON to this file")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the report as Markdown to this file")
    parser.add_argument("--num-prompts", type=int, default=8, help="arithmetic prompts (each run greedy and sampled)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt set and of the sampling seeds")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="completion budget per request")
    parser.add_argument("--dist-samples", type=int, default=200,
                        help="samples for the own-RNG distribution test (0 skips it)")  # fmt: skip
    parser.add_argument("--allow-na", action="store_true", help="exit 0 even if an engine is not applicable")
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch CPU threads; default: 1 for models under {SMALL_MODEL_PARAMS:.0e} parameters "
                        "(per-op threading costs more than tiny matmuls save), else torch's default")  # fmt: skip


class _Replay:
    """The reference's own rollouts, replayed so its row goes through the same checks without a second run."""

    def __init__(self, engine, rollouts: list[Rollout]) -> None:
        self.name, self.capabilities, self.rollouts = engine.name, engine.capabilities, rollouts

    def generate(self, requests):
        return self.rollouts


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.dist_samples < 0:
        raise SystemExit("--num-prompts and --max-new-tokens must be >= 1, --dist-samples >= 0")
    if args.dist_samples and args.dist_samples < 50:
        raise SystemExit("--dist-samples must be 0 (skip) or >= 50 (the distribution test's minimum node size)")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("--threads must be >= 1")
    torch.manual_seed(args.seed)
    model, _ = load(args.model, dtype=args.dtype, device=args.device)
    threads = args.threads or (1 if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS else None)
    if threads:
        torch.set_num_threads(threads)
    tier = tier_for(args.dtype)
    requests = default_requests(args.num_prompts, args.seed, args.max_new_tokens)
    short = replace(requests[1].sampling, max_new_tokens=4)  # a few positions suffice; the nodes thin out fast
    dist = [RolloutRequest("dist", requests[1].prompt_ids, short, eos_token_ids=(2,))] if args.dist_samples else []
    repro = f"cbverify verify --model {args.model} --dtype {args.dtype} --device {args.device} " \
        f"--num-prompts {args.num_prompts} --seed {args.seed} --max-new-tokens {args.max_new_tokens}"  # fmt: skip
    names = ["reference"] + [n for n in args.engines if n != "reference"]
    rows = []
    with tqdm(names, desc="verify", unit="engine", disable=None) as bar:
        ref_engine = get_engine("reference", model)
        bar.set_postfix_str("reference")
        start = time.perf_counter()
        reference = ref_engine.generate(requests)
        ref_wall = time.perf_counter() - start
        for name in bar:
            bar.set_postfix_str(name)
            if name == "reference":
                row = report.evaluate_engine(_Replay(ref_engine, reference), model, requests, reference, tier)
                row.wall_s = ref_wall
                if "reference" not in args.engines:
                    continue
            else:
                engine = get_engine(name, model, **DEFAULT_ENGINE_OPTIONS.get(name, {}))
                row = report.evaluate_engine(engine, model, requests, reference, tier, repro=repro,
                                             dist_requests=dist, dist_samples=args.dist_samples)  # fmt: skip
            rows.append(row)
    env = report.environment(args.device, args.dtype, str(args.model), tier)
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    print(report.render_text(env, rows, color=color))
    if args.json:
        args.json.write_text(report.to_json(env, rows))
    if args.markdown:
        args.markdown.write_text(report.render_markdown(env, rows))
    ok = all(r.status == "PASS" or (r.status == "N/A" and args.allow_na) for r in rows)
    return 0 if ok else 1
