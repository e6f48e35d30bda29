"""The user's checkpoint as TRL's ``GRPOTrainer`` sees it: model, tokenizer, EOS ids and pad id.

:func:`preflight` inspects the directory before any weights are read, so a folder that is not a checkpoint, an
encoder-decoder model, a missing or unparseable tokenizer or generation config, or a truncated or corrupt
``*.safetensors`` file fails with one line, not a traceback after minutes of work:

- ``config.json``: a JSON object with a ``model_type`` string; the size fields the model classes read, where present,
  positive integers; a nested ``text_config`` an object;
- tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``, ``added_tokens.json``)
  and ``generation_config.json``: JSON objects; the generation config's ``eos_token_id`` an int or a list of ints;
- every ``*.safetensors`` file: the 8-byte little-endian header length, then that many bytes of JSON, inside the
  file; each tensor's dtype known, its shape a list of non-negative ints and its ``data_offsets`` inside the data that
  follows, as long as its dtype and shape say, the tensors tiling that data exactly (the checks ``safetensors`` makes
  when it opens the file); a sharded checkpoint's index names only files that exist.

:func:`open_checkpoint` then reads the tokenizer (so prompts can be checked against the context before any weights
are read) and resolves, as ``GRPOTrainer.__init__`` does (trl 1.16):

- EOS: ``generation_config.json``'s ``eos_token_id`` (an int or a list; none when absent), with the tokenizer's
  ``eos_token_id`` put first when the list lacks it;
- pad: the tokenizer's pad token, else its EOS token (TRL sets ``pad_token = eos_token``), written into the model's
  config and generation config as TRL writes it (:meth:`Checkpoint.load_model`, local files only).

EOS and pad ids must lie inside the model's vocabulary. Whatever the libraries still refuse when they read the files
(the tokenizer, the config, the weights) is a ``ValueError`` of one line naming the checkpoint and the step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from reference import tasks
from reference.models import load_tokenizer, parse_dtype, resolve

# Bits per element of every dtype the safetensors format defines (its Rust ``Dtype``); a header naming another is
# refused, as safetensors refuses it.
SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "E8M0": 8, "I16": 16,
                    "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64,
                    "I64": 64, "U64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}  # fmt: skip
MAX_HEADER = 100_000_000  # safetensors' own limit on the header length
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "max_position_embeddings", "head_dim")  # fmt: skip
OPTIONAL_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "generation_config.json")  # fmt: skip


@dataclass(frozen=True)
class Checkpoint:
    name: str
    path: Path
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    context_length: int | None  # longest prompt + completion the config declares (None: it declares none)
    vocab_size: int | None = None  # rows of the model's embedding, as its (text) config declares them

    @property
    def arithmetic(self) -> bool:
        """Whether the tokenizer is the bundled arithmetic task's (character vocabulary): its default prompts are the
        task's problems; any other checkpoint gets natural-language prompts."""
        return self.tokenizer.get_vocab() == tasks.VOCAB

    def load_model(self, *, dtype: str = "float32", device: str = "cpu"):
        """The causal LM in eval mode, with the pad id written into its configs as TRL writes it; a checkpoint the
        libraries refuse is a one-line ``ValueError`` (the device check first: that one is not the checkpoint's)."""
        import torch
        from transformers import AutoModelForCausalLM

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        try:
            model = AutoModelForCausalLM.from_pretrained(self.path, dtype=parse_dtype(dtype), local_files_only=True)
        except Exception as err:  # any library's refusal of the files, in one line
            raise ValueError(f"{self.path}: the weights do not load: {brief(err)}") from None
        model.config.get_text_config().pad_token_id = self.pad_token_id
        if model.generation_config is not None:
            model.generation_config.pad_token_id = self.pad_token_id
        return model.to(device).eval()


