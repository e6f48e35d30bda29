"""Observe what a TRL trainer sees by wrapping its methods on the instance; TRL itself is never edited.

Wrapped (each wrapper calls the original and records; a trainer method missing in the installed TRL raises
:class:`~cbverify.upstream.trl_compat.MissingFeature` naming it, never a silent skip; what differs between TRL
releases is read through :mod:`cbverify.upstream.trl_compat`):

- ``_generate``: the prompts, prompt ids, completion ids and sampler log-probs TRL received (picked out of its
  return value by the names TRL unpacks it into), plus a :class:`ModelSnapshot` and a probe forward before and after
  generation (also when generation raises);
- ``model.generate_batch`` (the ``cb`` path): the raw transformers ``GenerationOutput`` objects, errors included;
- ``_calculate_rewards`` and ``_generate_and_score_completions``: rewards and the scored batch (advantages,
  ``sampling_per_token_logps``, ``importance_sampling_ratio``, masks) before TRL shuffles it;
- ``_compute_loss``: the tensors entering the loss, the trainer's per-token log-probs, the loss, and reference
  teacher-forced log-probs computed on the same parameters just before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from cbverify.upstream import trl_compat

PROBE_IDS = (1, 19, 17, 4, 5, 13, 10, 22, 4, 5, 13, 10, 15, 12)  # "<bos>Q:12+7\n12+7=19"-like fixed token ids


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """Everything generation must leave untouched ("generation leaves no trace")."""

    attn_implementation: str
    config_json: str
    params: tuple[tuple[str, str, str, int, bool], ...]  # (name, dtype, device, id, requires_grad)
    training: tuple[bool, ...]  # module.training for every module, in named_modules() order
    rng_state: torch.Tensor  # (N,) uint8, torch.get_rng_state()
    probe_logits: torch.Tensor  # (T, V) float32: a forward on PROBE_IDS in the model's current mode


def unwrap(trainer):
    return trainer.accelerator.unwrap_model(trainer.model)


@torch.no_grad()
def snapshot(model) -> ModelSnapshot:
    rng = torch.get_rng_state()
    with torch.random.fork_rng(devices=[]):  # the probe forward must not consume the RNG it is measuring
        device = next(model.parameters()).device
        ids = torch.tensor([PROBE_IDS], device=device)  # (1, T)
        probe = model(input_ids=ids).logits[0].float().cpu()  # (T, V)
    config = model.config.to_dict()
    return ModelSnapshot(
        attn_implementation=str(model.config._attn_implementation),
        config_json=json.dumps(config, sort_keys=True, default=str),
        params=tuple((n, str(p.dtype), str(p.device), id(p), p.requires_grad) for n, p in model.named_parameters()),
        training=tuple(m.training for _, m in model.named_modules()),
        rng_state=rng,
        probe_logits=probe,
    )


@dataclass
class GenerationRecord:
    mode: str  # "train" | "eval"
    prompts: list
    before: ModelSnapshot
    after: ModelSnapshot | None = None
    prompt_ids: list[list[int]] | None = None
    completion_ids: list[list[int]] | None = None
    sampler_logprobs: list[list[float]] | None = None
    raw_outputs: list | None = None  # transformers GenerationOutput objects (cb path), TRL's order
    error: BaseException | None = None


@dataclass
class LossRecord:
    mode: str
    inputs: dict[str, torch.Tensor]
    per_token_logps: torch.Tensor  # (B, T) the trainer's, as computed inside _compute_loss
    reference_logps: list[torch.Tensor]  # B tensors (L_i,) from reference.logprobs.per_token_logps
    loss: float
    accumulation_steps: int
    logps_grad: list[torch.Tensor] = field(default_factory=list)  # d(loss)/d(per_token_logps), filled by backward
    entropies: torch.Tensor | None = None  # (B, T) the trainer's per-token entropies, where it computed them


@dataclass
class Capture:
    """All records of one run, in call order."""

    generations: list[GenerationRecord] = field(default_factory=list)
    rewards: list[torch.Tensor] = field(default_factory=list)  # (B, num_reward_funcs) per scored batch
    scored: list[dict] = field(default_factory=list)
    losses: list[LossRecord] = field(default_factory=list)
    run_error: BaseException | None = None
    rollout_backend: str | None = None
    trainer_info: dict = field(default_factory=dict)  # settings the checks need (EOS ids, epsilons, ...)
    sampler_model: object = None  # the weights the sampler really had, where they are not the policy's (vllm path)


def _detach(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


def _wrap_generate(trainer, capture: Capture) -> None:
    original = trainer._generate

    def wrapped(prompts, *more):  # more: the images trl 0.24 passes beside the prompts
        model = unwrap(trainer)
        record = GenerationRecord(mode="train" if trainer.model.training else "eval", prompts=list(prompts),
                                  before=snapshot(model))  # fmt: skip
        capture.generations.append(record)
        _wrap_generate_batch(model, record)
        try:
            out = original(prompts, *more)
        except BaseException as err:
            record.error = err
            raise
        finally:
            model.__dict__.pop("generate_batch", None)  # drop our instance shadow before measuring the model
            record.after = snapshot(unwrap(trainer))
        fields = trl_compat.generated(trainer, out)
        record.prompt_ids = [list(map(int, p)) for p in fields[trl_compat.PROMPT_IDS]]
        record.completion_ids = [list(map(int, c)) for c in fields[trl_compat.COMPLETION_IDS]]
        logprobs = fields.get(trl_compat.SAMPLER_LOGPROBS)  # RLOO returns none
        record.sampler_logprobs = None if logprobs is None else [list(map(float, lp)) for lp in logprobs]
        return out

    trainer._generate = wrapped


def _wrap_generate_batch(model, record: GenerationRecord) -> None:
    """Shadow ``model.generate_batch`` on the instance for this one generation (the cb path calls it)."""
    if not hasattr(model, "generate_batch"):
        return
    original = type(model).generate_batch

    def wrapped(*args, **kwargs):
        outputs = original(model, *args, **kwargs)
        record.raw_outputs = list(outputs.values())
        return outputs

    model.generate_batch = wrapped


def _wrap_scoring(trainer, capture: Capture) -> None:
    original_rewards, original_score = trainer._calculate_rewards, trainer._generate_and_score_completions

    def rewards(*args, **kwargs):
        out = original_rewards(*args, **kwargs)
        capture.rewards.append(out.detach().clone())
        return out

    def score(*args, **kwargs):
        out = original_score(*args, **kwargs)
        capture.scored.append({k: _detach(v) for k, v in out.items()})
        return out

    trainer._calculate_rewards, trainer._generate_and_score_completions = rewards, score


def _wrap_loss(trainer, capture: Capture) -> None:
    from reference.logprobs import per_token_logps as reference_logps

    original_loss, original_logps = trainer._compute_loss, trainer._get_per_token_logps_and_entropies

    def loss(model, inputs):
        seen: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []

        def logps(*args, **kwargs):
            out = original_logps(*args, **kwargs)
            seen.append(out[0].detach().clone())
            if len(out) > 1 and isinstance(out[1], torch.Tensor):
                entropies.append(out[1].detach().clone())
            if out[0].requires_grad:  # the backward pass TRL runs later hands us dL/dlogps
                out[0].register_hook(lambda g: grads.append(g.detach().clone()))
            return out

        plain = unwrap(trainer)
        prompts = rows(inputs["prompt_ids"], inputs["prompt_mask"])
        completions = rows(inputs["completion_ids"], inputs["completion_mask"])
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            ref = reference_logps(plain, prompts, completions, temperature=float(trainer.temperature))
        trainer._get_per_token_logps_and_entropies = logps
        try:
            value = original_loss(model, inputs)
        finally:
            trainer._get_per_token_logps_and_entropies = original_logps
        capture.losses.append(
            LossRecord(
                mode="train" if trainer.model.training else "eval",
                inputs={k: _detach(v) for k, v in inputs.items()},
                per_token_logps=seen[0], reference_logps=[r.cpu() for r in ref], loss=float(value.detach()),
                accumulation_steps=int(getattr(trainer, "current_gradient_accumulation_steps", 1) or 1),
                logps_grad=grads, entropies=entropies[0] if entropies else None,
            )
        )  # fmt: skip
        return value

    trainer._compute_loss = loss


def install(trainer, capture: Capture) -> None:
    """Wrap ``trainer``'s methods so that ``capture`` fills as it trains or evaluates."""
    trl_compat.require_hooks("grpo" if isinstance(trainer, trl_compat.GRPOTrainer) else "rloo")
    args = trainer.args
    capture.trainer_info = {
        "eos_ids": trl_compat.eos_token_ids(trainer),
        "scale_rewards": getattr(args, "scale_rewards", "group"),
        "epsilon_low": float(args.epsilon),
        "epsilon_high": float(args.epsilon_high if args.epsilon_high is not None else args.epsilon),
        "delta": getattr(args, "delta", None),
        "steps_per_generation": int(args.steps_per_generation or args.gradient_accumulation_steps),
        "is_clip_min": getattr(args, "vllm_importance_sampling_clip_min", None),
        "is_clip_max": getattr(
            args, "vllm_importance_sampling_clip_max", getattr(args, "vllm_importance_sampling_cap", None)
        ),
        # which process of how many (data parallel: cbverify.upstream.distributed), as accelerate sees it
        "process_index": int(trainer.accelerator.process_index),
        "num_processes": int(trainer.accelerator.num_processes),
        "distributed_type": str(trainer.accelerator.distributed_type),
        # the mixed precision the trainer really runs under ("no", "bf16", "fp16"), whatever its config says
        "mixed_precision": str(trainer.accelerator.mixed_precision),
    }
    _wrap_generate(trainer, capture)
    _wrap_scoring(trainer, capture)
    _wrap_loss(trainer, capture)
