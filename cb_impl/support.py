"""Which models cb_impl drives exactly, decided from the model's config at construction, before any work.

cb_impl runs an unmodified Hugging Face decoder with its attention routed to the paged attention, which implements
causal attention over each sequence's prefix, per layer optionally with a sliding window (``sliding_window``, or
where the model passes none the window of its own mask: :func:`mask_window`), logit soft-capping (``softcap``) and
attention sinks (``s_aux``), as transformers passes them. Anything else that mixes tokens is refused here with
:class:`UnsupportedModel` naming the feature, never run into wrong tokens or a failure at the first step:

- multimodal or encoder-decoder models (cb_impl drives text-only decoders, as TRL's CB);
- no attention heads: a state-space / recurrent model (Mamba, RWKV);
- ``layer_types`` other than full / sliding attention: convolution (LFM2), linear-attention, state-space (hybrids)
  or chunked-attention (Llama 4) layers, whose state or mask the paged cache does not carry;
- ``attention_chunk_size``: chunked attention (Llama 4), a mask transformers builds and cb_impl does not;
- multi-head latent attention (DeepSeek-V3's ``kv_lora_rank``): keys and values of another shape than the cache's;
- ALiBi position biases (BLOOM, MPT, Falcon with ``alibi``): passed as a mask, which cb_impl does not receive;
- attention temperature tuning on NoPE layers (Llama 4): it scales queries by positions counted from a cache;
- (in ``cb_impl.attention``) a model whose attention does not go through transformers' ``AttentionInterface``.

Oracle of the verdict: the architecture zoo (``cbverify.zoo``) runs every architecture, and every combination of
config features its families honour (``cbverify.zoo.combinations``), through the engine against
``reference.generate``: each one is exact or refused here. Imports no torch.
"""

from __future__ import annotations

FULL_OR_SLIDING = ("full_attention", "sliding_attention")
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len",
                  "n_ctx")  # fmt: skip
MULTIMODAL_FIELDS = ("vision_config", "audio_config", "image_token_id", "image_token_index")


class UnsupportedModel(ValueError):
    """The model has a feature cb_impl does not implement; raised by ``LLMEngine(...)``, the message names it."""


def _alibi(cfg: object) -> bool:
    attn = getattr(cfg, "attn_config", None)
    attn_alibi = attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False)
    return getattr(cfg, "model_type", "") == "bloom" or bool(getattr(cfg, "alibi", False)) or bool(attn_alibi)


def unsupported_features(cfg: object) -> list[str]:
    """The features of config ``cfg`` cb_impl cannot run exactly, in words; empty when it can."""
    found = []
    multimodal = [k for k in MULTIMODAL_FIELDS if getattr(cfg, k, None) is not None]
    if multimodal or getattr(cfg, "is_encoder_decoder", False):
        found.append(f"multimodal or encoder-decoder ({', '.join(multimodal) or 'encoder-decoder'}): cb_impl drives"
                     " text-only decoder models")  # fmt: skip
    if not getattr(cfg, "num_attention_heads", None):
        found.append("no attention heads (a state-space or recurrent model)")
    kinds = set(getattr(cfg, "layer_types", None) or ()) | set(getattr(cfg, "layers_block_type", None) or ())
    other = sorted(kinds - {*FULL_OR_SLIDING, "attention"})  # layers_block_type: Jamba-style hybrids
    if other:
        found.append(f"layer types {other}: convolution / linear-attention / state-space / chunked layers")
    if getattr(cfg, "attention_chunk_size", None) is not None:
        found.append(f"chunked attention (attention_chunk_size={cfg.attention_chunk_size})")
    if getattr(cfg, "kv_lora_rank", None):
        found.append("multi-head latent attention (kv_lora_rank): its keys/values do not have the config's head shape")
    if _alibi(cfg):
        found.append("ALiBi position biases")
    if getattr(cfg, "attn_temperature_tuning", False) and 0 in (getattr(cfg, "no_rope_layers", None) or ()):
        found.append("attention temperature tuning on NoPE layers: its query scale counts positions from a cache "
                     "(0 without one), not the positions of the packed forward")  # fmt: skip
    return found


def mask_window(cfg: object, layer: int) -> int | None:
    """The window transformers' mask builder gives layer ``layer`` (for a model that passes no ``sliding_window``):
    ``cfg.sliding_window`` on the layers ``cfg.layer_types`` marks sliding, on all of them without ``layer_types``
    (a ``layer_types`` its config class does not declare is a stray attribute the model never reads)."""
    fields = getattr(type(cfg), "__dataclass_fields__", None)
    types = getattr(cfg, "layer_types", None) if fields is None or "layer_types" in fields else None
    return getattr(cfg, "sliding_window", None) if not types or types[layer] == "sliding_attention" else None


def check_supported(model: object) -> None:
    """Raise :class:`UnsupportedModel` if cb_impl cannot run ``model`` exactly (see the module docstring)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "get_input_embeddings"):
        raise UnsupportedModel(f"{type(model).__name__} is not a Hugging Face model (no config / input embeddings)")
    found = unsupported_features(cfg)
    if found:
        raise UnsupportedModel(f"{type(model).__name__} is not supported by cb_impl: {'; '.join(found)}")


def context_length(cfg: object) -> int:
    """The model's longest context: the first of :data:`CONTEXT_FIELDS` set in ``cfg``, else 0 (unknown)."""
    return next((int(v) for v in (getattr(cfg, f, None) for f in CONTEXT_FIELDS) if v), 0)
