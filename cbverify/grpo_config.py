"""The user's GRPO recipe as the sampling config TRL generates with: ``cbverify verify --grpo-config FILE``.

Accepted files:

- a TRL recipe YAML, as ``trl grpo --config FILE`` reads it: ``GRPOConfig`` fields mixed with the script's
  (``GRPOScriptArguments``), model (``ModelConfig``) and dataset-mixture arguments, plus an ``env`` block. Keys of the
  other classes are not sampling: they are listed as unused, never an error;
- a JSON object of ``GRPOConfig`` fields only.

A key that belongs to none of these classes is an error (a typo would otherwise silently change nothing). The
``GRPOConfig`` is then built by TRL itself (its own validation and defaults), and the generation options are taken as
``GRPOTrainer.__init__`` (trl 1.16, non-vLLM path) assembles them: ``max_new_tokens = max_completion_length``,
``do_sample=True``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, then
``generation_kwargs`` on top. Options inside the sampling spec become :class:`~reference.spec.SamplingParams`; any
other option with a non-neutral value (a repetition penalty, a ``generation_kwargs`` entry the spec does not know) is
kept in ``extra_options`` so ``verify`` reports it per engine instead of hiding it.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from reference.spec import SamplingParams

SPEC_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p")
PLUMBING = ("pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation", "disable_compile")
NEUTRAL = {"repetition_penalty": 1.0, "cache_implementation": None}
NUMERIC = {"temperature": (int, float), "top_p": (int, float), "top_k": int, "min_p": (int, float),
           "repetition_penalty": (int, float), "max_completion_length": int, "num_generations": int}  # fmt: skip
# Training hardware and batch layout, not sampling: a GPU recipe's bf16=True (TrainingArguments refuses it on a
# CPU-only machine), a DeepSpeed file path, or a batch size that divides num_generations only across 8 processes must
# not stop the recipe from being read on one CPU process. Overridden when building, listed as unused.
HARDWARE = {"use_cpu": True, "bf16": False, "fp16": False, "deepspeed": None, "generation_batch_size": None,
            "steps_per_generation": None}  # fmt: skip


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """What a GRPO recipe asks of the rollout engine."""

    sampling: SamplingParams
    num_generations: int
    extra_options: dict[str, object] = field(default_factory=dict)  # non-neutral options outside the spec
    eos_token_ids: tuple[int, ...] | None = None  # only when generation_kwargs overrides EOS
    unused_keys: tuple[str, ...] = ()  # script / model / dataset arguments: not sampling
    source: str = ""


def _argument_classes() -> dict[str, type]:
    """The dataclasses ``trl grpo`` parses a recipe into, by name (those the installed TRL has)."""
    import trl

    classes = {"GRPOConfig": trl.GRPOConfig, "ModelConfig": trl.ModelConfig}
    if hasattr(trl, "DatasetMixtureConfig"):
        classes["DatasetMixtureConfig"] = trl.DatasetMixtureConfig
    try:
        from trl.scripts.grpo import GRPOScriptArguments
    except ImportError:  # older TRL: the generic script arguments
        GRPOScriptArguments = trl.ScriptArguments  # noqa: N806
    classes["GRPOScriptArguments"] = GRPOScriptArguments
    return classes


def read_recipe(path: str | Path) -> tuple[dict, bool]:
    """``(mapping, is_yaml)``; ``ValueError`` naming the file when it does not parse or is not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--grpo-config {path}: no such file")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--grpo-config {path}: not valid JSON ({err.msg} at line {err.lineno})") from None
        is_yaml = False
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"--grpo-config {path}: not valid YAML ({str(err).splitlines()[0]})") from None
        is_yaml = True
    else:
        raise ValueError(f"--grpo-config {path}: unknown format {path.suffix!r} (use .yaml, .yml or .json)")
    if not isinstance(data, dict):
        raise ValueError(f"--grpo-config {path}: expected a mapping of option names to values")
    return data, is_yaml


