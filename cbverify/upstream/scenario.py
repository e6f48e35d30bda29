"""One drawn configuration of a TRL trainer run (:class:`TrainerScenario`) and how it becomes a real trainer.

A scenario names the trainer (``grpo`` / ``rloo``), the generation path and every knob the upstream invariants vary.
:func:`build_trainer` turns it into a ``GRPOTrainer`` / ``RLOOTrainer`` of the installed TRL (1.0 to 1.16; its
config through :func:`cbverify.upstream.trl_compat.config`, which refuses a field the release lacks) that runs offline
on a local model object: ``datasets.Dataset.from_list``, ``report_to="none"``, ``use_cpu`` on CPU, no hub.

Paths:

- ``generate``: TRL's default, ``model.generate()`` on a left-padded batch;
- ``cb``: ``use_transformers_continuous_batching=True`` (TRL 1.7+) with a small explicit
  ``transformers_continuous_batching_config`` (``num_blocks`` / ``max_batch_tokens``: the defaults reserve GBs on CPU);
- ``rollout_func``: a ``rollout_func`` backed by an engine (``cb_impl`` when it exists, else the reference generator),
  built by :mod:`cbverify.upstream.rollout`;
- ``vllm``: ``use_vllm=True, vllm_mode="colocate"`` (vLLM in the trainer's process; it needs the ``vllm`` environment:
  ``cbverify upstream --run --path vllm`` runs there). The sampler is made *off-policy by a known amount*: vLLM loads
  the policy's weights plus seeded Gaussian noise (``sampler_noise``, see :func:`cbverify.upstream.run.run_scenario`)
  and TRL's weight sync is held off, so the importance-sampling correction has real ratios to correct.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from dataclasses import asdict, dataclass, field

from reference import tasks
from reference.loss import IS_MODES, LOSS_TYPES

PATHS = ("generate", "cb", "rollout_func", "vllm")
TRAINERS = ("grpo", "rloo")


@dataclass(frozen=True, slots=True)
class TrainerScenario:
    """Everything one trainer run depends on; ``repr`` is a complete repro."""

    path: str = "generate"
    trainer: str = "grpo"
    num_generations: int = 2
    num_prompts: int = 2  # prompts per generation batch; the batch is num_prompts * num_generations completions
    max_completion_length: int = 6
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    greedy: bool = False  # generation_kwargs={"do_sample": False} (vllm: {"temperature": 0.0}, vLLM's greedy)
    bf16: bool = False
    gradient_accumulation_steps: int = 1
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    is_correction: bool = False  # vllm_importance_sampling_correction (TRL's only IS-correction switch)
    is_mode: str = "sequence_mask"
    cb_return_logprobs: bool = False  # transformers_continuous_batching_config["return_logprobs"]
    max_steps: int = 1
    seed: int = 0
    evaluate: bool = False  # run trainer.evaluate() instead of trainer.train()
    rollout_backend: str = "cb_impl"  # rollout_func path: "cb_impl" or "reference" (ignored on other paths)
    reward: str = "arithmetic"  # the first reward function, a name in REWARDS
    extra_cb_config: tuple[tuple[str, object], ...] = field(default=())
    # the trainer's math and bookkeeping (GRPOConfig fields of the same names; None = TRL's default)
    more_rewards: tuple[str, ...] = ()  # further reward functions after ``reward``, names in REWARDS
    reward_weights: tuple[float, ...] | None = None
    scale_rewards: str = "group"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    num_iterations: int = 1
    steps_per_generation: int | None = None  # None: gradient_accumulation_steps
    per_device_train_batch_size: int | None = None  # None: num_prompts * num_generations
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0
    max_grad_norm: float = 1.0
    is_clip_min: float | None = None  # vllm_importance_sampling_clip_min (TRL applies IS correction with vLLM only)
    is_clip_max: float = 3.0
    max_terms: int = 3  # operands per arithmetic prompt: 2 gives answers short enough to end on EOS
    use_bias_correction_kl: bool | None = None  # GRPO; None: the release's default (False before trl 1.10, then True)
    normalize_advantages: bool = False  # RLOOConfig only
    reward_clip_range: tuple[float, float] | None = None  # RLOOConfig only
    sampler_noise: float = 0.0  # vllm path: std of the seeded noise on the sampler's copy of the weights
    sampler_dtype: str | None = None  # vllm path: None = as TRL builds vLLM (dtype "auto"); else forced (our patch)
    nproc: int = 1  # data-parallel processes (cbverify.upstream.distributed); batch sizes are per process
    # the model's architecture and tokenizer with seeded random weights (reference.models.random_like, seed 0): a
    # trained checkpoint can be confident enough that a group's members sample one completion (zero advantages)
    random_weights: bool = False
    # build (and release) a bf16 trainer of this configuration first, in the same process, as a sweep or a notebook
    # does: what the run's trainer inherits from it is what ``trainer_precision_follows_its_config`` judges
    after_bf16_trainer: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.path in PATHS, f"path must be one of {PATHS}, got {self.path!r}"),
            (self.trainer in TRAINERS, f"trainer must be one of {TRAINERS}, got {self.trainer!r}"),
            (self.num_generations >= 2, f"num_generations must be >= 2 (a group), got {self.num_generations}"),
            (self.num_prompts >= 1, f"num_prompts must be >= 1, got {self.num_prompts}"),
            (self.max_completion_length >= 1, f"max_completion_length must be >= 1, got {self.max_completion_length}"),
            (self.temperature > 0, f"temperature must be > 0 (TRL divides by it), got {self.temperature}"),
            (self.top_k >= 0 and 0 < self.top_p <= 1 and 0 <= self.min_p <= 1, "invalid top_k / top_p / min_p"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1"),
            (self.loss_type in LOSS_TYPES, f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}"),
            (self.importance_sampling_level in ("token", "sequence"), "importance_sampling_level: token|sequence"),
            (self.is_mode in IS_MODES, f"is_mode must be one of {IS_MODES}, got {self.is_mode!r}"),
            (self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}"),
            (self.rollout_backend in ("cb_impl", "reference"), "rollout_backend: cb_impl|reference"),
            (self.sampler_noise >= 0 and (self.path == "vllm" or not self.sampler_noise),
             "sampler_noise must be >= 0, and only the vllm path has a sampler of its own"),
            (self.sampler_dtype in (None, "float32", "bfloat16") and (self.path == "vllm" or not self.sampler_dtype),
             "sampler_dtype: None|float32|bfloat16, on the vllm path only"),
            (all(r in REWARDS for r in self.reward_names), f"rewards must be in {sorted(REWARDS)}"),
            (self.reward_weights is None or len(self.reward_weights) == len(self.reward_names),
             "reward_weights needs one weight per reward function"),
            (self.scale_rewards in ("group", "batch", "none"), "scale_rewards: group|batch|none"),
            (self.num_iterations >= 1 and (self.steps_per_generation or 1) >= 1, "num_iterations, steps >= 1"),
            (self.nproc >= 1 and self.generation_batch_size * self.nproc % self.num_generations == 0,
             f"the global generation batch ({self.generation_batch_size} x {self.nproc} processes) must be a multiple "
             "of num_generations"),
            (0.0 <= self.top_entropy_quantile <= 1.0, "top_entropy_quantile must be in [0, 1]"),
            (not (self.after_bf16_trainer and self.bf16), "after_bf16_trainer needs a float32 (bf16=False) scenario"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def batch_size(self) -> int:
        """Rows per micro-batch (``per_device_train_batch_size``)."""
        return self.per_device_train_batch_size or self.num_prompts * self.num_generations

    @property
    def spg(self) -> int:
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def generation_batch_size(self) -> int:
        return self.batch_size * self.spg

    @property
    def reward_names(self) -> tuple[str, ...]:
        return (self.reward, *self.more_rewards)

    def describe(self) -> str:
        """A short one-line label: the path, its rollout backend, and the fields that differ from the defaults."""
        default = TrainerScenario()
        named = ("path", "rollout_backend") if self.path == "rollout_func" else ("path",)
        changed = {k: v for k, v in asdict(self).items() if getattr(default, k) != v or k in named}
        return ", ".join(f"{k}={v}" for k, v in changed.items())


def make_dataset(scenario: TrainerScenario):
    """Enough arithmetic prompts (plain text, no chat template) for every generation batch of ``max_steps`` steps, on
    every process of a data-parallel run (``nproc``: the global batch is that many times the per-device one, and a
    group may span processes)."""
    from datasets import Dataset

    micro_steps = scenario.max_steps * scenario.gradient_accumulation_steps
    generations = -(-micro_steps // (scenario.spg * scenario.num_iterations))
    num = -(-scenario.generation_batch_size * scenario.nproc // scenario.num_generations) * generations
    problems = tasks.make_problems(num, seed=scenario.seed, max_terms=scenario.max_terms)
    return Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])


def arithmetic_reward(prompts, completions, completion_ids, answer, **_) -> list[float]:
    """Correct answer ending on EOS scores 1, plus two small deterministic terms so that every group has reward
    variance (otherwise every advantage, loss and gradient is 0 and the numeric checks see nothing): one from the
    tokens, one from the row's position (a trained model often samples identical completions within a group)."""
    out = []
    for i, (ids, gold) in enumerate(zip(completion_ids, answer, strict=True)):
        problem_ok = bool(ids) and ids[-1] == tasks.EOS_ID and tasks.parse_answer(tasks.decode(ids)) == gold
        out.append(float(problem_ok) + (sum(ids) % 7) / 7.0 + 0.25 * (i % 3))
    return out


