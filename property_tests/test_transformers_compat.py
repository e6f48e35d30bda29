"""The transformers continuous-batching compatibility layer against the *installed* release.

``cbverify matrix`` runs this file in every version's venv (5.8 on), so each property here is checked on each
release: the layer's names reach the installed ``ContinuousBatchingConfig``, a missing option is refused (never
dropped), seeding means the same everywhere, and the adapter and the fuzzer's driver produce the oracle's tokens
under a KV cache small enough to evict, with the evictions counted.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation import ContinuousBatchingConfig

from cbverify.engines import get_engine
from cbverify.engines import transformers_compat as compat
from property_tests.helpers import assert_matches_reference
from reference.spec import RolloutRequest, SamplingParams

pytestmark = pytest.mark.upstream


def _requests(n: int, *, greedy: bool, new: int = 12) -> list[RolloutRequest]:
    sampling = SamplingParams(temperature=0.0 if greedy else 1.3, top_k=0, top_p=1.0, max_new_tokens=new)
    return [
        RolloutRequest(f"r{i}", tuple(range(3 + i, 3 + i + 19)), sampling, seed=i, eos_token_ids=()) for i in range(n)
    ]


def test_every_option_the_project_passes_reaches_the_installed_config():
    options = dict(page_size=8, num_blocks=12, max_batch_tokens=16, scheduler_type="fifo", allow_block_sharing=False,
                   return_logprobs=True, per_request_processors=True, seed=3)  # fmt: skip
    config = ContinuousBatchingConfig(**compat.config_kwargs(**options))
    assert getattr(config, compat.PAGE_FIELD) == 8 and config.num_blocks == 12 and config.max_batch_tokens == 16
    assert config.return_logprobs and config.per_request_processors
    if "seed" in compat.FIELDS:
        assert config.seed == 3


def test_an_option_the_release_lacks_is_refused_with_its_name_and_the_version():
    with pytest.raises(compat.MissingFeature, match=rf"transformers {compat.VERSION}.*'not_an_option'"):
        compat.config_kwargs(not_an_option=1)
    assert compat.config_kwargs(not_an_option=None) == {}, "the default (None) of an absent option asks for nothing"


def test_seeded_managers_sample_the_same_and_different_seeds_do_not(llama):
    def sampled(seed: int) -> list:
        engine = get_engine("transformers-cb", llama.model, seed=seed, page_size=8, max_batch_tokens=64)
        return [r.completion_ids for r in engine.generate(_requests(4, greedy=False))]

    first = sampled(11)
    assert sampled(11) == first, "one seed, one stream: the manager must be seeded the same on every release"
    assert sampled(12) != first, "a different seed drew the same 48 tokens: the seed does not reach the sampler"


def test_adapter_under_eviction_pressure_matches_the_oracle_and_counts_evictions(llama):
    requests = _requests(4, greedy=True)
    # each request needs ceil((19 + 12) / 4) = 8 pages: 9 pages hold one request, so the others wait or are evicted
    engine = get_engine("transformers-cb", llama.model, page_size=4, num_blocks=9, max_batch_tokens=8)
    rollouts = engine.generate(requests)
    assert_matches_reference(llama.model, requests, rollouts, engine="transformers-cb", logprobs=False)
    assert "evictions" in engine.last_run.extra, "verify reports the count of every transformers-cb run"
    with compat.count_evictions() as evictions:
        many = _requests(6, greedy=True, new=24)
        rollouts = get_engine(
            "transformers-cb", llama.model, page_size=4, num_blocks=12, max_batch_tokens=32
        ).generate(many)
    assert_matches_reference(llama.model, many, rollouts, engine="transformers-cb", logprobs=False)
    assert evictions[0] > 0, "6 requests growing to 11 pages each in 12 pages: at least one must have been evicted"


def test_the_global_rng_and_the_model_mode_survive_a_call(llama):
    before = torch.get_rng_state().clone()
    get_engine("transformers-cb", llama.model, page_size=8).generate(_requests(2, greedy=False))
    assert torch.equal(before, torch.get_rng_state()) and not llama.model.training
