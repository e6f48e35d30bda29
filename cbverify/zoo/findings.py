"""Registered upstream failures of an engine: on some architectures (the zoo), on the feature combinations of a family
that have some features (:mod:`cbverify.zoo.combinations`), or on all architectures for some transformers releases
(``cbverify verify`` and the compatibility tests, run in every matrix venv). :mod:`cbverify.zoo.matrix`
reports such a cell as ``XFAIL(<id>)`` and ``verify`` such a row, when every problem of the row is one the entry
explains; the zoo test fails the day a cell passes again (``FIXED?``), so the registry is updated when upstream fixes
it. Each entry carries measured evidence and the transformers versions it was seen on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from cbverify.upstream.findings import transformers_in


@dataclass(frozen=True, slots=True)
class ArchitectureFinding:
    """An upstream engine that crashes on, or diverges from the oracle on, the zoo architectures named."""

    id: str
    engine: str  # an engine name of ``cbverify.engines``
    architectures: tuple[str, ...]  # zoo architecture names (config.model_type); () means every architecture
    affected: str
    evidence: str
    transformers: str = ""  # PEP 440 specifier, as Finding.transformers
    # the failure it predicts: every problem line of the report must match one of these regular expressions (the
    # exception and message the engine raises, or the kind of wrong number): another failure is not this finding's
    problems: tuple[str, ...] = ()
    features: tuple[str, ...] = ()  # the entry's features it needs, all of them (Arch.features); () means any

    def __post_init__(self) -> None:
        if not self.problems:
            raise ValueError(f"architecture finding {self.id}: problems must predict the failure it excuses")

    def explains(self, problems: Sequence[str]) -> bool:
        return all(any(re.search(p, line) for p in self.problems) for line in problems)


def _crash(message: str) -> str:
    """The problem line of a transformers-cb run whose requests failed upstream with exactly ``message``."""
    return r"^generate raised EngineError: transformers-cb: request '[^']+' failed upstream: " + re.escape(message)


ZOO_SEEN = "transformers 5.24.0 (torch 2.13.0, CPU, float32; the only version the zoo was run on)"
ARCHITECTURE_FINDINGS: tuple[ArchitectureFinding, ...] = (
    ArchitectureFinding(
        id="cb-leaves-paged-attention",
        engine="transformers-cb",
        architectures=(),
        affected="transformers 5.8.1 (torch 2.13.0, CPU, float32, tiny-llama-arith); not 5.9.0 to 5.24.0 (cbverify "
        "matrix --all-minors 5.8)",
        evidence="after a manager is stopped the model's attn_implementation is 'paged|sdpa' (was 'sdpa'): every "
        "later forward of the caller, the oracle's included, runs the paged kernels (teacher-forced log-probs of the "
        "trained Llama then off by up to 15 nats: the trainer-side effect is the upstream finding "
        "cb-leaves-paged-attention-for-training)",
        transformers="<5.9",
        problems=("model state changed by the engine: attn_implementation",),
    ),
    ArchitectureFinding(
        id="cb-ignores-attention-softcap",
        engine="transformers-cb",
        architectures=("gemma2",),
        affected=ZOO_SEEN,
        evidence="no error, wrong numbers: the first greedy token's log-prob is -1.458 where teacher forcing gives "
        "-1.553 (12-token prompt; -1.021 vs -0.947 on a 3-token one), and sampled requests pick tokens outside the "
        "reference's top-k support (log-prob diff inf); the same checkpoint with attn_logit_softcapping=None passes "
        "(max |dlogp| 9.5e-7), so CB's paged attention drops the softcap. Feature combinations: each of the 16 "
        "gemma2 ones with attn_logit_softcapping=2.0 (window none / all / alternating / from layer 1, final-logit "
        "softcap, tied) fails so (log-probs off by 0.096 to 0.44 nats, or inf for a token outside the reference's "
        "support; the 8 untied ones also diverge in greedy tokens at positions 1-4), each of the 16 without it "
        "passes",
        features=("attention softcap",),
        problems=(r"^request '[^']+'( \([^)]*\))?: tokens diverge at position \d+", r"^log-probs off: max "),
    ),
    ArchitectureFinding(
        id="cb-cache-lacks-get-seq-length",
        engine="transformers-cb",
        architectures=("falcon", "opt", "bloom"),
        affected=ZOO_SEEN,
        evidence="every request fails at the first step: the model's forward calls cache.get_seq_length() on the "
        "PagedAttentionCache CB passes (AttributeError: 'PagedAttentionCache' object has no attribute "
        "'get_seq_length'); the manager logs it and returns the requests failed",
        problems=(_crash("'PagedAttentionCache' object has no attribute 'get_seq_length'"),),
    ),
    ArchitectureFinding(
        id="cb-gpt-neox-cache-update-signature",
        engine="transformers-cb",
        architectures=("gpt_neox",),
        affected=ZOO_SEEN,
        evidence="every request fails at the first step: GPTNeoXAttention calls layer_past.update(k, v, layer_idx) "
        "and PagedAttentionCache.update() requires a further 'kwargs' argument (TypeError)",
        problems=(_crash("PagedAttentionCache.update() missing 1 required positional argument: 'kwargs'"),),
    ),
    ArchitectureFinding(
        id="cb-missing-cu-seq-lens-k",
        engine="transformers-cb",
        architectures=("stablelm", "nemotron"),
        affected=ZOO_SEEN,
        evidence="every request fails at the first step with KeyError: 'cu_seq_lens_k' (the paged attention reads "
        "CB's varlen metadata, which these models' forward does not pass through to the attention function)",
        problems=(_crash("'cu_seq_lens_k'"),),
    ),
    ArchitectureFinding(
        id="cb-mpt-mask-crash",
        engine="transformers-cb",
        architectures=("mpt",),
        affected=ZOO_SEEN,
        evidence="every request fails at the first step: MptModel builds its ALiBi mask from attention_mask, which "
        "CB passes as None (AttributeError: 'NoneType' object has no attribute 'to')",
        problems=(_crash("'NoneType' object has no attribute 'to'"),),
    ),
    ArchitectureFinding(
        id="cb-mla-cache-shape",
        engine="transformers-cb",
        architectures=("deepseek_v3",),
        affected=ZOO_SEEN,
        evidence="every request fails at the first step: the paged cache is sized num_key_value_heads x head_dim "
        "(2 x 8) while multi-head latent attention writes 4 heads x 16 (RuntimeError in index_copy_: source/"
        "destination slice shapes differ)",
        problems=(_crash("index_copy_(): Source/destination tensor must have same slice shapes"),),
    ),
    ArchitectureFinding(
        id="cb-temperature-tuning-get-seq-length",
        engine="transformers-cb",
        architectures=("llama4_text",),
        affected=ZOO_SEEN,
        evidence="every request fails at the first step: Llama4TextAttention's attention temperature tuning on a NoPE "
        "layer counts positions with cache.get_seq_length(layer_idx), which the PagedAttentionCache CB passes lacks "
        "(AttributeError: 'PagedAttentionCache' object has no attribute 'get_seq_length'); each of the 8 unchunked "
        "llama4_text feature combinations with no_rope_layers=[1, 0] and attn_temperature_tuning fails so, each of "
        "the 8 with the same NoPE layer and the tuning off passes (CB refuses the chunked ones)",
        features=("no rope on layer 1", "attention temperature tuning"),
        problems=(_crash("'PagedAttentionCache' object has no attribute 'get_seq_length'"),),
    ),
)


def architecture_finding(engine: str, arch: str, problems: Sequence[str] = (),
                         features: Sequence[str] | None = None) -> ArchitectureFinding | None:  # fmt: skip
    """The registered finding that explains ``engine`` failing on architecture ``arch`` (a ``config.model_type``) with
    ``problems`` (the report's problem lines) on the installed transformers, if any; with ``features`` (a zoo entry's
    or a combination's), only a finding whose ``features`` are all among them."""
    for f in ARCHITECTURE_FINDINGS:
        if features is not None and not set(f.features) <= set(features):
            continue
        if f.engine == engine and (not f.architectures or arch in f.architectures):
            if transformers_in(f.transformers) and f.explains(problems):
                return f
    return None


def registered(finding_id: str) -> ArchitectureFinding | None:
    """The finding ``finding_id`` if the installed transformers is in its range (tests that expect it use this)."""
    found = [f for f in ARCHITECTURE_FINDINGS if f.id == finding_id]
    if not found:
        raise KeyError(f"no registered finding {finding_id!r}")
    return found[0] if transformers_in(found[0].transformers) else None