def constant_reward(prompts, **_) -> list[float]:
    """5/7 for everything: a float32 sum of three 5/7 is inexact, so a group mean of them is not 5/7 exactly."""
    return [5.0 / 7.0] * len(prompts)


def token_sum_reward(prompts, completions, completion_ids, **_) -> list[float]:
    """``(sum of the token ids mod 11) / 11``: a function of the completion alone, varied on any model with some
    entropy (the multi-process scenarios use it: :func:`arithmetic_reward`'s position term reads the row's index on its
    process, which changes with the process layout)."""
    return [(sum(ids) % 11) / 11.0 for ids in completion_ids]


def length_reward(prompts, completions, completion_ids, **_) -> list[float]:
    """Shorter is better: ``-len / 8``."""
    return [-len(ids) / 8.0 for ids in completion_ids]


def digit_reward(prompts, completions, completion_ids, **_) -> list[float | None]:
    """The number of digits in the completion, or ``None`` (not scored) when it holds none."""
    return [float(sum(ch.isdigit() for ch in text)) or None for text in completions]


def parity_reward(prompts, completions, completion_ids, **_) -> list[float | None]:
    """1 for an even token sum, ``None`` (not scored) for an odd one: about half the rows go unscored."""
    return [1.0 if sum(ids) % 2 == 0 else None for ids in completion_ids]


