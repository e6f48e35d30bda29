"""The oracle behind the Engine protocol: ``reference.generate.generate`` (full recompute, one request at a time)."""

from __future__ import annotations

from collections.abc import Sequence

from cbverify.devices import oracle_attention
from cbverify.engines import Capabilities, check_unique_ids
from reference import generate as reference_generate
from reference.spec import Rollout, RolloutRequest


class ReferenceEngine:
    """Exact spec sampling, processed log-probs, batch-invariant by construction (there is no batch)."""

    name = "reference"
    capabilities = Capabilities(
        spec_sampling=True,
        per_request_max_new_tokens=True,
        per_request_sampling=True,
        per_request_eos=True,
        logprob_semantics="processed",
        claims_batch_invariance=True,
        follows_weight_updates=True,  # it runs the caller's model object
    )

    def __init__(self, model) -> None:
        self.model = model

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        check_unique_ids(self.name, requests)
        with oracle_attention():  # no per-shape cuDNN plans (cbverify.devices)
            return reference_generate.generate(self.model, list(requests))
