"""Measure the noise the golden tolerances must absorb, and the signal they must still catch.

``python -m cbverify.golden.measure_noise [--case ...] [--engine NAME ...] [--threads N ...]`` prints, per case (one
JSON line), the max |Δ| and mean Δ of every recorded log-prob series between the committed golden (2 threads) and

- ``fresh-process``: the reference recomputed in this process (run-to-run noise across processes);
- ``threads=N``: the same computation with ``torch.set_num_threads(N)`` for N in 1 and 4;
- ``engine:<name>`` (with ``--engine``): each harness engine's sampling log-probs on the common token prefix;
- ``perturbed``: the signal: N(0, 1e-3) noise added to one layer's ``mlp.down_proj`` weight (what the tests inject).

The output is the evidence behind the golden tolerances in ``cbverify.tolerances``; rerun it when the stack changes
and update the reasons.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from cbverify.golden.cases import GoldenCase, select
from cbverify.golden.record import reference_rollouts
from reference.models import load

SERIES = ("sampling_logprobs", "per_token_logps", "processed_per_token_logps", "top5_logprobs")


def perturb(model, *, layer: int = 1, std: float = 1e-3, seed: int = 0):
    """A deep copy of ``model`` with N(0, std) noise added to ``model.layers[layer].mlp.down_proj.weight``."""
    model = copy.deepcopy(model)
    weight = model.model.layers[layer].mlp.down_proj.weight
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=gen).to(weight.dtype) * std)
    return model


def _flat(values) -> list[float]:
    return [x for v in values for x in (_flat(v) if isinstance(v, list) else [v])]


def series_delta(base: list[dict], other: list[dict]) -> dict:
    """Per series: max |Δ| and mean Δ over positions both runs share a token prefix; plus token divergences."""
    out: dict = {"token_divergences": 0}
    for key in SERIES:
        deltas = []
        for b, o in zip(base, other, strict=True):
            n = 0
            while n < min(len(b["completion_ids"]), len(o["completion_ids"])) and \
                    b["completion_ids"][n] == o["completion_ids"][n]:  # fmt: skip
                n += 1
            deltas += [y - x for x, y in zip(_flat(b[key][:n]), _flat(o[key][:n]), strict=True)]
        out[key] = {"max_abs": max(map(abs, deltas), default=0.0), "mean": sum(deltas) / max(1, len(deltas))}
    pairs = zip(base, other, strict=True)
    out["token_divergences"] = sum(b["completion_ids"] != o["completion_ids"] for b, o in pairs)
    return out


def engine_delta(name: str, model, case: GoldenCase, base: list[dict]) -> dict | str:
    from cbverify.engines import get_engine

    engine = get_engine(name, model)
    if not (engine.capabilities.spec_sampling or case.sampling_params.greedy):
        return "own RNG on a sampled case: not comparable"
    try:
        rollouts = engine.generate(case.requests())
    except Exception as err:  # noqa: BLE001 - a measurement script reports every engine failure and moves on
        return f"{type(err).__name__}: {err}"
    other = [{**b, "completion_ids": list(r.completion_ids), "sampling_logprobs": list(r.logprobs)}
             for b, r in zip(base, rollouts, strict=True)]  # fmt: skip
    delta = series_delta(base, other)
    return {"token_divergences": delta["token_divergences"], "sampling_logprobs": delta["sampling_logprobs"]}


def measure(case: GoldenCase, *, engines: list[str], threads: tuple[int, ...]) -> dict:
    """Deltas against the committed golden (recorded in another process: so ``fresh-process`` is run-to-run noise)."""
    from cbverify.golden.check import load_record

    base = load_record(case, "cpu")["rollouts"]
    model, _ = load(case.model, dtype=case.dtype)
    torch.set_num_threads(2)
    out = {"fresh-process": series_delta(base, reference_rollouts(model, case))}
    for n in threads:
        torch.set_num_threads(n)
        out[f"threads={n}"] = series_delta(base, reference_rollouts(model, case))
    torch.set_num_threads(2)
    for name in engines:
        out[f"engine:{name}"] = engine_delta(name, model, case, base)
    out["perturbed"] = series_delta(base, reference_rollouts(perturb(model), case))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", default=[], help="case name or substring (repeatable)")
    parser.add_argument("--engine", action="append", default=[], help="also measure this harness engine (repeatable)")
    parser.add_argument("--threads", type=int, action="append", default=None,
                        help="thread counts to compare with the golden's 2 (repeatable; default 1 and 4)")  # fmt: skip
    args = parser.parse_args(argv)
    for case in select(args.case):
        result = measure(case, engines=args.engine, threads=tuple(args.threads or (1, 4)))
        print(json.dumps({case.name: result}), flush=True)


if __name__ == "__main__":
    main()
