"""A faulty vLLM adapter, served by the worker inside the vLLM environment (so it imports nothing but the adapter).

``RawLogprobsDeclaredProcessed`` runs vLLM with its default ``logprobs_mode="raw_logprobs"`` (what TRL's vLLM path
gets) while declaring ``processed`` semantics: the log-probs of every sampled request at a temperature other than 1
or under a top-k / top-p / min-p cut are then off, which ``cbverify verify`` must turn into a FAIL row.
"""

from __future__ import annotations

from cbverify.engines.vllm_engine import VLLMEngine


class RawLogprobsDeclaredProcessed(VLLMEngine):
    def __init__(self, model_path: str, **options) -> None:
        super().__init__(model_path, **{**options, "logprobs_mode": "raw_logprobs"})
        self.capabilities = type(self.capabilities)(**{**_fields(self.capabilities), "logprob_semantics": "processed"})


def _fields(capabilities) -> dict:
    return {name: getattr(capabilities, name) for name in capabilities.__dataclass_fields__}
