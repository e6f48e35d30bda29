"""An architecture zoo: tiny random-weight decoder checkpoints, one per transformers architecture, built on demand.

Each :class:`Arch` names a transformers config factory and the features it exercises (sliding window, soft-capping,
attention sinks, MoE, ...). :func:`build` writes a checkpoint (``config.json``, weights, the bundled character
tokenizer of ``tiny-llama-arith``) into a folder in a second or so, from a fixed seed; nothing is committed.

Shape of every entry: hidden ~64, 2-4 layers, 4 query / 2 key-value heads where the architecture allows it,
``vocab_size`` and special ids of the bundled checkpoint (its 23-token tokenizer padded to 32 rows). Sliding windows
are :data:`WINDOW` tokens, so :mod:`cbverify.zoo.matrix`'s long requests generate well past them.

Weights are made *discriminating* (:func:`sharpen`): every matrix is redrawn with std ``GAIN / sqrt(fan)``, biases
and gpt-oss sinks get unit-scale noise, so attention is far from uniform and greedy top-2 logit gaps are not
near-ties (transformers' default std of 0.02 gives near-uniform attention, under which dropping a window, a softcap
or a sink barely moves a logit and a wrong engine could still pass).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from reference.models import MODELS_DIR

SEED = 1234
WINDOW = 5  # sliding-window size of every windowed entry (tokens, the query's own included)
# std multiplier of the redrawn weights: 1.0 keeps activations O(1) through every layer. Measured at 1.5: the fp32
# noise of hf-generate's KV-cached decoding vs teacher forcing reached 7.7e-5 (gpt-oss) and 9.3e-5 (Mamba; 4.6e-6 when
# run in float64, so noise, not a bug), past the fp32 tier's 5e-5; at 1.0 both stay below 4.4e-6, and dropping the
# window, the softcap or the sinks in cb_impl still moves tokens within the first few positions.
GAIN = 1.0
TOKENIZER_DIR = MODELS_DIR / "tiny-llama-arith"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128)  # fmt: skip
ALTERNATING = ["sliding_attention", "full_attention"]
HYBRID = ["linear_attention", "full_attention"]  # a recurrent layer, then full attention
MAMBA2_SHAPE = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                    mamba_expand=2, mamba_chunk_size=8)  # fmt: skip


def _vocab_size() -> int:
    return int(json.loads((TOKENIZER_DIR / "config.json").read_text())["vocab_size"])


@dataclass(frozen=True, slots=True)
class Arch:
    """One zoo entry: ``name`` (== ``config.model_type``), ``config_class`` (transformers' name), its ``kwargs``
    beyond the shared special ids / vocab, and ``features`` (what it exercises, for the coverage table). A feature
    combination (:mod:`cbverify.zoo.combinations`) sets ``family`` (its ``config.model_type``) and has its own name."""

    name: str
    config_class: str
    kwargs: dict
    features: tuple[str, ...]
    family: str = ""

    @property
    def model_type(self) -> str:
        """The family (``config.model_type``): ``family`` for a combination, else ``name``."""
        return self.family or self.name

    def config(self):
        """A fresh transformers config (shared special ids and vocabulary added)."""
        import transformers

        return getattr(transformers, self.config_class)(vocab_size=_vocab_size(), **SPECIAL, **self.kwargs)


def _d(**overrides) -> dict:
    """The Llama-style decoder shape with ``overrides`` (``None`` drops a key the config does not take)."""
    return {k: v for k, v in (DECODER | overrides).items() if v is not None}


GPT_SHAPE = dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)
# fmt: off
ARCHS: tuple[Arch, ...] = (
    Arch("llama", "LlamaConfig", _d(), ("rope", "gqa")),
    Arch("mistral", "MistralConfig", _d(sliding_window=WINDOW), ("sliding window (all layers)",)),
    Arch("qwen2", "Qwen2Config", _d(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
         ("qkv bias", "sliding window from layer 1 (max_window_layers)")),
    Arch("qwen3", "Qwen3Config", _d(), ("q/k norm",)),
    Arch("qwen3_moe", "Qwen3MoeConfig", _d(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
         ("moe", "q/k norm")),
    Arch("mixtral", "MixtralConfig", _d(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
         ("moe", "sliding window (all layers)")),
    Arch("gemma", "GemmaConfig", _d(), ("scaled embeddings", "gelu")),
    # query_pre_attn_scalar != head_dim (16): a scale taken from the head size instead of the model fails
    Arch("gemma2", "Gemma2Config", _d(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                      final_logit_softcapping=5.0),
         ("attention softcap", "final-logit softcap", "alternating sliding/full")),
    Arch("gemma3_text", "Gemma3TextConfig", _d(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                               layer_types=ALTERNATING),
         ("alternating sliding/full", "local rope", "q/k norm")),
    Arch("phi3", "Phi3Config", _d(sliding_window=WINDOW, head_dim=None), ("fused qkv", "sliding window")),
    Arch("olmo2", "Olmo2Config", _d(head_dim=None), ("q/k norm", "post-norm")),
    Arch("olmo3", "Olmo3Config", _d(head_dim=None, sliding_window=WINDOW, layer_types=ALTERNATING),
         ("alternating sliding/full",)),
    Arch("cohere", "CohereConfig", _d(head_dim=None, logit_scale=0.5), ("parallel block", "logit scale")),
    Arch("cohere2", "Cohere2Config", _d(head_dim=None, logit_scale=0.5, sliding_window=WINDOW,
                                        layer_types=ALTERNATING),
         ("alternating sliding/full", "no rope on full layers")),
    Arch("starcoder2", "Starcoder2Config", _d(head_dim=None, sliding_window=WINDOW), ("bias", "sliding window")),
    Arch("glm4", "Glm4Config", _d(), ("partial rope", "extra norms")),
    Arch("granite", "GraniteConfig", _d(head_dim=None, embedding_multiplier=2.0, attention_multiplier=0.3,
                                        residual_multiplier=0.5, logits_scaling=2.0), ("scaling multipliers",)),
    Arch("helium", "HeliumConfig", _d(), ("rope", "gqa")),
    Arch("gpt_oss", "GptOssConfig", _d(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                       layer_types=ALTERNATING),
         ("attention sinks", "moe", "alternating sliding/full")),
    Arch("gpt2", "GPT2Config", dict(GPT_SHAPE), ("learned positions", "Conv1D")),
    Arch("gptj", "GPTJConfig", dict(GPT_SHAPE, rotary_dim=8), ("partial rope", "parallel block")),
    Arch("gpt_bigcode", "GPTBigCodeConfig", dict(GPT_SHAPE, multi_query=True), ("multi-query", "learned positions")),
    Arch("gpt_neox", "GPTNeoXConfig", _d(head_dim=None, num_key_value_heads=None, rotary_pct=0.5),
         ("partial rope", "parallel residual")),
    Arch("falcon", "FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=128, new_decoder_architecture=True, num_kv_heads=2),
         ("fused qkv", "parallel attention")),
    Arch("opt", "OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=128, word_embed_proj_dim=64), ("learned positions", "bias")),
    Arch("stablelm", "StableLmConfig", _d(head_dim=None, partial_rotary_factor=0.5), ("partial rope", "layernorm")),
    Arch("nemotron", "NemotronConfig", _d(partial_rotary_factor=0.5), ("partial rope", "relu2 mlp")),
    Arch("deepseek_v3", "DeepseekV3Config", _d(head_dim=None, moe_intermediate_size=32, n_routed_experts=4,
                                               num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                               kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                               qk_nope_head_dim=8, v_head_dim=16),
         ("multi-head latent attention", "moe")),
    Arch("llama4_text", "Llama4TextConfig", _d(intermediate_size_mlp=128, num_local_experts=2,
                                               attention_chunk_size=WINDOW, interleave_moe_layer_step=2),
         ("chunked attention", "moe")),
    Arch("lfm2", "Lfm2Config", _d(head_dim=None, num_hidden_layers=3, full_attn_idxs=[1], block_ff_dim=128),
         ("short convolution layers",)),
    Arch("bloom", "BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4), ("alibi", "no max_position_embeddings")),
    Arch("mpt", "MptConfig", dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=128), ("alibi", "max_seq_len")),
    Arch("mamba", "MambaConfig", dict(hidden_size=64, num_hidden_layers=2, state_size=8), ("state-space layers",)),
    # recurrent decode beside (or instead of) attention: a one-token decode updates a fixed-size state, a prefill runs
    # a chunked scan (chunks of 8, so the zoo's requests cross chunk boundaries) or a convolution over the sequence
    Arch("mamba2", "Mamba2Config", dict(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16,
                                        n_groups=1, expand=2, conv_kernel=4, chunk_size=8),
         ("state-space layers", "chunked scan")),
    Arch("qwen3_next", "Qwen3NextConfig", _d(layer_types=HYBRID, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                             linear_value_head_dim=16, linear_num_key_heads=2,
                                             linear_num_value_heads=4, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
         ("gated delta-rule linear attention", "hybrid linear/full attention", "moe")),
    Arch("olmo_hybrid", "OlmoHybridConfig", _d(head_dim=None, layer_types=HYBRID, linear_num_key_heads=2,
                                               linear_num_value_heads=4, linear_key_head_dim=16,
                                               linear_value_head_dim=16, linear_conv_kernel_dim=4),
         ("gated delta-rule linear attention", "hybrid linear/full attention")),
    Arch("falcon_h1", "FalconH1Config", _d(mamba_d_ssm=128, **MAMBA2_SHAPE),
         ("state-space layers", "parallel attention and state-space in every layer", "chunked scan")),
    Arch("bamba", "BambaConfig", _d(head_dim=None, attn_layer_indices=[1], **MAMBA2_SHAPE),
         ("state-space layers", "hybrid state-space/full attention", "chunked scan")),
    Arch("granitemoehybrid", "GraniteMoeHybridConfig", _d(head_dim=None, layer_types=["mamba", "attention"],
                                                          num_local_experts=4, num_experts_per_tok=2,
                                                          shared_intermediate_size=64, **MAMBA2_SHAPE),
         ("state-space layers", "hybrid state-space/full attention", "moe")),
    Arch("jamba", "JambaConfig", _d(head_dim=None, num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
                                    expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
                                    mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8),
         ("state-space layers", "hybrid state-space/full attention", "moe")),
)
# fmt: on


def by_name(name: str) -> Arch:
    for arch in ARCHS:
        if arch.name == name:
            return arch
    raise KeyError(f"no zoo architecture {name!r}; known: {', '.join(a.name for a in ARCHS)}")


def sharpen(model, gain: float | None = None) -> None:
    """Redraw weights so the model is discriminating (module docstring): matrices ~ N(0, gain / sqrt(fan)) with fan
    the smaller of the last two dims, biases and attention sinks ~ N(0, 0.5); norms, convolutions and state-space
    parameters keep transformers' initialisation."""
    import torch

    gain = GAIN if gain is None else gain
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "conv" in name or leaf in ("A_log", "D", "dt_bias") or "norm" in name:
                continue
            if p.ndim >= 2:
                p.normal_(0.0, gain / math.sqrt(min(p.shape[-2:])))
            elif leaf.endswith("bias") or leaf == "sinks":
                p.normal_(0.0, 0.5)


def build(arch: Arch | str, directory: Path | str, *, seed: int = SEED) -> Path:
    """Write ``arch``'s checkpoint to ``directory/<name>`` (created) and return that folder."""
    import torch
    from transformers import AutoModelForCausalLM

    arch = by_name(arch) if isinstance(arch, str) else arch
    out = Path(directory) / arch.name
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(arch.config())
    sharpen(model)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, out / name)
    return out


def load(arch: Arch | str, directory: Path | str):
    """``(model, tokenizer)`` of ``arch`` from ``directory`` (built there first if absent), float32, eval mode."""
    from reference.models import load as load_checkpoint

    name = arch if isinstance(arch, str) else arch.name
    path = Path(directory) / name
    if not (path / "config.json").is_file():
        build(arch, directory)
    return load_checkpoint(path)
