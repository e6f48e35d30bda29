"""Every engine agrees with the reference whatever its own configuration (``strategies.engine_configurations``):
block/page sizes, caches tight enough to preempt, batch-token budgets small enough to chunk prefills, batch sizes,
seeds. Tokens are compared where comparable (greedy, or spec sampling); log-probs always, teacher-forced on the
engine's own tokens; results must be complete, ordered and follow the EOS/length conventions.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cbverify import report
from cbverify.engines import get_engine
from cbverify.tolerances import FP32
from property_tests.strategies import engine_configurations, rollout_requests
from reference import generate as ref_gen

ENGINES = ("cb_impl", "hf-generate", "transformers-cb")


@pytest.fixture(scope="module")
def llama_model(llama):
    return llama.model


@pytest.mark.parametrize("name", ENGINES)
@given(
    requests=rollout_requests(max_requests=3, max_prompt_len=16, max_new_tokens=(1, 8), group_size=(1, 2)),
    data=st.data(),
)
def test_every_engine_matches_the_reference_under_any_of_its_configurations(name, llama_model, requests, data):
    options = data.draw(engine_configurations(engine=name, max_sequence_len=24), label="options")
    engine = get_engine(name, llama_model, **options)
    row = report.evaluate_engine(
        engine, llama_model, requests, ref_gen.generate(llama_model, requests), FP32, repro=f"{options}"
    )
    assert row.status == "PASS", "\n".join(row.problems + row.divergences)