def brief(err: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line (whitespace collapsed), at most ``limit`` characters of message."""
    text = " ".join(str(err).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` for an error message: at most ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_json(file: Path) -> object:
    """The parsed contents of ``file``; ``ValueError`` in one line naming it when it cannot be read or parsed."""
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not valid JSON: not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None
    except RecursionError:
        raise ValueError(f"{file} is not valid JSON: nested too deeply") from None
    except OSError as err:
        raise ValueError(f"{file} cannot be read: {brief(err)}") from None


def _object(file: Path) -> dict:
    data = read_json(file)
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _config(path: Path) -> dict:
    config = _object(path / "config.json")
    where = path / "config.json"
    if not (isinstance(config.get("model_type"), str) and config["model_type"]):
        raise ValueError(f"{where}: 'model_type' must be a non-empty string, got {shown(config.get('model_type'))}")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ValueError(f"{where}: 'text_config' must be an object, got {type(text).__name__}")
    for scope, prefix in ((config, ""), (text or {}, "text_config.")):
        for key in SIZE_FIELDS:
            value = scope.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{where}: '{prefix}{key}' must be a positive integer, got {shown(value)}")
    return config


def _check_safetensors(file: Path) -> None:
    """The checks ``safetensors`` makes when it opens ``file`` (see the module docstring), made first so a truncated
    or corrupt file is one line naming it."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else None
            raw = f.read(length) if length is not None and 0 < length <= min(MAX_HEADER, size - 8) else b""
    except OSError as err:
        raise ValueError(f"{file} cannot be read: {brief(err)}") from None
    if length is None:
        raise ValueError(f"{file}: truncated safetensors file ({size} bytes, no 8-byte header length)")
    if not raw:
        raise ValueError(f"{file}: corrupt or truncated safetensors file (header length {length}, file {size} bytes)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ValueError(f"{file}: corrupt safetensors file (its header is not valid JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: corrupt safetensors file (its header is not a JSON object)")
    data_len, spans = size - 8 - length, []
    for name, info in header.items():
        if name == "__metadata__":
            if info is not None and not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                raise ValueError(f"{file}: corrupt safetensors file (__metadata__ is not a string map)")
            continue
        where = f"{file}: corrupt safetensors file (tensor {shown(name)}"
        if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_BITS:
            dtype = info.get("dtype") if isinstance(info, dict) else None
            raise ValueError(f"{where}: unknown dtype {shown(dtype)})")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):  # fmt: skip
            raise ValueError(f"{where}: shape {shown(shape)} is not a list of non-negative ints)")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_len):  # fmt: skip
            raise ValueError(f"{where}: data_offsets {shown(offsets)} outside the {data_len} data bytes; truncated?)")
        nbits = math.prod(shape) * SAFETENSORS_BITS[info["dtype"]]
        if nbits % 8 or offsets[1] - offsets[0] != nbits // 8:
            raise ValueError(f"{where}: {offsets[1] - offsets[0]} bytes for {info['dtype']} {shape})")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for start, stop, name in sorted(spans):
        if start != end:
            raise ValueError(f"{file}: corrupt safetensors file (tensor {shown(name)} starts at {start}, not {end})")
        end = stop
    if end != data_len:
        raise ValueError(f"{file}: corrupt safetensors file (tensors cover {end} of its {data_len} data bytes)")


def _check_weights(path: Path) -> None:
    shards = sorted(path.glob("*.safetensors"))
    if not shards and not any(path.glob("*.bin")):
        raise FileNotFoundError(f"{path}: no weights (*.safetensors or *.bin)")
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _object(index_file).get("weight_map")
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise ValueError(f"{index_file}: 'weight_map' must be an object of tensor name -> file name")
        missing = sorted({v for v in weight_map.values() if not (path / v).is_file()})
        if missing:
            raise FileNotFoundError(f"{index_file}: names shards that are missing: {', '.join(missing[:5])}")
    for shard in shards:
        _check_safetensors(shard)


def _generation_eos(path: Path) -> list[int]:
    """``generation_config.json``'s ``eos_token_id`` as a list (empty when the file or the key is absent)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return []
    declared = _object(file).get("eos_token_id")
    ids = [] if declared is None else [declared] if not isinstance(declared, list) else declared
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file}: 'eos_token_id' must be a non-negative int or a list of them, got {shown(declared)}")
    return ids


def preflight(name_or_path: str | Path) -> Path:
    """The checkpoint folder, checked before any model work; ``ValueError`` / ``FileNotFoundError`` with one line."""
    path = resolve(name_or_path)
    config = _config(path)
    if config.get("is_encoder_decoder"):
        kind = config.get("model_type", "this model")
        raise ValueError(f"{path}: {kind} is an encoder-decoder model; cbverify verifies decoder-only causal LMs")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    for name in OPTIONAL_JSON:
        if (path / name).is_file():
            _object(path / name)
    _generation_eos(path)
    _check_weights(path)
    return path


def eos_token_ids(path: Path, tokenizer) -> tuple[int, ...]:
    """EOS ids as TRL resolves them (see the module docstring)."""
    ids = _generation_eos(path)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    return tuple(int(i) for i in ids)


def _text_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()
    except Exception as err:  # transformers' refusal of the config (unknown model_type, a wrong value), in one line
        raise ValueError(f"{path / 'config.json'}: transformers cannot read it: {brief(err)}") from None


def context_length(path: Path) -> int | None:
    """The context length the config declares, read as the engines read it (``cb_impl.support.context_length``:
    any of the names architectures use for it, on the text config); ``None`` when it declares none."""
    from cb_impl.support import context_length as declared

    config = _text_config(path)
    try:
        return declared(config) or None
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path / 'config.json'}: its context length is not a number: {brief(err)}") from None


def open_checkpoint(name_or_path: str | Path) -> Checkpoint:
    """The checkpoint's tokenizer, EOS and pad ids and context length (after :func:`preflight`); no weights yet."""
    path = preflight(name_or_path)
    if not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer_config.json, so the tokenizer cannot be loaded as TRL would")
    try:
        tokenizer = load_tokenizer(path)
    except Exception as err:  # the tokenizer libraries' refusal of the files, in one line
        raise ValueError(f"{path}: the tokenizer does not load: {brief(err)}") from None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"{path}: the tokenizer has neither a pad nor an EOS token (TRL needs one to pad)")
    eos = eos_token_ids(path, tokenizer)
    vocab = getattr(_text_config(path), "vocab_size", None)
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
    if vocab is not None:
        for what, ids in (("EOS", eos), ("pad", (pad,))):
            outside = [i for i in ids if not 0 <= int(i) < vocab]
            if outside:
                raise ValueError(f"{path}: {what} token id(s) {outside} outside the model's vocabulary of {vocab}")
    return Checkpoint(str(name_or_path), path, tokenizer, eos, int(pad), context_length(path), vocab)


def load_checked(name_or_path: str | Path, *, dtype: str = "float32", device: str = "cpu"):
    """``reference.models.load``'s model (configs as saved, no pad id written) after :func:`preflight`; whatever the
    libraries still refuse is a one-line ``ValueError``. For the commands that run the bundled models as they are."""
    from reference.models import load

    path = preflight(name_or_path)
    try:
        return load(path, dtype=dtype, device=device)[0]
    except Exception as err:  # any library's refusal of the files, in one line
        raise ValueError(f"{path}: the checkpoint does not load: {brief(err)}") from None
