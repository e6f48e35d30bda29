"""Measure the distribution test's false-alarm rate and power on bundled checkpoints, per dtype and tier.

``python -m property_tests.measure_distribution [--models ...] [--dtypes bfloat16 float32] [--runs N]
[--power-runs M] [--samples 200]`` builds the request ``cbverify verify`` tests (its workload on the checkpoint's
built-in prompts, the sampling of ``examples/grpo_recipe.yaml``: T 0.8, top-k 20, top-p 0.95, min-p 0.02;
``cli.verify.most_testable``'s prompt prefix, 4 new tokens), and runs ``distribution.distribution_test``'s steps on
it (``--samples`` copies in one call, every node tested, Holm at ``DISTRIBUTION_ALPHA``) under ``tier_for(dtype)``:

- the false-alarm rate: ``--runs`` runs of each *correct* own-RNG engine: ``faulty.OwnRNG`` (the reference with fresh
  seeds; a full forward per prefix, so its logits carry the dtype's noise against teacher forcing) and
  ``hf-generate`` (transformers ``generate()``, KV-cached decode), each run a fresh RNG seed;
- the power: ``--power-runs`` runs of each faulty sampler of ``property_tests/faulty.py`` (IgnoresTopK,
  TopKAfterTopP, SharedRNG, IgnoresTemperature, IgnoresMinP), each run other seeds.

Each run's draws are judged three ways: ``plain`` (no tier: the reference's distribution, every token),
``cut`` (tokens at a processor cut within the tier's noise left out: ``within_noise=False``) and ``tier`` (that and the
null widened to every distribution within the tier's noise: what ``verify`` runs). One JSON line per (model, dtype,
engine): runs, rejections per way, nodes and draws left out at a cut per run. The numbers are in docs/guide.md.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from cbverify.checkpoint import open_checkpoint
from cbverify.cli.verify import most_testable
from cbverify.distribution import holm, node_tests, replicate
from cbverify.engines import get_engine
from cbverify.tolerances import DISTRIBUTION_ALPHA, tier_for
from cbverify.workload import build_workload
from property_tests import faulty
from reference.models import MODELS_DIR, load
from reference.spec import SamplingParams

RECIPE = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, min_p=0.02, max_new_tokens=48)
FAULTY = ("IgnoresTopK", "TopKAfterTopP", "SharedRNG", "IgnoresTemperature", "IgnoresMinP")
WAYS = ("plain", "cut", "tier")


def dist_request(name: str, model, samples: int):
    """The request ``verify`` tests on ``name`` (module docstring)."""
    ckpt = open_checkpoint(MODELS_DIR / name)
    workload = build_workload(ckpt, prompts_file=None, num_prompts=8, seed=0, max_new_tokens=48, sampled=RECIPE,
                              probes=False)  # fmt: skip
    sampled = most_testable(model, list(workload.requests), samples)
    return replace(sampled, request_id="dist", sampling=replace(sampled.sampling, max_new_tokens=4))


def judge(model, request, rollouts, tier) -> dict:
    """One run's draws judged the three ways: ``{way: rejected?}``, nodes and draws at a cut."""
    out = {}
    for way in WAYS:
        tests = node_tests(model, request, rollouts, min_count=50, tier=None if way == "plain" else tier,
                           within_noise=way == "tier")  # fmt: skip
        out[way] = bool(holm(tests, DISTRIBUTION_ALPHA))
        if way == "tier":
            out["nodes"], out["at_cut"] = len(tests), sum(t.at_cut for t in tests)
            out["min_p"] = min((t.p_value for t in tests), default=1.0)
    return out


def engine_for(kind: str, model, run: int):
    if kind == "OwnRNG":
        return faulty.OwnRNG(model, seed=run)
    if kind == "hf-generate":
        return get_engine("hf-generate", model, seed=run)
    if kind == "IgnoresTopK":
        return faulty.IgnoresTopK(model, seed=run)
    return getattr(faulty, kind)(model)


def measure(name: str, dtype: str, engines, runs: int, samples: int) -> list[dict]:
    model, _ = load(name, dtype=dtype)
    tier = tier_for(dtype)
    request = dist_request(name, model, samples)
    rows = []
    for kind, n in engines:
        results = []
        for run in range(n):
            req = replace(request, seed=1 + run * 7919)  # spec samplers: other seeds per run
            rollouts = engine_for(kind, model, run).generate(replicate(req, samples))
            results.append(judge(model, req, rollouts, tier))
        rows.append({
            "model": name, "dtype": dtype, "tier": tier.name, "engine": kind, "runs": n,
            "prompt_tokens": len(request.prompt_ids),
            **{f"rejected_{w}": sum(r[w] for r in results) for w in WAYS},
            "nodes_per_run": sum(r["nodes"] for r in results) / max(1, n),
            "at_cut_draws_per_run": sum(r["at_cut"] for r in results) / max(1, n),
            "smallest_p": min(r["min_p"] for r in results) if results else None,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m property_tests.measure_distribution",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--models", nargs="*", default=["tiny-qwen3-chat", "tiny-llama-arith", "tiny-qwen2-random"])
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    parser.add_argument("--runs", type=int, default=20, help="runs of each correct engine")
    parser.add_argument("--power-runs", type=int, default=5, help="runs of each faulty sampler")
    parser.add_argument("--engines", nargs="*", default=["OwnRNG", "hf-generate", *FAULTY])
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    engines = [(e, args.runs if e in ("OwnRNG", "hf-generate") else args.power_runs) for e in args.engines]
    for name in args.models:
        for dtype in args.dtypes:
            for row in measure(name, dtype, engines, args.runs, args.samples):
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
