"""The models a benchmark runs: a random-weight Llama shaped for the device, or any bundled / local checkpoint.

- ``random`` on CPU: Llama, hidden 256, 4 layers, 8 query / 4 KV heads (head dim 32), MLP 688, vocab 4096: 5.0M
  parameters, big enough that the model's matmuls (the LM head alone is 1M MACs per token) rather than Python
  dominate a decode step at batch >= 16, small enough for the full CPU run to fit ~10 minutes on 2 cores.
- ``random`` on CUDA: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocab 128256, tied
  embeddings, rope theta 500000) with random weights in bf16, when no checkpoint is given.
- anything else: ``reference.models.load(name_or_path)`` (bundled names or a local Hugging Face directory).

Weights are seeded (``torch.manual_seed(0)``), so every engine and every subprocess sees the same model.
The attention implementation is the best available: ``flash_attention_2`` on CUDA when installed, else ``sdpa``.
"""

from __future__ import annotations

import importlib.util

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from reference import tasks

RANDOM = "random"


def cpu_random_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tasks.BOS_ID, eos_token_id=tasks.EOS_ID, pad_token_id=tasks.PAD_ID,
    )  # fmt: skip


def cuda_random_config() -> LlamaConfig:
    """Llama-3.2-1B's published shape (config.json of meta-llama/Llama-3.2-1B), without its rope scaling."""
    return LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=True, bos_token_id=tasks.BOS_ID, eos_token_id=tasks.EOS_ID, pad_token_id=tasks.PAD_ID,
    )  # fmt: skip


def best_attention(device: str) -> str:
    if device.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def parse_dtype(name: str | None, device: str) -> torch.dtype:
    """``None`` -> the device default (fp32 CPU, bf16 CUDA); else one of float32 / bfloat16 / float16."""
    if name is None:
        return default_dtype(device)
    from reference.models import parse_dtype as parse

    return parse(name)


def load_bench_model(name: str, *, device: str = "cpu", dtype: torch.dtype | None = None):
    """``(model, description)`` in eval mode on ``device``; ``name`` is ``random`` or a bundled name / local path."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    dtype = dtype or default_dtype(device)
    attn = best_attention(device)
    if name == RANDOM:
        config = cuda_random_config() if device.startswith("cuda") else cpu_random_config()
        config._attn_implementation = attn
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
        label = "random Llama-3.2-1B shape" if device.startswith("cuda") else "random Llama h256 L4 V4096"
    else:
        from reference.models import load

        model, _ = load(name, dtype=dtype, device=device)
        model.set_attn_implementation(attn)
        label = name
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    return model, {"model": label, "parameters": params, "dtype": str(dtype).removeprefix("torch."),
                   "attn_implementation": attn, "vocab_size": model.config.vocab_size}  # fmt: skip
