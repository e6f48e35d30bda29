"""What differs between TRL releases in what cbverify drives: detected, in one place.

Everything of TRL's trainers that the capture (:mod:`cbverify.upstream.capture`), the scenarios
(:mod:`cbverify.upstream.scenario`) and the loss cross-check (``property_tests/test_reference_vs_trl.py``) touch and
that changed between 1.0 and 1.16 (0.24 to 0.29 below), read in each minor release's newest patch
(``trl/trainer/grpo_trainer.py``, ``rloo_trainer.py``, ``grpo_config.py``; ``cbverify matrix --all-trl-minors 1.0``
builds them all):

- the EOS ids a trainer generates with: ``trainer.eos_token_id`` (one id) up to 1.2, its tokenizer's
  ``eos_token_id`` (``trainer._tokenizer``) from 1.3 to 1.13, ``trainer.eos_token_ids`` (the tokenizer's EOS first,
  then the generation config's) from 1.14;
- what GRPO's ``_generate`` returns, read from the names ``_generate_and_score_completions`` unpacks it into: 7
  fields in 1.0 (the completion-token count ``num_items_in_batch`` before the sampler log-probs), 9 from 1.1 to 1.8
  (images added), 8 from 1.9 (the count is made after generation); RLOO's is 3 long in every release (no sampler
  log-probs);
- ``_get_per_token_logps_and_entropies`` returns ``(logps, entropies)`` up to 1.6, ``(logps, entropies, aux_loss)``
  from 1.7 (its ``compute_aux_loss`` argument);
- transformers continuous batching with a configuration (``use_transformers_continuous_batching`` and
  ``transformers_continuous_batching_config``) exists from 1.7, for GRPO and RLOO; before, only
  ``use_transformers_paged``, which takes no CB configuration (its defaults reserve GBs), so the ``cb`` path is not
  applicable there;
- the IS-correction bounds: ``vllm_importance_sampling_cap`` (an upper bound) up to 1.5,
  ``vllm_importance_sampling_clip_min`` / ``_clip_max`` from 1.6;
- ``use_bias_correction_kl`` defaults to False up to 1.9, True from 1.10 (the step checks read what the trainer ran
  with).

Two behaviours changed without any name to detect them by, so they are told by the version (:func:`behaviour`):
NaN sampler log-probs (tokens an engine could not score) get IS weight 1 from 1.11 (before, the NaN reaches the
loss); an empty completion passes through scoring from 1.15 (before, ``_generate_and_score_completions`` decodes
the padded completion ids, which an empty first row makes float through ``torch.tensor([])``, and the tokenizer
refuses them). Where a release is wrong rather than different, it is a registered finding instead
(:mod:`cbverify.upstream.findings`, with its ``trl`` range).

Before 1.0: trl 0.29 (the last 0.x) runs through the same detection (its ``_generate`` has 1.0's 7 fields, one EOS id
in ``trainer.eos_token_id``, no CB configuration, ``vllm_importance_sampling_cap``; ``cbverify matrix --trl 0.29.1``).
trl 0.14 (the first with ``GRPOTrainer``) to 0.28 import transformers' ``_is_package_available`` and read its result
as a bool, but from transformers 5.0 it returns a ``(bool, version)`` tuple, always true, so every optional dependency
reads as installed and ``import trl.trainer.grpo_trainer`` fails on the first absent one (vllm in 0.14 to 0.23,
mergekit in 0.24 and 0.25, weave in 0.26 to 0.28; 0.14.0, 0.23.0, 0.24.0, 0.25.1, 0.26.2, 0.27.2 and 0.28.0 were
tried beside transformers 5.24.0). Their metadata puts no upper bound on transformers (``>=4.46`` in 0.14 to
``>=4.56.2`` in 0.28), so ``cbverify matrix`` builds them beside the newest 4.x, 4.57.6
(:func:`cbverify.upstream.matrix.paired_transformers`, below :data:`TRANSFORMERS_5_FROM`). What differs there:

- no transformers continuous batching with a configuration (4.x has no ``ContinuousBatchingConfig``): the ``cb``
  path and the transformers-cb engine are refused naming the release
  (:mod:`cbverify.engines.transformers_compat`);
- ``rollout_func`` is a ``GRPOTrainer`` argument from 0.25, but 0.25 to 0.27 call it only inside their vLLM branch
  and 0.28 hands it to its vLLM backend only: without vLLM the trainer generates with ``model.generate`` and never
  calls it, silently (:func:`rollout_func_off_vllm` reads it off the source). The ``rollout_func`` path is refused
  there; the step recording (:mod:`cbverify.upstream.recording`) puts the oracle in place of
  ``_generate_single_turn`` instead (:func:`single_turn_layout`: ``prompt_ids, completion_ids, logprobs`` and
  ``forward_kwargs`` in 0.24, ``extra_fields`` from 0.25);
- ``_generate`` (a hook the capture wraps) is new in 0.24 (:data:`CAPTURE_FROM`), where it also takes the images;
  0.14 to 0.23 generate inside ``_generate_and_score_completions`` (0.15+) or ``_prepare_inputs`` and every scenario
  is NOT-APPLICABLE there, naming the hooks the release lacks: the layer stops at 0.24;
- ``vllm_importance_sampling_mode`` exists from 0.26 (passed only where the correction is on or the field exists);
  ``luspo`` / ``sapo`` / ``vespo`` loss types, CB and a lower IS bound are absent as the loss-type and field detection
  reads them.

Without vLLM and without a rollout_func these releases have one generation path (``generate``), whose sampler returns
no log-probs and whose sampling depends on the process layout: ``sampler_logprobs_reach_trainer``,
``sampler_logprob_semantics`` and ``greedy_paths_agree`` (and across ranks ``ranks_match_one_process``) judge nothing
there: the upstream run reports each once as N/A for the release, naming what each path lacks
(:func:`cbverify.upstream.suite.release_lacks`). The logged ``reward_std`` is the mean of the per-row standard
deviations that scale the advantages up to 0.26, the batch's standard deviation from 0.27 (:func:`reward_std_logged`).

The same in every release (checked; nothing to adapt): the five wrapped trainer methods, ``rollout_func`` (a
``GRPOTrainer`` argument; ``RLOOTrainer`` never takes one), the loss types ``_compute_loss`` knows (grpo, bnpo,
dr_grpo, dapo, cispo, sapo, luspo, vespo; :func:`loss_types` reads them), ``scale_rewards`` (group / batch / none),
the IS modes, ``importance_sampling_level``, ``num_iterations``, ``mask_truncated_completions``,
``top_entropy_quantile``, ``epsilon`` / ``epsilon_high`` / ``delta``, ``steps_per_generation`` (from 1.9 the
dapo / cispo normaliser is scaled by the accumulation steps over it: the same number while the two are equal, its
default and the only case the scenarios run).

A feature the installed release lacks is refused with :class:`MissingFeature`, naming the release and what it lacks,
which the upstream suite reports as NOT-APPLICABLE and the tests as a skip: never silently dropped.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap
from functools import cache

import trl
from packaging.version import Version
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

# the oldest trl whose GRPOTrainer imports beside transformers >= 5 (the module docstring says why the releases before
# do not); ``cbverify matrix`` pairs an older one with the newest transformers 4.x it allows
TRANSFORMERS_5_FROM = "0.29"
# the oldest trl ``cbverify matrix`` accepts: the first with a GRPOTrainer (beside transformers 4.x before
# TRANSFORMERS_5_FROM); the scenarios run from CAPTURE_FROM on, and before it are NOT-APPLICABLE naming the hooks
FLOOR = "0.14"
# the oldest trl whose GRPOTrainer has every hook the capture wraps (HOOKS: _generate is new in 0.24)
CAPTURE_FROM = "0.24"

VERSION = trl.__version__
TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig), "rloo": (RLOOTrainer, RLOOConfig)}
HOOKS = ("_generate", "_calculate_rewards", "_generate_and_score_completions", "_compute_loss",
         "_get_per_token_logps_and_entropies")  # fmt: skip
# the names TRL unpacks ``_generate``'s output into (every release): what the capture reads
PROMPT_IDS, COMPLETION_IDS, SAMPLER_LOGPROBS = (
    "prompt_ids_list",
    "completion_ids_list",
    "sampling_per_token_logps_list",
)
BEHAVIOURS = {  # behaviour -> the first release with it (nothing to detect it by; see the module docstring)
    "nan_sampler_logprobs_weight_1": "1.11",
    "empty_completions_scored": "1.15",
}


class MissingFeature(ValueError):
    """The installed TRL lacks something a scenario, check or test asked for (the message names the release)."""


def fields(trainer: str) -> frozenset[str]:
    """The installed ``GRPOConfig`` / ``RLOOConfig`` fields (``trainer``: ``grpo`` / ``rloo``)."""
    return frozenset(TRAINERS[trainer][1].__dataclass_fields__)


def config(trainer: str, **options):
    """The trainer's config built from ``options``; a field the release lacks is refused (:class:`MissingFeature`)."""
    cls = TRAINERS[trainer][1]
    if missing := missing_fields(trainer, options):
        raise MissingFeature(f"trl {VERSION}: {cls.__name__} has no {', '.join(missing)}")
    return cls(**options)


