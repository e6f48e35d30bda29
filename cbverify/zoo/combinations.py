"""Feature combinations: zoo checkpoints built as a family plus feature switches, kept only where the model applies
every switch.

A :class:`Family` is a transformers config class in the zoo's shape (``architectures._d``: 2 layers) with the
features it always has (MoE, attention sinks, q/k norm). A :data:`SWITCHES` entry is one feature and its values, each
a few config fields; a switch applies to a family whose config class declares one of its fields (an undeclared field
is stored on the config and ignored by the model). :func:`candidates` is every family x switch-value product;
:func:`verify` keeps a candidate only when the model built from it does what each value says, observed on the model
itself in float32, with transformers' eager attention, on the zoo's 12-token prompt, independently of any engine:

- attention pattern (sliding window on all layers / alternating / from layer 1, chunked attention): the keys each
  layer's attention probabilities give non-zero weight are full causal, a window of ``WINDOW`` or chunks of
  ``WINDOW``, layer by layer as the switches ask;
- attention sinks: rows of probabilities sum below 1 (the sink takes the rest), on the family that has them;
- soft-capping (attention scores, final logits), q/k norm, a NoPE layer, attention temperature tuning: the logits
  change when that switch alone is turned off (same weights);
- tied embeddings: the output embedding is the input embedding's tensor; MoE: the decoder layers holding experts;
- a family's fixed q/k norm or shared expert: a module of that name (:data:`FIXED`).

A value the family ignores is no combination: Mistral, Mixtral, PhiMoE, Phi-3, Starcoder2 and Qwen3-MoE have one
``sliding_window`` for every layer (no ``layer_types``), Llama 4 has no sliding layers. :func:`combinations` returns
the verified ones and the rejected ones with the reason; each combination is an :class:`~.architectures.Arch`
(``family`` set, ``name`` its tags) that :mod:`.matrix` runs like any zoo entry.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from dataclasses import dataclass
from functools import cache

from cbverify.zoo.architectures import DECODER, SEED, WINDOW, Arch, _d, sharpen

LAYERS = DECODER["num_hidden_layers"]
FULL, SLIDING = "full_attention", "sliding_attention"
PROBE = (1, 19, 4, 13, 7, 15, 9, 16, 18, 21, 20, 17)  # the zoo's long prompt (cbverify.zoo.matrix.PROMPTS)
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass(frozen=True, slots=True)
class Value:
    """One value of a switch: ``tag`` names it in a combination (``""``: the switch's off value), ``feature`` in
    words for the coverage table, ``kwargs`` the config fields it sets (those the family declares are applied)."""

    tag: str
    feature: str
    kwargs: dict


@dataclass(frozen=True, slots=True)
class Family:
    """A config class in the zoo's shape: ``kwargs`` beyond the shared ones, ``features`` it always has."""

    name: str  # == config.model_type
    config_class: str
    kwargs: dict
    features: tuple[str, ...] = ()


def _window(tag: str, feature: str, types: list[str]) -> Value:
    """A window layout: ``layer_types`` where the family declares it (the window size then stays set, as such a
    family builds its sliding mask whatever the types say), else one window on every layer or none."""
    sliding = SLIDING in types
    return Value(tag, feature, dict(use_sliding_window=sliding, sliding_window=WINDOW if sliding else None,
                                    layer_types=types))  # fmt: skip


# fmt: off
SWITCHES: dict[str, tuple[Value, ...]] = {  # the first value of each switch is its off value
    "window": (_window("", "", [FULL] * LAYERS),
               _window("win-all", "sliding window (all layers)", [SLIDING] * LAYERS),
               _window("win-alt", "alternating sliding/full", [SLIDING, FULL]),
               _window("win-from1", "sliding window from layer 1", [FULL, SLIDING])),
    "attention softcap": (Value("", "", dict(attn_logit_softcapping=None)),
                          Value("softcap", "attention softcap", dict(attn_logit_softcapping=2.0))),
    "final softcap": (Value("", "", dict(final_logit_softcapping=None)),
                      Value("final-softcap", "final-logit softcap", dict(final_logit_softcapping=5.0))),
    "chunked": (Value("", "", dict(attention_chunk_size=None)),
                Value("chunked", "chunked attention", dict(attention_chunk_size=WINDOW))),
    "q/k norm": (Value("", "", dict(use_qk_norm=False)), Value("qknorm", "q/k norm", dict(use_qk_norm=True))),
    "nope": (Value("", "", dict(no_rope_layers=[1] * LAYERS)),  # Llama 4's flag: 1 = the layer uses rope
             Value("nope1", "no rope on layer 1", dict(no_rope_layers=[1, 0]))),
    # Llama 4 scales NoPE layers' queries from position floor_scale - 1 on (default 8192: never reached here)
    "temperature tuning": (Value("", "", dict(attn_temperature_tuning=False)),
                           Value("temp", "attention temperature tuning", dict(attn_temperature_tuning=True,
                                                                               floor_scale=4))),
    "moe layers": (Value("", "", dict(mlp_only_layers=[], interleave_moe_layer_step=1, first_k_dense_replace=0)),
                   Value("dense0", "dense layer 0", dict(mlp_only_layers=[0], interleave_moe_layer_step=2,
                                                         first_k_dense_replace=1))),
    "tied": (Value("", "", dict(tie_word_embeddings=False)),
             Value("tied", "tied embeddings", dict(tie_word_embeddings=True))),
}
# the field whose declaration makes a switch apply (Llama 4 declares layer_types for its chunked layers, but has no
# sliding window: the window switch is not Llama 4's)
KEYS = {"window": "sliding_window", "attention softcap": "attn_logit_softcapping",
        "final softcap": "final_logit_softcapping", "chunked": "attention_chunk_size", "q/k norm": "use_qk_norm",
        "nope": "no_rope_layers", "temperature tuning": "attn_temperature_tuning",
        "moe layers": "mlp_only_layers|interleave_moe_layer_step|first_k_dense_replace", "tied": "tie_word_embeddings"}
TOGGLED = ("attention softcap", "final softcap", "q/k norm", "nope", "temperature tuning")  # seen in the logits
# a family's fixed features beyond moe and attention sinks, each seen in a parameter name
FIXED = {"q/k norm": ("q_norm.weight", "q_layernorm.weight"), "shared expert": ("shared_expert",)}
SINK_GAP = 1e-4  # a row of float32 probabilities summing below 1 - SINK_GAP had a sink (rounding stays below 1e-6)

FAMILIES: tuple[Family, ...] = (
    Family("qwen2_moe", "Qwen2MoeConfig", _d(**MOE, shared_expert_intermediate_size=32), ("moe", "shared expert")),
    Family("phimoe", "PhimoeConfig", _d(**MOE), ("moe",)),
    Family("mixtral", "MixtralConfig", _d(**MOE), ("moe",)),
    Family("qwen3_moe", "Qwen3MoeConfig", _d(**MOE), ("moe", "q/k norm")),
    Family("gpt_oss", "GptOssConfig", _d(**MOE), ("moe", "attention sinks")),
    Family("llama4_text", "Llama4TextConfig", _d(**MOE, intermediate_size_mlp=128), ("moe",)),
    Family("dots1", "Dots1Config", _d(**MOE, n_shared_experts=1, n_group=1, topk_group=1),
           ("moe", "shared expert")),
    Family("granitemoe_swa", "GraniteMoeSWAConfig", _d(**MOE), ("moe",)),
    Family("mistral", "MistralConfig", _d()),
    Family("qwen2", "Qwen2Config", _d()),
    Family("qwen3", "Qwen3Config", _d(), ("q/k norm",)),
    Family("gemma2", "Gemma2Config", _d(query_pre_attn_scalar=24)),
    Family("gemma3_text", "Gemma3TextConfig", _d(query_pre_attn_scalar=24), ("q/k norm",)),
    Family("olmo3", "Olmo3Config", _d(head_dim=None), ("q/k norm",)),
    Family("smollm3", "SmolLM3Config", _d()),
    Family("phi3", "Phi3Config", _d(head_dim=None)),
    Family("cohere2", "Cohere2Config", _d(head_dim=None, logit_scale=0.5)),
    Family("exaone4", "Exaone4Config", _d(), ("q/k norm",)),
)
# fmt: on


@cache
def declared(config_class: str) -> frozenset[str]:
    """The fields ``config_class`` declares (its dataclass fields, or its ``__init__`` parameters)."""
    import transformers

    cls = getattr(transformers, config_class)
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls))
    return frozenset(inspect.signature(cls.__init__).parameters)


