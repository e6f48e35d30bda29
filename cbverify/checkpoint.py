"""The user's checkpoint as TRL's ``GRPOTrainer`` sees it: model, tokenizer, EOS ids and pad id.

:func:`preflight` inspects the directory before any weights are read, so a folder that is not a checkpoint, an
encoder-decoder model or a missing tokenizer fails with one line, not a traceback after minutes of work.
:func:`open_checkpoint` then reads the tokenizer (so prompts can be checked against the context before any weights
are read) and resolves, as ``GRPOTrainer.__init__`` does (trl 1.16):

- EOS: ``generation_config.json``'s ``eos_token_id`` (an int or a list; none when absent), with the tokenizer's
  ``eos_token_id`` put first when the list lacks it;
- pad: the tokenizer's pad token, else its EOS token (TRL sets ``pad_token = eos_token``), written into the model's
  config and generation config as TRL writes it (:meth:`Checkpoint.load_model`, local files only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from reference import tasks
from reference.models import load_tokenizer, parse_dtype, resolve


@dataclass(frozen=True)
class Checkpoint:
    name: str
    path: Path
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    context_length: int | None  # longest prompt + completion the config declares (None: it declares none)

    @property
    def arithmetic(self) -> bool:
        """Whether the tokenizer is the bundled arithmetic task's (character vocabulary): its default prompts are the
        task's problems; any other checkpoint gets natural-language prompts."""
        return self.tokenizer.get_vocab() == tasks.VOCAB

    def load_model(self, *, dtype: str = "float32", device: str = "cpu"):
        """The causal LM in eval mode, with the pad id written into its configs as TRL writes it."""
        import torch
        from transformers import AutoModelForCausalLM

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=parse_dtype(dtype), local_files_only=True)
        model.config.get_text_config().pad_token_id = self.pad_token_id
        if model.generation_config is not None:
            model.generation_config.pad_token_id = self.pad_token_id
        return model.to(device).eval()


def _config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {err.msg}") from None


def context_length(path: Path) -> int | None:
    """The context length the config declares, read as the engines read it (``cb_impl.support.context_length``:
    any of the names architectures use for it, on the text config); ``None`` when it declares none."""
    from transformers import AutoConfig

    from cb_impl.support import context_length as declared

    return declared(AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()) or None


def preflight(name_or_path: str | Path) -> Path:
    """The checkpoint folder, checked before any model work; ``ValueError`` / ``FileNotFoundError`` with one line."""
    path = resolve(name_or_path)
    config = _config(path)
    if config.get("is_encoder_decoder"):
        kind = config.get("model_type", "this model")
        raise ValueError(f"{path}: {kind} is an encoder-decoder model; cbverify verifies decoder-only causal LMs")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise FileNotFoundError(f"{path}: no weights (*.safetensors or *.bin)")
    return path


def eos_token_ids(path: Path, tokenizer) -> tuple[int, ...]:
    """EOS ids as TRL resolves them (see the module docstring)."""
    declared = None
    if (path / "generation_config.json").is_file():
        declared = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    ids = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    return tuple(int(i) for i in ids)


def open_checkpoint(name_or_path: str | Path) -> Checkpoint:
    """The checkpoint's tokenizer, EOS and pad ids and context length (after :func:`preflight`); no weights yet."""
    path = preflight(name_or_path)
    if not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer_config.json, so the tokenizer cannot be loaded as TRL would")
    tokenizer = load_tokenizer(path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"{path}: the tokenizer has neither a pad nor an EOS token (TRL needs one to pad)")
    return Checkpoint(str(name_or_path), path, tokenizer, eos_token_ids(path, tokenizer), int(pad),
                      context_length(path))  # fmt: skip