def load_rollout_config(path: str | Path) -> RolloutConfig:
    """The recipe at ``path`` as a :class:`RolloutConfig` (see the module docstring)."""
    data, is_yaml = read_recipe(path)
    classes = _argument_classes()
    grpo_fields = {f.name for f in dataclasses.fields(classes["GRPOConfig"])}
    other = {f.name for name, c in classes.items() if name != "GRPOConfig" for f in dataclasses.fields(c)}
    data = dict(data)
    unused = ["env"] if is_yaml and data.pop("env", None) is not None else []
    grpo = {k: v for k, v in data.items() if k in grpo_fields}
    unknown = sorted(k for k in data if k not in grpo_fields and (not is_yaml or k not in other))
    if unknown:
        where = "GRPOConfig" + (", GRPOScriptArguments, ModelConfig or DatasetMixtureConfig" if is_yaml else "")
        raise ValueError(f"--grpo-config {path}: {', '.join(unknown)} is not a field of {where} (trl "
                         f"{_trl_version()})")  # fmt: skip
    unused += sorted(k for k in data if k not in grpo_fields or k in HARDWARE or k == "per_device_train_batch_size")
    for key, kind in NUMERIC.items():  # TRL's YAML loading does not check types: "temperature: hot" would pass
        value = grpo.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise ValueError(f"--grpo-config {path}: {key} must be a number, got {value!r}")
    config = _build_grpo_config(classes["GRPOConfig"], grpo, path)
    return rollout_config_from(config, unused=tuple(unused), source=str(path))


def _trl_version() -> str:
    import trl

    return trl.__version__


def _default_group(cls: type) -> int:
    return next(f.default for f in dataclasses.fields(cls) if f.name == "num_generations")


def _build_grpo_config(cls: type, values: dict, path: str | Path):
    # TrainingArguments' deprecation notices (gradient_checkpointing -> activation_checkpointing) are about TRL's own
    # defaults, not the user's recipe: they would only bury the report.
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            layout = {"per_device_train_batch_size": values.get("num_generations", _default_group(cls))}
            return cls(**{"output_dir": out, "report_to": "none", **values, **HARDWARE, **layout})
        except (TypeError, ValueError) as err:
            raise ValueError(f"--grpo-config {path}: GRPOConfig rejects it: {err}") from None


def rollout_config_from(config, *, unused: tuple[str, ...] = (), source: str = "") -> RolloutConfig:
    """The generation options of a built ``GRPOConfig`` (TRL's own assembly, see the module docstring)."""
    options: dict[str, object] = {
        "max_new_tokens": config.max_completion_length, "do_sample": True, "temperature": config.temperature,
        "top_p": config.top_p, "top_k": config.top_k, "min_p": config.min_p,
        "repetition_penalty": config.repetition_penalty, "cache_implementation": config.cache_implementation,
    }  # fmt: skip
    options.update(config.generation_kwargs or {})
    greedy = not options["do_sample"]
    sampling = SamplingParams(
        temperature=0.0 if greedy else float(options["temperature"]),
        top_k=0 if greedy else int(options["top_k"] or 0),
        top_p=1.0 if greedy else float(options["top_p"] if options["top_p"] is not None else 1.0),
        min_p=0.0 if greedy else float(options["min_p"] or 0.0),
        max_new_tokens=int(options["max_new_tokens"]),
    )
    extra = {k: v for k, v in options.items()
             if k not in SPEC_KEYS and k not in PLUMBING and NEUTRAL.get(k, object()) != v}  # fmt: skip
    eos = options.get("eos_token_id") if "eos_token_id" in (config.generation_kwargs or {}) else None
    eos_ids = None if eos is None else tuple(int(t) for t in ([eos] if isinstance(eos, int) else eos))
    return RolloutConfig(sampling, int(config.num_generations), extra, eos_ids, unused, source)
