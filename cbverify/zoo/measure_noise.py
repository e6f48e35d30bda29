"""Measure the float noise between a decode and a teacher-forced prefill, per zoo architecture and position.

``python -m cbverify.zoo.measure_noise [--archs NAME ...] [--engines reference hf-generate] [--new-tokens N] [--seeds
S] [--dtype float32] [--context N]`` builds each zoo checkpoint (``cbverify.zoo.architectures``), generates long
requests (the zoo's 12-token prompt, no EOS, greedy and ``S`` sampled at T = 1 and T = 0.7 with top-k 10 / top-p 0.95)
with each engine, teacher-forces the engine's own tokens once with the oracle (``cbverify.compare.teacher_force``) and
prints one JSON line per (architecture, engine): whether the model carries a recurrent decode state
(``tolerances.recurrent_state``), and the max |Δ log-prob| (scaled by ``tolerances.logprob_scale``, as every check
reads it) over all positions and per position bucket (``[0, 8)``, ``[8, 16)``, ``[16, 32)``, ``[32, 64)``, ...).

- ``reference``: the oracle's own generation (a full forward per prefix: for a recurrent layer, a chunked scan of the
  whole prefix) against its teacher forcing (one forward of the whole sequence);
- ``hf-generate``: transformers ``generate()`` (a KV-cached / recurrent one-token decode) against the same.

The output is the evidence behind ``tolerances.FP32_RECURRENT`` (and the bf16 units of ``tolerances.BF16``); rerun
it when the stack changes and update the reasons there.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace

import torch

from cbverify import compare
from cbverify.engines import get_engine
from cbverify.tolerances import FP32, logprob_scale, recurrent_state, tier_for
from cbverify.zoo import architectures as zoo
from cbverify.zoo.matrix import PROMPTS
from reference.logprobs import completion_logits
from reference.models import load as load_checkpoint
from reference.spec import RolloutRequest, SamplingParams


def requests(new_tokens: int, seeds: int) -> list[RolloutRequest]:
    """Greedy and sampled requests on the zoo's long prompt, ``new_tokens`` long (no EOS)."""
    prompt = PROMPTS[0]
    out = [RolloutRequest("greedy", prompt, SamplingParams(temperature=0.0, max_new_tokens=new_tokens),
                          eos_token_ids=())]  # fmt: skip
    for t in (1.0, 0.7):
        sampling = SamplingParams(temperature=t, top_k=10, top_p=0.95, max_new_tokens=new_tokens)
        out += [RolloutRequest(f"T{t}-{s}", prompt, sampling, seed=s, eos_token_ids=()) for s in range(seeds)]
    return out


def buckets(n: int) -> list[tuple[int, int]]:
    """Position buckets ``[0, 8), [8, 16), [16, 32), ...`` covering ``n`` positions."""
    out, lo, hi = [], 0, 8
    while lo < n:
        out.append((lo, min(hi, n)))
        lo, hi = hi, hi * 2
    return out


def measure(arch: zoo.Arch, directory: str, engines, new_tokens: int, seeds: int, dtype: str) -> list[dict]:
    model, _ = zoo.load(arch, directory)
    if dtype != "float32":
        model, _ = load_checkpoint(f"{directory}/{arch.name}", dtype=dtype)
    tier = tier_for(dtype) if dtype != "float32" else FP32  # float32: absolute |Δ| (units of 1)
    reqs = requests(new_tokens, seeds)
    rows = []
    for name in engines:
        rollouts = get_engine(name, model).generate(reqs)
        forced = compare.teacher_force(model, reqs, rollouts, "processed", tier)
        per_pos: dict[int, float] = {}
        logit: dict[int, float] = {}  # the largest |logit| of the teacher-forced rows, per position
        per_token = 0.0  # the largest |Δ| / t, t the position's 1-based index in the whole sequence
        positions = forced.positions
        for k, (req, rollout, want) in enumerate(zip(reqs, rollouts, forced.expected, strict=True)):
            got = torch.tensor(rollout.logprobs, dtype=torch.float64)
            diff = (got - want.double()).abs() * logprob_scale(req.sampling) / positions.units[k]  # (L,), tier units
            skip = positions.at_cut[k] & (diff > positions.bound)  # (L,) left out at a cut, as the judge does
            rows_max = completion_logits(model, req.prompt_ids, rollout.completion_ids).abs().amax(-1)  # (L,)
            for j, (d, m, s) in enumerate(zip(diff.tolist(), rows_max.tolist(), skip.tolist(), strict=True)):
                d = 0.0 if s else d
                per_pos[j] = max(per_pos.get(j, 0.0), d)
                logit[j] = max(logit.get(j, 0.0), m)
                per_token = max(per_token, d / (len(req.prompt_ids) + j + 1))
        n = max(per_pos) + 1 if per_pos else 0
        rows.append({
            "arch": arch.name, "engine": name, "dtype": dtype, "recurrent": bool(recurrent_state(model)),
            "max": max(per_pos.values(), default=0.0), "max_per_context_token": per_token,
            "by_position": {f"{lo}-{hi}": max(per_pos[j] for j in range(lo, hi)) for lo, hi in buckets(n)},
            "max_logit": {f"{lo}-{hi}": max(logit[j] for j in range(lo, hi)) for lo, hi in buckets(n)},
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cbverify.zoo.measure_noise", description=__doc__.split("\n")[0])
    parser.add_argument("--archs", nargs="*", default=None, help="zoo entries (default: every one)")
    parser.add_argument("--engines", nargs="*", default=["reference", "hf-generate"])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--seeds", type=int, default=2, help="sampled requests per temperature")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--context", type=int, default=None,
                        help="max_position_embeddings of the built checkpoints (default: the zoo's 128), for "
                        "--new-tokens past it")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    archs = [zoo.by_name(a) for a in args.archs] if args.archs else list(zoo.ARCHS)
    if args.context is not None:  # the same weights' shapes; only the declared context changes
        archs = [replace(a, kwargs=a.kwargs | {"max_position_embeddings": args.context})
                 if "max_position_embeddings" in a.kwargs else a for a in archs]  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        for arch in archs:
            for row in measure(arch, directory, args.engines, args.new_tokens, args.seeds, args.dtype):
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
