"""The three engines, each driven the way TRL 1.16 drives it, timed from the first request to the last token.

- ``generate``: ``GRPOTrainer._generate_single_turn``'s default path: prompts left-padded into one batch with an
  attention mask, ``model.generate(**inputs, generation_config=GenerationConfig(max_new_tokens, do_sample=True,
  pad/bos/eos, temperature, top_p, top_k, min_p, repetition_penalty, disable_compile=True))``, completions cut after
  the first EOS. One ``max_new_tokens`` for all rows (``max L_i``); rows are cut at ``L_i`` afterwards.
- ``transformers-cb``: the model's own CB manager with TRL's config (``ContinuousBatchingConfig(
  max_memory_percent=0.5)``; on CPU also explicit ``num_blocks`` / ``max_batch_tokens``). TRL calls
  ``generate_batch``, which takes a single ``max_new_tokens``; per-request lengths need the manager it wraps, so we
  call ``init_continuous_batching`` + ``add_request(max_new_tokens=L_i)`` (what ``generate_batch`` does inside).
- ``cb_impl``: ``LLMEngine(model, EngineConfig(num_blocks=..., max_batch_tokens=...)).generate(requests)``.

Setup (cache allocation, engine construction) is timed separately from generation (``setup_s``).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from cbverify.bench.measure import clock, count_forwards
from reference.spec import RolloutRequest

ENGINES = ("generate", "transformers-cb", "cb_impl")


@dataclass(slots=True)
class EngineRun:
    """What one timed generation produced (completions in request order) and what it cost."""

    engine: str
    completions: list[list[int]]
    finish_reasons: list[str]
    wall_s: float
    ttft_s: float | None
    kv_reserved_bytes: int | None
    steps: int
    forward_tokens: int
    forward_s: float
    setup_s: float = 0.0
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineOptions:
    device: str
    pad_token_id: int
    num_blocks: int | None  # our cb_impl KV budget in blocks (None: its own default sizing)
    max_batch_tokens: int
    time_forwards: bool

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")


def _generation_config(requests: list[RolloutRequest], max_new_tokens: int, pad_token_id: int, **extra):
    """TRL 1.16's ``GenerationConfig`` for the non-vLLM paths (``GRPOTrainer.__init__``), from the requests."""
    from transformers import GenerationConfig

    first = requests[0].sampling
    eos = sorted({t for r in requests for t in r.eos_token_ids}) or None
    sampled = first.temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sampled, pad_token_id=pad_token_id, bos_token_id=None,
        eos_token_id=eos, temperature=first.temperature if sampled else None, top_p=first.top_p if sampled else None,
        top_k=first.top_k if sampled else None, min_p=(first.min_p or None) if sampled else None,
        repetition_penalty=1.0, cache_implementation=None, disable_compile=True, **extra,
    )  # fmt: skip


def _cut(tokens: list[int], request: RolloutRequest) -> tuple[list[int], str]:
    """The contract's completion: up to ``max_new_tokens``, ending after the first EOS if there is one."""
    tokens = tokens[: request.sampling.max_new_tokens]
    for i, t in enumerate(tokens):
        if t in request.eos_token_ids:
            return tokens[: i + 1], "stop"
    return tokens, "length"


@contextmanager
def no_default_eos(model, config):
    """generate() fills every ``None`` of the passed config from ``model.generation_config`` (transformers 5.24
    ``_prepare_generation_config``), so ``eos_token_id=None`` alone does not disable EOS: clear the model default
    for the call when the requests have no EOS, and restore it afterwards (also on error)."""
    saved = model.generation_config.eos_token_id
    if config.eos_token_id is None:
        model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


def run_generate(model, requests: list[RolloutRequest], opts: EngineOptions) -> EngineRun:
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstCall(LogitsProcessor):  # records when the first sampling step happens (all rows' first token)
        at: float | None = None

        def __call__(self, input_ids, scores):
            if self.at is None:
                self.at = clock(opts.device)
            return scores

    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.full((len(requests), width), opts.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids) :] = 1
    ids, mask = ids.to(opts.device), mask.to(opts.device)
    # return_dict_in_generate only adds the cache to the output (to measure it); the generation is TRL's
    config = _generation_config(
        requests, max(r.sampling.max_new_tokens for r in requests), opts.pad_token_id, return_dict_in_generate=True
    )
    first = FirstCall()
    with no_default_eos(model, config), count_forwards(model, opts.device, time_forwards=opts.time_forwards) as fw:
        start = clock(opts.device)
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, logits_processor=LogitsProcessorList([first])
        )
        end = clock(opts.device)
    cache = out.cache
    kv = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    rows = out.sequences[:, width:].tolist()
    cut = [_cut(row, r) for row, r in zip(rows, requests, strict=True)]
    return EngineRun("generate", [c for c, _ in cut], [f for _, f in cut], end - start,
                     None if first.at is None else first.at - start, kv, fw.steps, fw.forward_tokens, fw.forward_s,
                     extra={"generated_width": len(rows[0])})  # fmt: skip


