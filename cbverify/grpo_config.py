"""The user's GRPO recipe as the sampling config TRL generates with: ``cbverify verify --grpo-config FILE``.

Accepted files:

- a TRL recipe YAML, as ``trl grpo --config FILE`` reads it: ``GRPOConfig`` fields mixed with the script's
  (``GRPOScriptArguments``), model (``ModelConfig``) and dataset-mixture arguments, plus an ``env`` block. Keys of the
  other classes are not sampling: they are listed as unused, never an error;
- a JSON object of ``GRPOConfig`` fields only.

A key that belongs to none of these classes is an error (a typo would otherwise silently change nothing), and so is a
value of the wrong type for its ``GRPOConfig`` field (a string counts where ``trl grpo`` would convert it, as its
argument parser converts a string default: ``learning_rate: 1e-6`` is PyYAML's string and TRL's float) or a sampling
value out of range (``temperature`` > 0, ``top_p`` in (0, 1], ``top_k`` >= 0, ``min_p`` in [0, 1],
``repetition_penalty`` > 0, ``max_completion_length`` >= 1, ``num_generations`` >= 1, all finite; TRL then asks for a
group of at least 2), and a ``generation_kwargs`` entry of the wrong type. The ``GRPOConfig`` is then built by TRL
itself (its own validation and defaults), and the generation options are taken as
``GRPOTrainer.__init__`` (trl 1.16, non-vLLM path) assembles them: ``max_new_tokens = max_completion_length``,
``do_sample=True``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, then
``generation_kwargs`` on top. Options inside the sampling spec become :class:`~reference.spec.SamplingParams`; any
other option with a non-neutral value (a repetition penalty, a ``generation_kwargs`` entry the spec does not know) is
kept in ``extra_options`` so ``verify`` reports it per engine instead of hiding it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import tempfile
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from cbverify.checkpoint import shown
from cbverify.prompts import read_text
from reference.spec import SamplingParams

SPEC_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p")
PLUMBING = ("pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation", "disable_compile")
NEUTRAL = {"repetition_penalty": 1.0, "cache_implementation": None}
NUMERIC = {"temperature": (int, float), "top_p": (int, float), "top_k": int, "min_p": (int, float),
           "repetition_penalty": (int, float), "max_completion_length": int, "num_generations": int}  # fmt: skip
# The ranges of the sampling fields: (low, high, low excluded); checked before TRL builds the config, which checks
# none of them (a zero temperature would divide TRL's logits by zero).
RANGES = {"temperature": (0.0, None, True), "top_p": (0.0, 1.0, True), "top_k": (0, None, False),
          "min_p": (0.0, 1.0, False), "repetition_penalty": (0.0, None, True),
          "max_completion_length": (1, None, False), "num_generations": (1, None, False)}  # fmt: skip
# generation_kwargs entries the assembly reads, and the types they must have (None: left to the config's value)
GENERATION_TYPES = {"do_sample": (bool,), "temperature": (int, float), "top_p": (int, float, type(None)),
                    "top_k": (int, type(None)), "min_p": (int, float, type(None)), "max_new_tokens": (int,),
                    "repetition_penalty": (int, float, type(None))}  # fmt: skip
BOOL_STRINGS = ("yes", "no", "true", "false", "t", "f", "y", "n", "1", "0")  # transformers' string_to_bool
# Training hardware and batch layout, not sampling: a GPU recipe's bf16=True (TrainingArguments refuses it on a
# CPU-only machine), a DeepSpeed file path, or a batch size that divides num_generations only across 8 processes must
# not stop the recipe from being read on one CPU process. Overridden when building, listed as unused.
HARDWARE = {"use_cpu": True, "bf16": False, "fp16": False, "deepspeed": None, "generation_batch_size": None,
            "steps_per_generation": None}  # fmt: skip
# Also replaced when building: the batch layout (one group per device) and the output folder (a temporary one, so
# reading a recipe never creates the folder its training run would write to).
OVERRIDDEN = ("per_device_train_batch_size", "output_dir")


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
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"--grpo-config {path}: unknown format {path.suffix!r} (use .yaml, .yml or .json)")
    text = read_text(path, "--grpo-config")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--grpo-config {path}: not valid JSON ({err.msg}, line {err.lineno})") from None
        except RecursionError:
            raise ValueError(f"--grpo-config {path}: not valid JSON (nested too deeply)") from None
        is_yaml = False
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"--grpo-config {path}: not valid YAML ({str(err).splitlines()[0]})") from None
        except RecursionError:
            raise ValueError(f"--grpo-config {path}: not valid YAML (nested too deeply)") from None
        is_yaml = True
    if not isinstance(data, dict):
        raise ValueError(f"--grpo-config {path}: expected a mapping of option names to values")
    odd = [k for k in data if not isinstance(k, str)]
    if odd:
        raise ValueError(f"--grpo-config {path}: option names must be strings, got {shown(odd[0])}")
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
    unused += sorted(k for k in data if k not in grpo_fields or k in HARDWARE or k in OVERRIDDEN)
    for key, kind in NUMERIC.items():  # TRL's YAML loading does not check types: "temperature: hot" would pass
        value = grpo.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise ValueError(f"--grpo-config {path}: {key} must be a number, got {shown(value)}")
        if value is not None and not _in_range(value, *RANGES[key]):
            raise ValueError(f"--grpo-config {path}: {key} must be {_range_words(key)}, got {shown(value)}")
    hints = typing.get_type_hints(classes["GRPOConfig"])
    for key, value in grpo.items():
        if key not in NUMERIC and key in hints and not _accepts(value, hints[key]):
            raise ValueError(f"--grpo-config {path}: {key} must be {_describe(hints[key])}, got {shown(value)}")
    _check_generation_kwargs(grpo.get("generation_kwargs"), path)
    config = _build_grpo_config(classes["GRPOConfig"], grpo, path)
    try:
        return rollout_config_from(config, unused=tuple(unused), source=str(path))
    except (TypeError, ValueError) as err:  # SamplingParams' own check of the assembled values
        raise ValueError(f"--grpo-config {path}: {' '.join(str(err).split())}") from None


def _range_words(key: str) -> str:
    low, high, open_low = RANGES[key]
    kind = "an integer" if NUMERIC[key] is int else "a finite number"
    return f"{kind} in {'(' if open_low else '['}{low:g}, {high:g}]" if high is not None else \
        f"{kind} {'>' if open_low else '>='} {low:g}"  # fmt: skip


def _in_range(value: float, low: float, high: float | None, open_low: bool) -> bool:
    if not math.isfinite(value) or value < low or (open_low and value == low):
        return False
    return high is None or value <= high


def _accepts(value: object, hint: object) -> bool:
    """Whether ``trl grpo`` would take ``value`` for a field annotated ``hint``: an instance of it, or a string its
    argument parser converts (numbers, booleans); annotations it cannot judge (classes of other libraries) accept."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return isinstance(value, bool) or (isinstance(value, str) and value.lower() in BOOL_STRINGS)
    if hint in (int, float):
        if isinstance(value, str):
            try:
                hint(value)
            except ValueError:
                return False
            return True
        return not isinstance(value, bool) and isinstance(value, (int, float) if hint is float else int)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return value in {m.value for m in hint}
    if hint is list or origin is list:
        return (
            isinstance(value, list) and all(_accepts(v, args[0]) for v in value) if args else isinstance(value, list)
        )
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    return True