def unscored_reward(prompts, **_) -> list[None]:
    """Scores nothing (a reward function that applies to none of the rows)."""
    return [None] * len(prompts)


def unscorable_reward(prompts, completions, completion_ids, answer, **_) -> list[float | None]:
    """:func:`arithmetic_reward`, except that every third completion is unscorable: ``None``, which TRL accepts from
    a reward function (it becomes NaN)."""
    scores = arithmetic_reward(prompts, completions, completion_ids, answer)
    return [None if i % 3 == 2 else score for i, score in enumerate(scores)]


REWARDS = {"arithmetic": arithmetic_reward, "constant": constant_reward, "length": length_reward,
           "token_sum": token_sum_reward,
           "digits": digit_reward, "parity": parity_reward, "unscored": unscored_reward,
           "unscorable": unscorable_reward}  # fmt: skip


def _common_args(scenario: TrainerScenario, output_dir: str) -> dict:
    import torch

    args = dict(
        output_dir=output_dir, report_to="none", use_cpu=not torch.cuda.is_available(), bf16=scenario.bf16,
        per_device_train_batch_size=scenario.batch_size, per_device_eval_batch_size=scenario.batch_size,
        gradient_accumulation_steps=scenario.gradient_accumulation_steps, num_generations=scenario.num_generations,
        max_completion_length=scenario.max_completion_length, temperature=scenario.temperature,
        top_k=scenario.top_k, top_p=scenario.top_p, min_p=scenario.min_p or None,
        repetition_penalty=scenario.repetition_penalty, max_steps=scenario.max_steps, seed=scenario.seed,
        save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=1e-3, beta=scenario.beta,
        max_grad_norm=scenario.max_grad_norm,
    )  # fmt: skip
    if scenario.greedy:
        # TRL hands generation_kwargs to the backend: transformers' GenerationConfig, or vLLM's SamplingParams (which
        # has no do_sample: it raises on one)
        args["generation_kwargs"] = {"temperature": 0.0} if scenario.path == "vllm" else {"do_sample": False}
    if scenario.path == "cb":
        cb = {"num_blocks": 32, "max_batch_tokens": 128, "return_logprobs": scenario.cb_return_logprobs}
        cb.update(dict(scenario.extra_cb_config))
        args.update(use_transformers_continuous_batching=True, transformers_continuous_batching_config=cb)
    if scenario.path == "vllm":  # on CPU the memory fraction is of RAM: vLLM's default 0.9 refuses to start
        args.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_enable_sleep_mode=False)
    return args