def run_transformers_cb(model, requests: list[RolloutRequest], opts: EngineOptions) -> EngineRun:
    from transformers.generation import ContinuousBatchingConfig

    max_len = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
    cb_kwargs = {"max_memory_percent": 0.5}  # TRL 1.16's default (GRPOTrainer.__init__)
    if not opts.device.startswith("cuda"):  # CPU: explicit small sizes, else it reserves GBs (UPSTREAM.md)
        page = ContinuousBatchingConfig.page_size
        cb_kwargs |= {
            "num_blocks": len(requests) * math.ceil(max_len / page),
            "max_batch_tokens": opts.max_batch_tokens,
        }
    config = _generation_config(requests, max(r.sampling.max_new_tokens for r in requests), opts.pad_token_id)
    t_setup = time.perf_counter()
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs)
    )
    manager.warmup()
    manager.start()
    setup_s = time.perf_counter() - t_setup
    results = {}
    try:
        with count_forwards(model, opts.device, time_forwards=opts.time_forwards) as fw, torch.no_grad():
            start = clock(opts.device)
            for r in requests:
                eos = list(r.eos_token_ids) or -1
                manager.add_request(list(r.prompt_ids), request_id=r.request_id, record_timestamps=True,
                                    max_new_tokens=r.sampling.max_new_tokens, eos_token_id=eos)  # fmt: skip
            while len(results) < len(requests):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError(
                        f"transformers CB produced nothing for 60 s ({len(results)}/{len(requests)} "
                        "done); its generation thread is running: " + str(manager.is_running())
                    )
                if result.error is not None:
                    raise RuntimeError(f"transformers CB failed request {result.request_id}: {result.error}")
                if result.is_finished():
                    results[result.request_id] = result
            end = clock(opts.device)
        kv = int(manager.batch_processor.cache.cache_tensor.nbytes)
    finally:
        manager.stop(block=True)
        manager.destroy()
    firsts = [t.timestamps[0] for t in results.values() if t.timestamps]
    cut = [_cut(list(results[r.request_id].generated_tokens), r) for r in requests]
    return EngineRun("transformers-cb", [c for c, _ in cut], [f for _, f in cut], end - start,
                     (min(firsts) - start) if firsts else None, kv, fw.steps, fw.forward_tokens, fw.forward_s,
                     setup_s, extra={"cb_config": cb_kwargs})  # fmt: skip


def build_cb_impl(model, opts: EngineOptions):
    from cb_impl.config import EngineConfig
    from cb_impl.engine import LLMEngine

    return LLMEngine(model, EngineConfig(num_blocks=opts.num_blocks, max_batch_tokens=opts.max_batch_tokens))


def run_cb_impl(model, requests: list[RolloutRequest], opts: EngineOptions, engine=None) -> EngineRun:
    """``engine.generate(requests)``; its ``step`` is wrapped on the instance to clock the end of the first step."""
    t_setup = time.perf_counter()
    engine = engine or build_cb_impl(model, opts)
    setup_s = time.perf_counter() - t_setup
    first_step_end: list[float] = []
    step = engine.step

    def timed_step():
        out = step()
        if not first_step_end:
            first_step_end.append(clock(opts.device))
        return out

    engine.step = timed_step
    try:
        with count_forwards(model, opts.device, time_forwards=opts.time_forwards) as fw, torch.no_grad():
            start = clock(opts.device)
            rollouts = engine.generate(requests)
            end = clock(opts.device)
    finally:
        del engine.step
    stats = {k: v for k, v in engine.stats.items() if isinstance(v, int | float | str)}
    if stats.get("num_blocks"):
        stats["kv_peak_used_bytes"] = stats["kv_cache_bytes"] * stats["peak_used_blocks"] // stats["num_blocks"]
    return EngineRun("cb_impl", [list(x.completion_ids) for x in rollouts], [x.finish_reason for x in rollouts],
                     end - start, first_step_end[0] - start if first_step_end else None, stats.get("kv_cache_bytes"),
                     fw.steps, fw.forward_tokens, fw.forward_s, setup_s,
                     extra={"stats": stats})  # fmt: skip


RUNNERS = {"generate": run_generate, "transformers-cb": run_transformers_cb, "cb_impl": run_cb_impl}
