"""Load a bundled checkpoint by name, or any local Hugging Face checkpoint by path. Never touches the network."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _models_dir() -> Path:
    """The bundled checkpoints: ``reference/_models`` in an installed package (the build copies them there), else
    ``golden/models`` in the checkout this package runs from."""
    from importlib.resources import files

    installed = Path(str(files("reference") / "_models"))
    return installed if installed.is_dir() else Path(__file__).resolve().parent.parent / "golden" / "models"


MODELS_DIR = _models_dir()
BUNDLED = ("tiny-llama-arith", "tiny-qwen2-random", "tiny-qwen3-chat")
DEFAULT_MODEL = "tiny-llama-arith"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve(name_or_path: str | Path) -> Path:
    """A bundled name -> its folder under :data:`MODELS_DIR`; otherwise a local directory holding ``config.json``."""
    if str(name_or_path) in BUNDLED:
        path = MODELS_DIR / str(name_or_path)
        if not (path / "config.json").is_file():
            where = f"bundled model {name_or_path!r} is missing at {path}"
            raise FileNotFoundError(f"{where}: reinstall cbverify, or in a checkout run `make models`")
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {str(name_or_path)!r} is neither a bundled name ({', '.join(BUNDLED)}) nor a local directory "
            "(cbverify never downloads: point at a local checkpoint)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    return path


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load(name_or_path: str | Path = DEFAULT_MODEL, *, dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """``(model, tokenizer)`` in eval mode, from local files only (``local_files_only=True``)."""
    from transformers import AutoModelForCausalLM

    path = resolve(name_or_path)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype), local_files_only=True)
    tokenizer = load_tokenizer(path) if (path / "tokenizer_config.json").is_file() else None
    return model.to(device).eval(), tokenizer


def random_like(name_or_path: str | Path = DEFAULT_MODEL, *, seed: int = 0):
    """``(model, tokenizer)``: the checkpoint's architecture and tokenizer with fresh random weights from ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve(name_or_path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, local_files_only=True))
    return model.eval(), load_tokenizer(path)


@torch.no_grad()
def perturb(model, seed: int, scale: float = 0.05) -> None:
    """Change every parameter in place by seeded Gaussian noise of std ``scale``: a weight sync as a trainer does
    it (the same tensors, new values), reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype) * scale)


def load_tokenizer(path: Path):
    """The tokenizer class the checkpoint declares; ``AutoTokenizer`` only when it declares a specialised one.

    transformers 5.x's ``AutoTokenizer`` replaces a declared generic ``TokenizersBackend`` by the model type's
    registered class (e.g. ``Qwen2Tokenizer`` for ``tiny-qwen2-random``), whose byte-level pre-tokenizer silently
    drops our ``"\\n"`` tokens. Honour the declaration instead.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = json.loads((path / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        if "model_input_names" not in config and "token_type_ids" in tokenizer.model_input_names:
            # transformers 4.x's PreTrainedTokenizerFast returns token_type_ids unless told otherwise (5.0's
            # TokenizersBackend does not), and a causal LM's generate() refuses them; our checkpoints declare none
            tokenizer.model_input_names = [n for n in tokenizer.model_input_names if n != "token_type_ids"]
        return tokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
