"""``LLMEngine``: continuous batching over a paged KV cache; ``step()`` = schedule -> run -> sample -> postprocess.

Contract (``reference.spec``): ``generate(requests)`` returns one ``Rollout`` per request in request order, identical
to ``reference.generate.generate(model, requests)`` under the fp32 tolerance tier, whatever the batch composition,
arrival order, block size, chunking, memory budget (preemption) and prompt sharing. Bad input raises ``ValueError``
before any work, and so does a model with a feature the engine does not implement (``cb_impl.support``). A model
error during a step fails the requests of that step with that error (:class:`EngineStepError`), frees their blocks
and leaves the engine usable. The engine is persistent and reads the model's weights live at every step, so training
updates are seen without any sync.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import torch
from tqdm.auto import tqdm

from cb_impl.block_manager import BlockManager, blocks_for
from cb_impl.config import EngineConfig
from cb_impl.model_runner import ModelRunner, int64_tensor
from cb_impl.sampler import build_sampling_batch, sample, sampling_row
from cb_impl.scheduler import Scheduler
from cb_impl.sequence import Sequence
from cb_impl.support import check_supported
from reference.spec import Rollout, RolloutRequest, SamplingParams


def to_host(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """A step's tokens (R,) int64 and log-probs (R,) float32 as host lists, in one device-to-host copy (a float64
    tensor holds both exactly: token ids are far below 2**53, float32 widens without rounding)."""
    both = torch.cat([tokens.double(), logprobs.double()]).to("cpu", copy=True).tolist()  # (2R,)
    num = len(both) // 2
    return [int(t) for t in both[:num]], both[num:]


class EngineStepError(RuntimeError):
    """The model raised during a step; ``request_ids`` were failed and freed, the engine is still usable."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class LLMEngine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None) -> None:
        check_supported(model)  # UnsupportedModel (a ValueError) names the feature, before any work
        self.config = config if config is not None else EngineConfig()
        if not isinstance(self.config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(self.config).__name__}")
        self.model = model
        self.runner = ModelRunner(model, self.config)
        self.block_manager = BlockManager(self.runner.cache.num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.block_manager, max_batch_tokens=self.config.max_batch_tokens,
                                   max_num_seqs=self.config.max_num_seqs,
                                   enable_prefix_sharing=self.config.enable_prefix_sharing)  # fmt: skip
        self._next_seq_id = 0
        self._sampled_seqs: list[Sequence] = []  # the last step's sampled sequences; their constants and positions:
        self._sampling, self._positions = build_sampling_batch([], torch.device("cpu")), torch.zeros(0)
        self._live: dict[str, Sequence] = {}
        self.last_events: dict[str, dict[str, int]] = {}  # per request of the last generate(): its Sequence.events
        self._events: dict[str, dict[str, int]] | None = None  # where step() puts them while generate() runs
        names = ("num_steps", "num_requests", "num_forward_tokens", "num_prefill_tokens", "num_decode_tokens",
                 "num_generated_tokens", "num_failed_requests", "num_partial_prefills")  # fmt: skip
        self._counters = dict.fromkeys(names, 0)
        self._timers = {"schedule_s": 0.0, "model_s": 0.0, "sample_s": 0.0}

    # --- input checking ------------------------------------------------------------------------------------------
    def _validate(self, requests: Seq[RolloutRequest]) -> None:
        seen: set[str] = set()
        vocab, max_len, bs = self.runner.vocab_size, self.runner.max_model_len, self.config.block_size
        for r in requests:
            if not isinstance(r, RolloutRequest):
                raise ValueError(f"expected RolloutRequest, got {type(r).__name__}")
            rid = r.request_id
            if rid in seen or rid in self._live:
                raise ValueError(f"duplicate request id {rid!r}")
            seen.add(rid)
            if not r.prompt_ids:
                raise ValueError(f"request {rid!r}: empty prompt")
            bad = [t for t in r.prompt_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"request {rid!r}: token id {bad[0]} outside the vocabulary [0, {vocab})")
            s = r.sampling
            if not isinstance(s, SamplingParams):
                raise ValueError(f"request {rid!r}: sampling must be SamplingParams")
            SamplingParams.__post_init__(s)  # re-check: frozen dataclasses can be forged with object.__setattr__
            total = len(r.prompt_ids) + s.max_new_tokens
            if total > max_len:
                raise ValueError(f"request {rid!r}: prompt ({len(r.prompt_ids)}) + max_new_tokens ({s.max_new_tokens})"
                                 f" = {total} exceeds the model's context of {max_len} tokens")  # fmt: skip
            needed = blocks_for(total - 1, bs)
            if needed > self.block_manager.num_blocks:
                raise ValueError(f"request {rid!r} needs {needed} KV-cache blocks of {bs} tokens but the memory "
                                 f"budget holds {self.block_manager.num_blocks}: raise num_blocks or "
                                 "max_memory_fraction")  # fmt: skip

    # --- incremental API -----------------------------------------------------------------------------------------
    def add_request(self, request: RolloutRequest) -> None:
        """Queue one request (validated first); it runs in the following steps."""
        self._validate([request])
        self._enqueue(request)

    def _enqueue(self, r: RolloutRequest) -> None:
        seq = Sequence(self._next_seq_id, r.prompt_ids, max_new_tokens=r.sampling.max_new_tokens,
                       eos_token_ids=r.eos_token_ids, request_id=r.request_id)  # fmt: skip
        seq.sampler_row = sampling_row(r.sampling, r.seed)
        self._next_seq_id += 1
        self._live[r.request_id] = seq
        self.scheduler.add(seq)
        self._counters["num_requests"] += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Rollout]:
        """Run one step; returns the rollouts that finished during it. Raises :class:`EngineStepError` (after
        failing and freeing that step's requests) if the model raises."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        if not batch.chunks:  # an idle engine; with work left, a scheduler that cannot progress (its invariant)
            if self.has_unfinished():
                raise RuntimeError(f"the scheduler scheduled nothing with {len(self._live)} requests unfinished")
            return []
        try:
            with self.runner.attached():
                logits = self.runner.run(batch)  # (R, V)
            t2 = time.perf_counter()
            seqs, tokens, logprobs = batch.samples, [], []  # partial prefills only: nothing reaches the sampler
            if seqs:
                if seqs == self._sampled_seqs:  # the last sampled requests, each one completion token further
                    positions = self._positions + 1
                else:  # the sampling constants change with the sampled requests only
                    self._sampling = build_sampling_batch([s.sampler_row for s in seqs], logits.device)
                    positions = int64_tensor([s.num_completion_tokens for s in seqs], logits.device)  # (R,)
                self._sampled_seqs, self._positions = seqs, positions
                tuning = self.runner.tuning
                tokens, logprobs = sample(logits, self._sampling, positions, tuning.sample_budget,
                                          tuning.race_min_vocab)  # fmt: skip
                tokens, logprobs = to_host(tokens, logprobs)
        except Exception as err:
            touched = [s for s, _ in batch.chunks] + batch.samples  # and the followers of each, forked or not
            failed = list({id(s): s for s in touched + [f for s in touched for f in s.followers]}.values())
            for seq in failed:
                self.scheduler.finish(seq)
                self._live.pop(seq.request_id, None)
            self._counters["num_failed_requests"] += len(failed)
            ids = [s.request_id for s in failed]
            raise EngineStepError(f"model step failed for requests {ids}: {type(err).__name__}: {err}", ids) from err
        finished = self.scheduler.postprocess(batch, tokens, logprobs)
        c = self._counters
        c["num_steps"] += 1
        c["num_forward_tokens"] += batch.num_tokens
        c["num_decode_tokens"] += batch.num_decode_tokens
        c["num_partial_prefills"] += batch.num_partial_prefills
        c["num_prefill_tokens"] = c["num_forward_tokens"] - c["num_decode_tokens"]
        c["num_generated_tokens"] += len(tokens)
        for name, seconds in zip(self._timers, (t1 - t0, t2 - t1, time.perf_counter() - t2), strict=True):
            self._timers[name] += seconds
        for seq in finished:
            del self._live[seq.request_id]
            if self._events is not None and seq.events:
                self._events[seq.request_id] = seq.events
        return [Rollout(s.request_id, s.prompt_ids, s.completion_ids, s.logprobs, s.finish_reason) for s in finished]

    def release_cache(self) -> None:
        """Hand the KV cache's pages back while idle (a trainer's update can use them); the next step refills them."""
        if self.has_unfinished():
            raise RuntimeError("release_cache() needs an idle engine: finish or abort its requests first")
        self.runner.release()

    def abort_all(self) -> None:
        """Drop every unfinished request and free its blocks."""
        for seq in list(self._live.values()):
            self.scheduler.finish(seq)
        self._live.clear()

    # --- batch API ------------------------------------------------------------------------------------------------
    def generate(self, requests: Seq[RolloutRequest], progress: bool = False) -> list[Rollout]:
        """Complete every request; rollouts in request order. Needs an idle engine (no incremental requests).
        Afterwards ``last_events`` holds what the engine's mechanisms did to each request (``sequence.EVENTS``)."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine: finish the requests added with add_request() first")
        requests = list(requests)
        self._validate(requests)
        for r in requests:
            self._enqueue(r)
        results: dict[str, Rollout] = {}
        self._events = {}
        try:
            with self.runner.attached(), tqdm(total=len(requests), disable=not progress, desc="cb_impl") as bar:
                while self.has_unfinished():
                    done = self.step()
                    results.update((r.request_id, r) for r in done)
                    bar.update(len(done))
        except BaseException:
            self.abort_all()
            raise
        finally:
            self.last_events, self._events = self._events, None
        return [results[r.request_id] for r in requests]

    @property
    def stats(self) -> dict[str, float | int]:
        """Counters since construction: steps, tokens, chunked (partial) prefills, preemptions, sharing, attention
        padding, KV-cache size, decode graphs recorded and replayed (``cb_impl.graphs``)."""
        r, bm, g = self.runner, self.block_manager, self.runner.graphs
        waste = 1.0 - float(r.num_pairs) / r.num_padded_pairs if r.num_padded_pairs else 0.0
        return {**self._counters, "num_preemptions": self.scheduler.num_preemptions,
                "num_shared_prefills": self.scheduler.num_forks, "num_cow_copies": bm.num_cow_copies,
                "attention_padding_waste": waste, "kv_cache_bytes": r.cache.num_bytes, "num_blocks": bm.num_blocks,
                "kv_block_bytes": r.cache.block_bytes, "num_decode_graphs": g.num_recorded if g else 0,
                "num_graph_replays": g.num_replays if g else 0,
                "block_size": self.config.block_size, "peak_used_blocks": bm.peak_used_blocks,
                **{k: round(v, 6) for k, v in self._timers.items()}}  # fmt: skip