def require_hooks(trainer: str) -> None:
    """The trainer methods the capture wraps exist on the installed release."""
    cls = TRAINERS[trainer][0]
    if missing := [h for h in HOOKS if not hasattr(cls, h)]:
        raise MissingFeature(f"trl {VERSION}: {cls.__name__} lacks {', '.join(missing)} (hook points)")


def require_path(trainer: str, path: str) -> None:
    """The generation path (``generate`` / ``cb`` / ``rollout_func`` / ``vllm``) exists for ``trainer`` here."""
    cls, config_cls = TRAINERS[trainer]
    if path == "cb" and "use_transformers_continuous_batching" not in fields(trainer):
        raise MissingFeature(f"trl {VERSION}: {config_cls.__name__} has no use_transformers_continuous_batching")
    if path == "rollout_func" and "rollout_func" not in inspect.signature(cls.__init__).parameters:
        raise MissingFeature(f"trl {VERSION}: {cls.__name__} takes no rollout_func")
    if path == "rollout_func" and not rollout_func_off_vllm():
        raise MissingFeature(f"trl {VERSION}: {cls.__name__} calls rollout_func only on its vLLM path (use_vllm="
                             "True); without vLLM it generates with model.generate and never calls it")  # fmt: skip
    if path == "vllm" and "vllm_mode" not in fields(trainer):
        raise MissingFeature(f"trl {VERSION}: {config_cls.__name__} has no vllm_mode (colocated vLLM)")
    if path == "vllm" and (importlib.util.find_spec("trl.generation") is None  # 0.28 and before: no such package
                           or importlib.util.find_spec("trl.generation.vllm_generation") is None):  # fmt: skip
        raise MissingFeature(f"trl {VERSION}: no trl.generation.vllm_generation (the vLLM driver this path wraps)")