def _describe(hint: object) -> str:
    """An annotation in words: ``float``, ``int or None``, ``list[str] or str or None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None else str(hint).replace("typing.", "")


def _check_generation_kwargs(kwargs: object, path: str | Path) -> None:
    """``generation_kwargs`` as the assembly reads it: a mapping; the entries it reads of the right types; an EOS
    override a non-negative int or a list of them."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"--grpo-config {path}: generation_kwargs must be a mapping of option names to values")
    for key, kinds in GENERATION_TYPES.items():
        value = kwargs.get(key, ...)
        if value is not ... and ((isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds)):
            raise ValueError(f"--grpo-config {path}: generation_kwargs.{key} has the wrong type: {shown(value)}")
    eos = kwargs.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"--grpo-config {path}: generation_kwargs.eos_token_id must be a non-negative int or a "
                         f"list of them, got {shown(eos)}")  # fmt: skip


def _trl_version() -> str:
    import trl

    return trl.__version__


def _default_group(cls: type) -> int:
    return next(f.default for f in dataclasses.fields(cls) if f.name == "num_generations")


def _build_grpo_config(cls: type, values: dict, path: str | Path):
    # TrainingArguments' deprecation notices (gradient_checkpointing -> activation_checkpointing) are about TRL's own
    # defaults, not the user's recipe: they would only bury the report.
    with tempfile.TemporaryDirectory(prefix="cbverify-recipe-") as out, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            layout = {"per_device_train_batch_size": values.get("num_generations", _default_group(cls))}
            return cls(**{"report_to": "none", **values, **HARDWARE, **layout, "output_dir": out})
        except Exception as err:  # TRL's own validation, whatever it raises: the recipe is refused in one line
            raise ValueError(f"--grpo-config {path}: GRPOConfig rejects it: {' '.join(str(err).split())}") from None


def rollout_config_from(config, *, unused: tuple[str, ...] = (), source: str = "") -> RolloutConfig:
    """The generation options of a built ``GRPOConfig`` (TRL's own assembly, see the module docstring)."""
    options: dict[str, object] = {
        "max_new_tokens": config.max_completion_length, "do_sample": True, "temperature": config.temperature,
        "top_p": config.top_p, "top_k": config.top_k, "min_p": config.min_p,
        "repetition_penalty": config.repetition_penalty, "cache_implementation": config.cache_implementation,
    }  # fmt: skip
    if not isinstance(config.generation_kwargs or {}, dict):
        raise ValueError(f"generation_kwargs must be a mapping, got {shown(config.generation_kwargs)}")
    if config.max_completion_length is None:
        raise ValueError("max_completion_length must be set (it is the completion budget)")
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
