"""Upstream-integration invariants as Hypothesis properties over drawn trainer configurations.

Each example drives TRL 1.16's real GRPOTrainer / RLOOTrainer for a step on the bundled arithmetic Llama and runs
every check of :data:`cbverify.upstream.suite.CHECKS`; a FAIL is allowed only where the findings registry covers it.
Trainer-backed examples cost 1-3 s each on 2 CPU cores, so these properties take one sixth of the profile's
``max_examples`` (ci: 8, dev: 2, thorough: 83).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from cbverify.upstream.scenario import TrainerScenario
from cbverify.upstream.suite import check_scenario, greedy_agreement, judge
from property_tests.strategies import trainer_scenarios

pytestmark = pytest.mark.upstream

TRAINER_EXAMPLES = max(2, settings.default.max_examples // 6)
# No shrinking: shrinking a trainer run costs minutes, and a drawn scenario's repr is already a complete repro.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


@settings(max_examples=TRAINER_EXAMPLES, phases=NO_SHRINK)
@given(scenario=trainer_scenarios(bf16=None))
@example(  # found by this property: greedy groups of 3 equal fractional rewards (float32-group-mean finding)
    scenario=TrainerScenario(
        path="rollout_func",
        num_generations=3,
        num_prompts=1,
        max_completion_length=7,
        temperature=0.7,
        greedy=True,
        seed=1277,
        rollout_backend="reference",
    )
)
def test_trainer_paths_keep_every_invariant_on_drawn_configurations(llama, scenario: TrainerScenario):
    model, tokenizer = llama
    results = check_scenario(scenario, model, tokenizer)
    judged = [(r, *judge(r, scenario, model.config.model_type)) for r in results]
    bad = [f"{label}: {r.check} on {r.path}: {r.reason}" for r, ok, label in judged if not ok]
    assert not bad, "\n".join(bad) + f"\nrepro: {scenario!r}"


@settings(max_examples=max(2, TRAINER_EXAMPLES // 3), phases=NO_SHRINK)
@given(
    num_prompts=st.integers(1, 2),
    num_generations=st.integers(2, 3),
    max_completion_length=st.integers(1, 10),
    seed=st.integers(0, 2**16),
)
def test_greedy_decoding_gives_the_same_completions_on_every_path(
    llama, num_prompts: int, num_generations: int, max_completion_length: int, seed: int
):
    base = TrainerScenario(
        greedy=True, num_prompts=num_prompts, num_generations=num_generations,
        max_completion_length=max_completion_length, seed=seed, rollout_backend="reference",
    )  # fmt: skip
    result = greedy_agreement(*llama, base=base)
    assert result.status == "PASS", f"{result.reason} [{base!r}]"