def switches(family: Family) -> dict[str, tuple[Value, ...]]:
    """The switches that apply to ``family``: its config declares the switch's key field (:data:`KEYS`)."""
    fields = declared(family.config_class)
    return {s: vs for s, vs in SWITCHES.items() if fields & set(KEYS[s].split("|"))}


@dataclass(frozen=True, slots=True)
class Candidate:
    """A family with one value per applicable switch (``values``: switch -> Value, in :data:`SWITCHES` order)."""

    family: Family
    values: tuple[tuple[str, Value], ...]

    @property
    def name(self) -> str:
        """``family+tag+...`` of the switches on, ``family+base`` with none: never a zoo architecture's name (the
        matrix keys cells and checkpoint folders by name)."""
        tags = [v.tag for _, v in self.values if v.tag]
        return "+".join([self.family.name, *(tags or ["base"])])

    @property
    def features(self) -> tuple[str, ...]:
        return (*self.family.features, *(v.feature for _, v in self.values if v.feature))

    def kwargs(self, off: str | None = None) -> dict:
        """The config kwargs, only fields the config class declares (the family's shape included: the shared MoE
        sizes name each family's fields), with switch ``off`` at its off value."""
        fields = declared(self.family.config_class)
        out = {k: v for k, v in self.family.kwargs.items() if k in fields}
        for switch, value in self.values:
            value = SWITCHES[switch][0] if switch == off else value
            out |= {k: v for k, v in value.kwargs.items() if k in fields}
        if "layer_types" in out and out.get("sliding_window", 0) is None:  # see _window
            out["sliding_window"] = WINDOW
        return out

    def arch(self, off: str | None = None) -> Arch:
        return Arch(self.name, self.family.config_class, self.kwargs(off), self.features, family=self.family.name)

    def expected_kinds(self) -> list[str]:
        """Each layer's attention pattern the switches ask for: full, window or chunk (chunked attention on the
        layers that use rope: Llama 4's NoPE layers attend to the whole prefix)."""
        chosen = dict(self.values)
        types = chosen["window"].kwargs["layer_types"] if "window" in chosen else [FULL] * LAYERS
        kinds = ["window" if t == SLIDING else "full" for t in types]
        if "chunked" in chosen and chosen["chunked"].tag:
            rope = chosen["nope"].kwargs["no_rope_layers"] if "nope" in chosen else [1] * LAYERS
            kinds = ["chunk" if r else k for k, r in zip(kinds, rope, strict=True)]
        return kinds