def calls_rollout_func_off_vllm(source: str) -> bool:
    """Whether ``source`` (a method's) calls ``*.rollout_func(...)`` outside every ``if`` branch whose test reads
    ``use_vllm`` or ``vllm_mode`` (an ``else`` of such an ``if`` is outside it)."""

    def vllm_branch(test: ast.AST) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr in ("use_vllm", "vllm_mode") for n in ast.walk(test))

    def outside(node: ast.AST, inside_vllm: bool) -> bool:
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rollout_func"
                and not inside_vllm):  # fmt: skip
            return True
        if isinstance(node, ast.If) and vllm_branch(node.test):
            return any(outside(child, True) for child in node.body) or any(
                outside(child, inside_vllm) for child in node.orelse)  # fmt: skip
        return any(outside(child, inside_vllm) for child in ast.iter_child_nodes(node))

    return outside(ast.parse(textwrap.dedent(source)), False)


@cache
def rollout_func_off_vllm() -> bool:
    """Whether the installed ``GRPOTrainer`` calls its ``rollout_func`` without vLLM (in ``_generate`` or
    ``_generate_single_turn``, outside its vLLM branches): from trl 0.29 on; 0.25 to 0.27 call it only inside
    ``if self.use_vllm``, 0.28 hands it to its vLLM generation backend only."""
    methods = [getattr(GRPOTrainer, name, None) for name in ("_generate", "_generate_single_turn")]
    return any(calls_rollout_func_off_vllm(inspect.getsource(m)) for m in methods if m is not None)


