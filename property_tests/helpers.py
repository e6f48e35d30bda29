"""Assertions shared by the property tests (one way to say "matches the reference"), the GRPO batch several of them
run, and a stand-in model whose logits are a fixed table."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch

from cbverify.compare import check_conventions, check_results, compare_tokens
from cbverify.tolerances import FP32, Tier, logprob_scale
from reference import tasks
from reference.generate import generate as reference_generate
from reference.spec import Rollout, RolloutRequest, SamplingParams

# Measurements tests report without asserting (e.g. batch invariance an engine does not claim); the root conftest
# prints them in pytest's terminal summary.
SUMMARY: list[str] = []


def assert_matches_reference(
    model,
    requests: Sequence[RolloutRequest],
    rollouts: Sequence[Rollout],
    *,
    engine: str,
    expected: Sequence[Rollout] | None = None,
    tier: Tier = FP32,
    repro: str = "",
    logprobs: bool = True,
    conventions: bool = True,
) -> None:
    """``rollouts`` (an engine's, for ``requests``) against the oracle's (``expected``, generated when omitted).

    Results complete and in request order; each rollout follows the EOS / length conventions (``conventions``);
    tokens identical, or diverging only at an accepted near-tie of ``tier`` (reported as a warning); with
    ``logprobs``, the engine's log-probs within ``tier.logprob_max_abs`` of the oracle's on the common prefix (in logit
    units: scaled by ``tolerances.logprob_scale``, as every verdict of the harness is), and the same finish reason when
    the tokens agree.
    """
    expected = reference_generate(model, list(requests)) if expected is None else expected
    assert not check_results(requests, rollouts), check_results(requests, rollouts)
    for request, ours, ref in zip(requests, rollouts, expected, strict=True):
        if conventions:
            assert not check_conventions(request, ours), check_conventions(request, ours)
        divergence = compare_tokens(model, request, ref, ours, engine=engine, tier=tier, repro=repro)
        if divergence is not None:
            assert divergence.accepted, divergence.describe()
            warnings.warn(f"near-tie divergence: {divergence.describe()}", stacklevel=2)
        if not logprobs:
            continue
        common = divergence.position if divergence is not None else len(ref.logprobs)
        scale = logprob_scale(request.sampling)  # a temperature below 1 amplifies the logits' float32 noise
        diffs = [abs(a - b) * scale for a, b in zip(ours.logprobs[:common], ref.logprobs[:common], strict=True)]
        assert max(diffs, default=0.0) <= tier.logprob_max_abs, (request.request_id, max(diffs), repro)
        if divergence is None:
            assert ours.finish_reason == ref.finish_reason, (request.request_id, ours, ref)


def grpo_trainer_generation_config(config):
    """The ``GenerationConfig`` a real ``GRPOTrainer`` builds from ``config`` (on the bundled Llama, no training)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from reference.models import load

    model, tokenizer = load("tiny-llama-arith")
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
        train_dataset=Dataset.from_list([{"prompt": "Q:1+2\n"}] * 4), processing_class=tokenizer,
    )  # fmt: skip
    return trainer.generation_config


def _vllm_problem() -> str | None:
    from cbverify.engines import envs

    return envs.problem("vllm")


needs_vllm = pytest.mark.skipif(_vllm_problem() is not None, reason=str(_vllm_problem()))


def grpo_batch(num_prompts: int, group: int, max_new_tokens: int) -> list[RolloutRequest]:
    """GRPO groups of arithmetic prompts: ``group`` sampled requests per prompt, distinct seeds, EOS ends them."""
    problems = tasks.make_problems(num_prompts, seed=11)
    sampling = SamplingParams(temperature=1.0, top_k=10, top_p=0.95, max_new_tokens=max_new_tokens)
    return [RolloutRequest(f"p{p}-g{g}", tuple(tasks.prompt_ids(prob)), sampling, seed=1000 * p + g,
                           eos_token_ids=(tasks.EOS_ID,))
            for p, prob in enumerate(problems) for g in range(group)]  # fmt: skip


class TableModel(torch.nn.Module):
    """A stand-in causal LM: the logits at sequence position t are row t of a fixed (T, V) table, whatever the ids."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table.to(torch.float32)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the model a device
        self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(vocab_size=table.shape[1]))

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.table[: input_ids.shape[1]].unsqueeze(0))