def candidates(families=FAMILIES) -> list[Candidate]:
    """Every family x value product of its applicable switches, in order."""
    out = []
    for family in families:
        applicable = switches(family)
        for values in itertools.product(*applicable.values()):
            out.append(Candidate(family, tuple(zip(applicable, values, strict=True))))
    return out


def _model(arch: Arch, weights=None):
    """``arch``'s model, float32, eager attention, discriminating weights from :data:`SEED` (or ``weights``)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(arch.config(), attn_implementation="eager").eval()
    if weights is None:
        sharpen(model)
    else:
        model.load_state_dict(weights, strict=False)
    return model


def attention_kinds(attentions) -> tuple[list[str], bool]:
    """Per layer, the pattern of keys with non-zero probability (full / window / chunk / other), and whether any row
    of probabilities sums below 1 (a sink took the rest)."""
    import torch

    n = attentions[0].shape[-1]
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = k <= q
    patterns = {"full": causal, "window": causal & (k > q - WINDOW), "chunk": causal & (k // WINDOW == q // WINDOW)}
    kinds = []
    for probs in attentions:  # (1, H, n, n)
        seen = (probs[0] > 0).any(0)
        kinds.append(next((name for name, p in patterns.items() if torch.equal(seen, p)), "other"))
    sinks = any(bool((probs.sum(-1) < 1 - SINK_GAP).any()) for probs in attentions)
    return kinds, sinks


def _moe_layers(model) -> list[bool]:
    return [any("experts" in n for n, _ in layer.named_parameters()) for layer in model.model.layers]


def verify(candidate: Candidate) -> str:
    """Why the model built from ``candidate`` does not do what it asks ("" when it does: a combination)."""
    import torch

    ids = torch.tensor([PROBE])
    try:
        model = _model(candidate.arch())
        with torch.no_grad():
            out = model(ids, output_attentions=True)
        kinds, sinks = attention_kinds(out.attentions)
        if kinds != candidate.expected_kinds():
            return f"attention per layer {kinds}, asked {candidate.expected_kinds()}"
        if sinks != ("attention sinks" in candidate.family.features):
            return f"attention sinks {'seen' if sinks else 'not seen'}"
        chosen = dict(candidate.values)
        if "tied" in chosen:
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            if tied != bool(chosen["tied"].tag):
                return f"tie_word_embeddings={bool(chosen['tied'].tag)} but tied is {tied}"
        moe = _moe_layers(model)
        dense0 = bool(chosen["moe layers"].tag) if "moe layers" in chosen else False
        want = [not (dense0 and i == 0) and "moe" in candidate.family.features for i in range(LAYERS)]
        if moe != want:
            return f"experts on layers {moe}, asked {want}"
        names = [n for n, _ in model.named_parameters()]
        for feature in set(candidate.family.features) & FIXED.keys():
            if not any(part in n for n in names for part in FIXED[feature]):
                return f"no parameter named like {FIXED[feature]} ({feature})"
        for switch in TOGGLED:
            if switch in chosen and chosen[switch].tag:
                off = _model(candidate.arch(off=switch), model.state_dict())
                with torch.no_grad():
                    if torch.equal(off(ids).logits, out.logits):
                        return f"{switch}: the logits do not change when it is turned off"
    except Exception as err:  # a value the model cannot build or run with is no combination either
        return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
    return ""


def combinations(families=FAMILIES) -> tuple[list[Arch], list[tuple[str, str]]]:
    """The verified combinations (as :class:`Arch`) and the rejected candidates ``(name, reason)``."""
    kept, rejected = [], []
    for candidate in candidates(families):
        reason = verify(candidate)
        if reason:
            rejected.append((candidate.name, reason))
        else:
            kept.append(candidate.arch())
    return kept, rejected