def missing_fields(trainer: str, options: dict) -> list[str]:
    """The fields of ``options`` the installed ``trainer`` config lacks (sorted)."""
    return sorted(set(options) - fields(trainer))


def loss_types() -> tuple[str, ...]:
    """The ``loss_type`` values the installed ``GRPOTrainer._compute_loss`` compares ``self.loss_type`` with."""
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(GRPOTrainer._compute_loss)))):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "loss_type":
            for compared in node.comparators:  # == "x", != "x", in ["x", "y"]
                items = compared.elts if isinstance(compared, (ast.List, ast.Tuple)) else [compared]
                found += [c.value for c in items if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return tuple(sorted(set(found)))


def require_loss_type(loss_type: str) -> None:
    if loss_type not in loss_types():
        raise MissingFeature(f"trl {VERSION}: GRPOTrainer._compute_loss has no loss_type {loss_type!r}")


def eos_token_ids(trainer) -> tuple[int, ...]:
    """The EOS ids ``trainer`` generates with (where the release keeps them: see the module docstring)."""
    if hasattr(trainer, "eos_token_ids"):  # 1.14+
        return tuple(int(t) for t in trainer.eos_token_ids)
    if hasattr(trainer, "eos_token_id"):  # up to 1.2
        return (int(trainer.eos_token_id),)
    if hasattr(trainer, "_tokenizer"):  # 1.3 to 1.13
        return (int(trainer._tokenizer.eos_token_id),)
    raise MissingFeature(f"trl {VERSION}: {type(trainer).__name__} keeps no EOS id where cbverify knows to look")


@cache
def generate_layout(trainer_cls: type) -> tuple[str, ...]:
    """The names ``trainer_cls._generate_and_score_completions`` unpacks ``self._generate(prompts)`` into."""
    source = textwrap.dedent(inspect.getsource(trainer_cls._generate_and_score_completions))
    for node in ast.walk(ast.parse(source)):
        call = getattr(node, "value", None)
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute) and call.func.attr == "_generate"):  # fmt: skip
            return tuple(target.id for target in node.targets[0].elts)
    raise MissingFeature(f"trl {VERSION}: {trainer_cls.__name__}._generate_and_score_completions unpacks no "
                         "self._generate(...) tuple")  # fmt: skip


# what _generate_single_turn's last field holds where a rollout adds nothing to it (0.24: the images' forward kwargs;
# 0.25 on: a rollout_func's extra fields)
SINGLE_TURN_EMPTY = ("forward_kwargs", "extra_fields")


@cache
def single_turn_layout(trainer_cls: type) -> tuple[str, ...]:
    """The names ``trainer_cls._generate`` unpacks ``self._generate_single_turn(...)`` into (GRPO, 0.24 on:
    ``prompt_ids, completion_ids, logprobs`` and :data:`SINGLE_TURN_EMPTY`'s field)."""
    method = getattr(trainer_cls, "_generate", None)
    if method is not None and hasattr(trainer_cls, "_generate_single_turn"):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(method)))):
            call = getattr(node, "value", None)
            unpacked = isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
            if unpacked and isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "_generate_single_turn":
                return tuple(target.id for target in node.targets[0].elts)
    raise MissingFeature(f"trl {VERSION}: {trainer_cls.__name__}._generate unpacks no "
                         "self._generate_single_turn(...) tuple")  # fmt: skip


