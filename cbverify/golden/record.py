"""Record golden files: what the reference oracle produces for each golden case, with provenance.

Contract:

- :func:`build_record` is a pure function of (case, device, installed stack, model files): it runs
  ``reference.generate.generate`` on the case's requests and teacher-forces the resulting tokens through
  ``reference.logprobs`` (full-support trainer log-probs, processed sampler log-probs, raw top-5 per position), plus,
  for a case with ``trajectory_steps``, that many steps of ``reference.train``. Two runs in two fresh processes give
  identical records apart from the volatile env keys (``cbverify.golden.env.VOLATILE_KEYS``).
- :func:`record` writes ``golden/records/<device_class>/<case>.json``. It refuses a dirty git tree (changes outside
  ``golden/records/``) unless ``require_clean=False`` and refuses to overwrite an existing record unless
  ``force=True``; both refusals raise :class:`RecordRefused` with the reason.

Floats are float32 values written with Python's shortest round-trip ``repr`` (exact when read back).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from tqdm import tqdm

from cbverify import data
from cbverify.golden import env as golden_env
from cbverify.golden.cases import RECORDS_DIR, GoldenCase, record_path
from reference import generate as ref_generate
from reference import logprobs as ref_logprobs
from reference.models import load

FORMAT_VERSION = 1
TOP_K = 5
RECORDS_PREFIX = "golden/records/"


class RecordRefused(RuntimeError):
    """The recorder will not write: dirty tree or existing record without ``force``."""


def _floats(t: torch.Tensor) -> list[float]:
    return [float(x) for x in t.detach().to(torch.float32).cpu().tolist()]


def teacher_forced(
    model, case: GoldenCase, prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]]
) -> dict[str, list]:
    """Teacher-forced reference quantities for given tokens: lists (one entry per request) under the keys
    ``per_token_logps``, ``processed_per_token_logps``, ``top5_ids`` and ``top5_logprobs``."""
    sampling = case.sampling_params
    full = ref_logprobs.per_token_logps(model, prompts, completions, case.trainer_temperature)
    processed = ref_logprobs.processed_per_token_logps(model, prompts, completions, [sampling] * len(prompts))
    keys = ("per_token_logps", "processed_per_token_logps", "top5_ids", "top5_logprobs")
    out: dict[str, list] = {key: [] for key in keys}
    for prompt, completion, f, p in zip(prompts, completions, full, processed, strict=True):
        values, ids = ref_logprobs.top_logprobs(model, prompt, completion, k=TOP_K)  # (L, 5), (L, 5)
        out["per_token_logps"].append(_floats(f))
        out["processed_per_token_logps"].append(_floats(p))
        out["top5_ids"].append([[int(i) for i in row] for row in ids.tolist()])
        out["top5_logprobs"].append([_floats(row) for row in values])
    return out


def reference_rollouts(model, case: GoldenCase) -> list[dict]:
    """The reference oracle's rollouts for the case, each with its teacher-forced quantities."""
    requests = case.requests()
    rollouts = ref_generate.generate(model, requests)
    forced = teacher_forced(model, case, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts])
    return [
        {
            "request_id": r.request_id,
            "completion_ids": list(r.completion_ids),
            "finish_reason": r.finish_reason,
            "sampling_logprobs": [float(x) for x in r.logprobs],
            **{key: values[i] for key, values in forced.items()},
        }
        for i, r in enumerate(rollouts)
    ]


TRAJECTORY_METRICS = ("loss", "grad_norm", "mean_reward", "kl")


def trajectory_config(case: GoldenCase) -> dict:
    """The ``reference.train.TrainConfig`` fields of a case's trajectory: the defaults, shrunk to 2 prompts x 4
    generations so 5 steps fit the default test budget."""
    from reference.train import TrainConfig

    config = TrainConfig(model=case.model, steps=case.trajectory_steps, num_prompts=2, num_generations=4)
    return {f: getattr(config, f) for f in config.__slots__}


def run_trajectory(case: GoldenCase, device: str = "cpu", *, model=None, config: dict | None = None) -> dict | None:
    """``reference.train.train`` for the case's trajectory config (or the stored ``config``) on a fresh copy of the
    model: ``{"config": ..., "steps": [{"step", "loss", "grad_norm", "mean_reward", "kl"}, ...]}``, or ``None``."""
    if case.trajectory_steps == 0:
        return None
    from reference.train import TrainConfig, train

    config = dict(config) if config is not None else trajectory_config(case)
    if config.pop("engine", "reference") != "reference":  # records made while TrainConfig still named the engine
        raise ValueError("a golden trajectory is the oracle's: its stored config must not name another engine")
    model = copy.deepcopy(model) if model is not None else load(case.model, dtype=case.dtype, device=device)[0]
    history = train(TrainConfig(**config), model=model)
    steps = [{"step": h["step"], **{k: (None if h[k] is None else float(h[k])) for k in TRAJECTORY_METRICS}}
             for h in history]  # fmt: skip
    return {"config": config, "steps": steps}


def build_record(case: GoldenCase, device: str = "cpu", *, model=None) -> dict:
    """The full record for ``case`` (see the module contract). ``model`` overrides loading the bundled one."""
    if model is None:
        model, _ = load(case.model, dtype=case.dtype, device=device)
    requests = case.requests()
    return {
        "format_version": FORMAT_VERSION,
        "case": case.describe(),
        "config": {
            "device": str(device),
            "trainer_temperature": case.trainer_temperature,
            "top_k_recorded": TOP_K,
            "requests": [
                {
                    "request_id": r.request_id,
                    "prompt_ids": list(r.prompt_ids),
                    "seed": r.seed,
                    "eos_token_ids": list(r.eos_token_ids),
                }
                for r in requests
            ],  # fmt: skip
        },
        "rollouts": reference_rollouts(model, case),
        "trajectory": run_trajectory(case, device, model=model),
        "env": golden_env.capture(device),
    }


def dumps(record: dict) -> str:
    return json.dumps(record, indent=1, allow_nan=False) + "\n"


def record(
    cases: list[GoldenCase],
    device: str = "cpu",
    *,
    force: bool = False,
    require_clean: bool = True,
    root: Path = RECORDS_DIR,
) -> list[Path]:
    """Write one record per case (see the module contract); returns the paths written."""
    if root == RECORDS_DIR and data.checkout() is None:
        raise RecordRefused("recording goldens needs a checkout of the cbverify repository (git clone): the records "
                            "live in its golden/records and name the commit that made them")  # fmt: skip
    if require_clean:
        dirty = golden_env.git_dirty_paths(ignore=(RECORDS_PREFIX,))
        if dirty:
            shown = "\n  ".join(dirty[:20]) + ("\n  ..." if len(dirty) > 20 else "")
            raise RecordRefused(
                "refusing to record golden files from a dirty git tree (a golden must name the commit that made it); "
                f"commit or stash these first:\n  {shown}"
            )
    device_class = golden_env.device_class(device)
    targets = [(case, record_path(case, device_class, root)) for case in cases]
    existing = [str(path) for _, path in targets if path.exists()]
    if existing and not force:
        raise RecordRefused(
            "refusing to overwrite existing golden records without --force (re-record only for a legitimate reason, "
            "see golden/README.md):\n  " + "\n  ".join(existing)
        )
    written = []
    for case, path in tqdm(targets, desc="recording goldens", unit="case"):
        text = dumps(build_record(case, device))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