def _math_args(scenario: TrainerScenario) -> dict:
    """The trainer's math fields (GRPO's or RLOO's); a field left at TRL's default is not passed (older releases may
    lack it)."""
    from cbverify.upstream import trl_compat

    args = dict(epsilon=scenario.epsilon, num_iterations=scenario.num_iterations)
    optional = dict(
        epsilon_high=scenario.epsilon_high,
        steps_per_generation=scenario.steps_per_generation,
        reward_weights=list(scenario.reward_weights) if scenario.reward_weights else None,
        mask_truncated_completions=scenario.mask_truncated_completions or None,
    )
    if scenario.trainer == "rloo":
        optional.update(normalize_advantages=scenario.normalize_advantages or None,
                        reward_clip_range=scenario.reward_clip_range)  # fmt: skip
    else:
        default_max = 3.0  # the upper IS bound's default (vllm_importance_sampling_clip_max, or _cap before trl 1.6)
        is_bounds = trl_compat.is_bound_attributes(scenario.is_clip_min, scenario.is_clip_max)
        optional.update(
            scale_rewards=scenario.scale_rewards,
            delta=scenario.delta,
            use_bias_correction_kl=scenario.use_bias_correction_kl,
            top_entropy_quantile=None if scenario.top_entropy_quantile == 1.0 else scenario.top_entropy_quantile,
            **{name: None if value == default_max else value for name, value in is_bounds.items()},
        )
    return args | {k: v for k, v in optional.items() if v is not None}


@contextlib.contextmanager
def own_precision_environment():
    """Each run starts from the caller's ``ACCELERATE_MIXED_PRECISION`` and leaves it as it found it.

    transformers 4.x's ``TrainingArguments(bf16=True)`` writes ``bf16`` there, and every later ``TrainingArguments``
    of the process reads it as its default (the registered ``bf16-config-leaks-into-later-trainers``): without this,
    a suite's float32 scenarios after its first bf16 one would all run in bf16 autocast, and be judged on it. The
    leak itself is judged where a scenario asks for it (``after_bf16_trainer``)."""
    name = "ACCELERATE_MIXED_PRECISION"
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def build_trainer(scenario: TrainerScenario, model, tokenizer, rollout_func=None):
    """A real TRL trainer for ``scenario`` on ``model`` (trained in place: pass a copy you can spare). Its
    ``output_dir`` (a ``cbverify-trl-*`` temporary folder: the trainer creates it, ``save_strategy="no"`` leaves it
    empty) is removed when the trainer is garbage-collected or the interpreter exits, or at once by
    :func:`release_trainer`; when the trainer cannot be built, before the error propagates."""
    output_dir = tempfile.mkdtemp(prefix="cbverify-trl-")
    try:
        trainer = _build_trainer(scenario, model, tokenizer, rollout_func, output_dir)
    except BaseException:
        shutil.rmtree(output_dir, ignore_errors=True)
        raise
    trainer._cbverify_output_dir = weakref.finalize(trainer, shutil.rmtree, output_dir, ignore_errors=True)
    return trainer


def release_trainer(trainer) -> None:
    """Remove the output folder :func:`build_trainer` made for ``trainer`` now (the trainer is not used after)."""
    finalizer = getattr(trainer, "_cbverify_output_dir", None)
    if finalizer is not None:
        finalizer()


def _build_trainer(scenario: TrainerScenario, model, tokenizer, rollout_func, output_dir: str):
    from cbverify.upstream import trl_compat

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's "experimental" banner, every run
    args = config_args(scenario, output_dir)
    dataset = make_dataset(scenario)
    rewards = [REWARDS[name] for name in scenario.reward_names]
    common = dict(model=model, reward_funcs=rewards, train_dataset=dataset, processing_class=tokenizer)
    if scenario.evaluate:
        common["eval_dataset"] = dataset
    if scenario.trainer == "grpo":
        from trl import GRPOTrainer

        if rollout_func is not None:  # a release before trl 0.25 takes no rollout_func argument at all
            common["rollout_func"] = rollout_func
        return GRPOTrainer(args=trl_compat.config("grpo", **args), **common)
    if rollout_func is not None:
        trl_compat.require_path("rloo", "rollout_func")
    from trl import RLOOTrainer

    return RLOOTrainer(args=trl_compat.config("rloo", **args), **common)


def config_args(scenario: TrainerScenario, output_dir: str) -> dict:
    """The keyword arguments of the trainer's config for ``scenario`` (``GRPOConfig`` / ``RLOOConfig``); a field the
    installed release lacks is refused when the config is built (:func:`cbverify.upstream.trl_compat.config`)."""
    from cbverify.upstream import trl_compat

    args = _common_args(scenario, output_dir)
    if scenario.trainer == "grpo":
        args.update(loss_type=scenario.loss_type, importance_sampling_level=scenario.importance_sampling_level,
                    vllm_importance_sampling_correction=scenario.is_correction)  # fmt: skip
        if scenario.is_correction or "vllm_importance_sampling_mode" in trl_compat.fields("grpo"):
            args["vllm_importance_sampling_mode"] = scenario.is_mode  # before trl 0.26 no field: one mode, unnamed
    return args | _math_args(scenario)