def single_turn_output(trainer_cls: type, **values) -> tuple:
    """A ``_generate_single_turn`` return value for ``trainer_cls`` from ``values`` by name (the
    :data:`SINGLE_TURN_EMPTY` field empty unless given)."""
    layout = single_turn_layout(trainer_cls)
    values = {**{name: {} for name in SINGLE_TURN_EMPTY}, **values}
    if missing := [name for name in layout if name not in values]:
        raise MissingFeature(f"trl {VERSION}: {trainer_cls.__name__}._generate_single_turn also returns "
                             f"{', '.join(missing)}")  # fmt: skip
    return tuple(values[name] for name in layout)


def generated(trainer, output: tuple) -> dict:
    """``_generate``'s ``output`` by the names TRL gives its fields (see :data:`PROMPT_IDS` and the others)."""
    return dict(zip(generate_layout(type(trainer)), output, strict=True))


def generate_output(trainer_cls: type, **values) -> tuple:
    """A ``_generate`` return value for ``trainer_cls`` from ``values`` by name (extras: for other releases)."""
    layout = generate_layout(trainer_cls)
    if missing := [name for name in layout if name not in values]:
        raise MissingFeature(f"trl {VERSION}: {trainer_cls.__name__}._generate also returns {', '.join(missing)}")
    return tuple(values[name] for name in layout)


def logps_output(logps, entropies) -> tuple:
    """A ``_get_per_token_logps_and_entropies`` return value: with ``aux_loss=None`` where the release has it."""
    params = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    return (logps, entropies, None) if "compute_aux_loss" in params else (logps, entropies)


@cache
def reward_std_logged(trainer_cls: type = GRPOTrainer) -> str:
    """What GRPO logs as ``reward_std``, read off ``_generate_and_score_completions``: ``"scale"``, the mean over the
    batch's rows of the standard deviation that scales their advantages (each group's; the batch's with
    ``scale_rewards="batch"``), in 0.24 to 0.26, whose logging guide calls it the average standard deviation across
    reward groups; ``"batch"``, the standard deviation of the batch's rewards, from 0.27."""
    source = textwrap.dedent(inspect.getsource(trainer_cls._generate_and_score_completions))
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                and "reward_std" in ast.unparse(node.func.value)):  # fmt: skip
            return "scale" if "std_rewards" in ast.unparse(node.args[0]) else "batch"
    raise MissingFeature(f"trl {VERSION}: {trainer_cls.__name__}._generate_and_score_completions logs no reward_std")


def has_is_clip_min() -> bool:
    """Whether the IS correction takes a lower bound (``vllm_importance_sampling_clip_min``)."""
    return "vllm_importance_sampling_clip_min" in fields("grpo")


def is_bound_attributes(clip_min: float | None, clip_max: float | None) -> dict[str, float | None]:
    """The ``GRPOTrainer`` attributes that hold the IS-correction bounds, with their values; a lower bound on a
    release that has only ``vllm_importance_sampling_cap`` is refused."""
    if has_is_clip_min():
        return {"vllm_importance_sampling_clip_min": clip_min, "vllm_importance_sampling_clip_max": clip_max}
    if clip_min is not None:
        raise MissingFeature(f"trl {VERSION}: GRPOConfig has only vllm_importance_sampling_cap (no lower IS bound)")
    return {"vllm_importance_sampling_cap": clip_max}


def behaviour(name: str) -> bool:
    """Whether the installed release has behaviour ``name`` of :data:`BEHAVIOURS`."""
    return Version(VERSION) >= Version(BEHAVIOURS[name])
