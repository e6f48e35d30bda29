"""cb_impl: our continuous-batching rollout engine (nano-vllm-style decomposition).

``config`` (EngineConfig) -> ``sequence`` / ``block_manager`` / ``scheduler`` (pure-Python bookkeeping, no torch) ->
``kv_cache`` / ``attention`` (paged KV routed through transformers' AttentionInterface) -> ``sampler`` (spec sampling)
-> ``model_runner`` (one packed forward per step) -> ``engine`` (LLMEngine) -> ``trl`` (GRPOTrainer rollout_func).
Imports from ``reference``: the public names of ``reference.spec`` only (docs/architecture.md).
"""
