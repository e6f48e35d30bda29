"""Our continuous-batching engine (``cb_impl.engine.LLMEngine``) behind the Engine protocol.

It claims everything the spec asks for: counter-based (spec) sampling, per-request parameters, processed log-probs,
and batch invariance of tokens (the noise is a function of seed and position, not of the batch). Options are the
fields of ``cb_impl.config.EngineConfig`` (``block_size``, ``num_blocks``, ``max_batch_tokens``, ``max_num_seqs``,
``enable_prefix_sharing``, ...); on CPU pass a small ``num_blocks`` (the default sizes the cache from free memory).
A model the engine refuses at construction (``cb_impl.support.UnsupportedModel``: a feature it does not implement)
raises :class:`NotApplicable` with the engine's reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from cbverify.engines import Capabilities, EngineError, NotApplicable, check_unique_ids
from reference.spec import Rollout, RolloutRequest


class CbImplEngine:
    """Adapter over ``cb_impl.engine.LLMEngine``; ``stats`` exposes the engine's own counters after each call."""

    name = "cb_impl"
    capabilities = Capabilities(
        spec_sampling=True,
        per_request_max_new_tokens=True,
        per_request_sampling=True,
        per_request_eos=True,
        logprob_semantics="processed",
        claims_batch_invariance=True,
    )

    def __init__(self, model, **config) -> None:
        from cb_impl.config import EngineConfig
        from cb_impl.engine import LLMEngine
        from cb_impl.support import UnsupportedModel

        self.config = EngineConfig(**config)
        try:
            self.engine = LLMEngine(model, self.config)
        except UnsupportedModel as err:
            raise NotApplicable(self.name, str(err)) from err

    @property
    def stats(self) -> dict:
        return dict(getattr(self.engine, "stats", {}))

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        check_unique_ids(self.name, requests)
        rollouts = list(self.engine.generate(list(requests)))
        if len(rollouts) != len(requests):
            raise EngineError(f"{self.name}: {len(rollouts)} rollouts for {len(requests)} requests")
        return rollouts
