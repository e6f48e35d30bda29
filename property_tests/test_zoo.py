"""Every architecture of the zoo (``cbverify.zoo``) is exact or refused up front, on every engine.

For each architecture, ``cbverify.zoo.matrix.run_architecture`` runs greedy and sampled requests (two of them well
past the sliding window) through ``reference``, ``cb_impl``, ``hf-generate`` and ``transformers-cb`` in float32 and
judges them as ``cbverify verify`` does. Each (engine, architecture) must be PASS, NOT-APPLICABLE with a one-line
reason, or a registered architecture finding (``cbverify.zoo.findings.ARCHITECTURE_FINDINGS``) that still reproduces:
each finding is also a strict expected failure, so a fix upstream turns the suite red until the entry is removed.
cb_impl and the reference have no findings: cb_impl is exact or raises ``UnsupportedModel`` at construction.

The feature combinations (``cbverify.zoo.combinations``: a family's config with feature switches, kept where the
model applies them) are held to the same: a drawn combination is exact (every token the oracle's) or refused up front
by cb_impl; the verification itself keeps what a model applies and rejects what it ignores; a finding registered on
combinations is a strict expected failure of its smallest combination, which passes with the finding's features off.
Every combination through every engine, and the coverage doc's combination rows, are slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, example, given, settings

from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from cb_impl.support import UnsupportedModel, unsupported_features
from cbverify import zoo
from cbverify.zoo import combinations as combos
from cbverify.zoo.findings import ARCHITECTURE_FINDINGS, ArchitectureFinding
from cbverify.zoo.matrix import Cell, render_markdown, run_architecture
from property_tests.strategies import zoo_combinations

ARCH_NAMES = [a.name for a in zoo.ARCHS]
# Recurrent entries beyond the Qwen3-Next-style hybrid and the first two (lfm2, mamba): transformers' PyTorch fallback
# of their scans takes ~40-60 ms a forward on a shared 2-core CPU, so each costs the default run tens of seconds
SLOW_ARCHS = {"mamba2", "olmo_hybrid", "falcon_h1", "bamba", "granitemoehybrid", "jamba"}
ARCH_PARAMS = [pytest.param(a, marks=pytest.mark.slow) if a in SLOW_ARCHS else a for a in ARCH_NAMES]
_CELLS: dict[str, dict[str, Cell]] = {}


class FindingReproduces(AssertionError):
    """Raised only when every architecture a finding names still FAILs on its engine (the strict-xfail trigger)."""


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("zoo"))


def cells(arch: str, directory: str) -> dict[str, Cell]:
    """Engine -> verdict for ``arch``, computed once per module (the findings' tests reuse them)."""
    if arch not in _CELLS:
        _CELLS[arch] = {c.engine: c for c in run_architecture(arch, directory)}
    return _CELLS[arch]


def test_the_zoo_covers_twenty_architectures_with_windows_softcaps_sinks_and_moe():
    required = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt2",
                "gpt_neox", "falcon", "gpt_oss", "cohere", "starcoder2"}  # fmt: skip
    assert len(ARCH_NAMES) >= 20 and len(set(ARCH_NAMES)) == len(ARCH_NAMES)
    assert required <= set(ARCH_NAMES) and {"qwen3_moe", "mixtral"} & set(ARCH_NAMES)
    features = " ".join(f for a in zoo.ARCHS for f in a.features)
    for feature in (
        "sliding",
        "softcap",
        "sinks",
        "moe",
        "chunked",
        "convolution",
        "alibi",
        "state-space",
        "delta-rule linear attention",
        "hybrid",
    ):
        assert feature in features, feature
    for arch in zoo.ARCHS:
        assert arch.config().model_type == arch.name


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_every_engine_passes_is_refused_up_front_or_fails_as_registered(arch, zoo_dir):
    verdicts = cells(arch, zoo_dir)
    lines = [f"{c.engine}: {c.status} {c.detail}" for c in verdicts.values()]
    assert all(c.ok for c in verdicts.values()), "\n".join(lines)
    assert verdicts["reference"].status == "PASS", lines
    assert verdicts["cb_impl"].status in ("PASS", "N/A"), lines
    for cell in verdicts.values():
        if cell.status == "N/A":
            assert cell.detail and "\n" not in cell.detail, cell
    model, _ = zoo.load(arch, zoo_dir)
    if verdicts["cb_impl"].status == "N/A":  # refused at construction, not at a step
        with pytest.raises(UnsupportedModel, match="is not supported by cb_impl: "):
            LLMEngine(model, EngineConfig(num_blocks=8))
    else:
        assert not unsupported_features(model.config)


def zoo_archs(finding: ArchitectureFinding) -> list[str]:
    """The zoo architectures ``finding`` is about: named by it, with every feature it needs."""
    return [
        a for a in finding.architectures if a in ARCH_NAMES and set(finding.features) <= set(zoo.by_name(a).features)
    ]


@pytest.mark.parametrize(
    "finding",
    [pytest.param(f, id=f.id, marks=pytest.mark.xfail(strict=True, raises=FindingReproduces, reason=f.id))
     for f in ARCHITECTURE_FINDINGS if zoo_archs(f)],  # the others: every architecture on some releases; combinations
)  # fmt: skip
def test_the_engine_behind_each_architecture_finding_matches_the_reference(finding: ArchitectureFinding, zoo_dir):
    """Expected to fail (strict xfail) while the upstream behaviour stands; an XPASS means it was fixed upstream."""
    verdicts = [cells(arch, zoo_dir)[finding.engine] for arch in zoo_archs(finding)]
    failing = [c for c in verdicts if c.status.startswith("XFAIL")]
    if len(failing) == len(verdicts):
        raise FindingReproduces(f"{finding.id}: {failing[0].arch}: {failing[0].detail}")
    fixed = [c.arch for c in verdicts if not c.status.startswith("XFAIL")]
    assert not failing, f"{finding.id} reproduces only on some architectures; passes on {fixed}: update the registry"


def test_unsupported_features_are_named_from_the_config_alone():
    from transformers import Lfm2Config, Llama4TextConfig, LlamaConfig, MambaConfig, MptConfig

    assert unsupported_features(LlamaConfig()) == []
    assert "chunked attention" in " ".join(unsupported_features(Llama4TextConfig(attention_chunk_size=8)))
    assert "['conv']" in " ".join(unsupported_features(Lfm2Config(num_hidden_layers=2, full_attn_idxs=[1])))
    assert "no attention heads" in " ".join(unsupported_features(MambaConfig()))
    assert "ALiBi" in " ".join(unsupported_features(MptConfig()))
    # each way a config says ALiBi (BLOOM by its type, Falcon by a flag, MPT by its attn_config), and not without it
    from types import SimpleNamespace

    from transformers import BloomConfig, FalconConfig, PretrainedConfig, T5Config

    for config in (BloomConfig(), FalconConfig(alibi=True), PretrainedConfig(attn_config={"alibi": True})):
        assert "ALiBi" in " ".join(unsupported_features(config)), config
    assert not any("ALiBi" in f for f in unsupported_features(FalconConfig()))
    assert "encoder-decoder" in " ".join(unsupported_features(T5Config()))
    # Llama 4's temperature tuning acts on NoPE layers only, and SmolLM3's NoPE layers have none
    from transformers import SmolLM3Config

    nope = dict(num_hidden_layers=2, no_rope_layers=[1, 0], attention_chunk_size=None)
    assert "temperature tuning" in " ".join(unsupported_features(Llama4TextConfig(**nope)))
    assert unsupported_features(Llama4TextConfig(**nope, attn_temperature_tuning=False)) == []
    assert unsupported_features(Llama4TextConfig(**nope | dict(no_rope_layers=[1, 1]))) == []
    assert unsupported_features(SmolLM3Config(num_hidden_layers=2, no_rope_layers=[1, 0])) == []
    assert unsupported_features(SimpleNamespace(num_attention_heads=4)) == []  # no optional field: nothing to refuse


def test_a_window_only_the_mask_carries_is_read_per_layer_as_transformers_mask_builder_reads_it():
    """``mask_window`` (for models that pass no ``sliding_window`` to the attention function) against the config
    fields transformers' mask builder reads: the window on the layers ``layer_types`` marks sliding, on every layer
    without ``layer_types`` (PhiMoE), none without a window, and a stray ``layer_types`` is not read."""
    from types import SimpleNamespace

    from transformers import PhimoeConfig, Qwen2MoeConfig

    from cb_impl.support import mask_window

    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    qwen = Qwen2MoeConfig(num_hidden_layers=4, use_sliding_window=True, sliding_window=7, layer_types=types)
    assert [mask_window(qwen, i) for i in range(4)] == [7 if t == "sliding_attention" else None for t in types]
    assert [mask_window(Qwen2MoeConfig(num_hidden_layers=2), i) for i in range(2)] == [None, None]  # no window
    phimoe = PhimoeConfig(num_hidden_layers=2, sliding_window=7)
    stray = PhimoeConfig(num_hidden_layers=2, sliding_window=7, layer_types=types[:2])
    assert [mask_window(c, i) for c in (phimoe, stray) for i in range(2)] == [7] * 4
    assert mask_window(PhimoeConfig(), 0) is None and mask_window(SimpleNamespace(), 0) is None
    bare = SimpleNamespace(sliding_window=3, layer_types=["full_attention", "sliding_attention"])  # not a dataclass
    assert [mask_window(bare, i) for i in range(2)] == [None, 3]


def test_configs_of_other_releases_and_bare_objects_are_refused_by_name_or_accepted_as_plain_attention():
    """What a config says through fields the zoo's transformers release does not fill in (``layers_block_type``
    alone, as older Jamba configs), multi-head latent attention, and objects that are not a Hugging Face model:
    each refusal is an ``UnsupportedModel`` naming the feature, never another error and never an acceptance."""
    from types import SimpleNamespace

    from transformers import DeepseekV3Config, LlamaConfig

    from cb_impl.support import check_supported

    def hf_model(config):
        return SimpleNamespace(config=config, get_input_embeddings=lambda: None)

    hybrid = SimpleNamespace(num_attention_heads=4, layers_block_type=["mamba", "attention", "mamba"])
    assert unsupported_features(hybrid) == [
        "layer types ['mamba']: convolution / linear-attention / state-space / chunked layers"
    ]
    assert unsupported_features(SimpleNamespace(num_attention_heads=4, layers_block_type=["attention"] * 2)) == []
    with pytest.raises(UnsupportedModel, match=r"multi-head latent attention \(kv_lora_rank\)"):
        check_supported(hf_model(DeepseekV3Config()))
    assert check_supported(hf_model(LlamaConfig())) is None
    for not_a_model in (object(), SimpleNamespace(config=LlamaConfig())):  # no config / no input embeddings
        with pytest.raises(UnsupportedModel, match="is not a Hugging Face model"):
            check_supported(not_a_model)


# --- feature combinations -------------------------------------------------------------------------------------------
CANDIDATES = {c.name: c for c in combos.candidates()}
CB_ONLY = ("reference", "cb_impl")


def assert_exact_or_refused_up_front(arch: zoo.Arch, directory: str) -> Cell:
    """cb_impl on ``arch`` against the oracle: PASS with every token the reference's, or N/A because
    ``LLMEngine`` refused the config at construction (``unsupported_features`` names the feature)."""
    verdicts = {c.engine: c for c in run_architecture(arch, directory, CB_ONLY)}
    assert verdicts["reference"].status == "PASS", verdicts
    cell = verdicts["cb_impl"]
    model, _ = zoo.load(arch, directory)
    if cell.status == "N/A":
        assert unsupported_features(model.config) and "is not supported by cb_impl: " in cell.detail, cell
    else:
        assert cell.status == "PASS" and cell.identical, cell
        assert not unsupported_features(model.config)
    return cell


def test_the_combination_space_crosses_moe_with_every_window_layout_softcaps_sinks_chunks_and_ties():
    names = set(CANDIDATES)
    for layout in ("", "+win-all", "+win-alt", "+win-from1"):  # MoE x window, with and without a dense layer 0
        for rest in ("", "+dense0", "+tied", "+dense0+tied"):
            assert f"qwen2_moe{layout}{rest}" in names or not layout + rest, (layout, rest)
    assert "qwen2_moe+base" in names and not names & {a.name for a in zoo.ARCHS}  # names never shadow the zoo's
    assert {"phimoe+win-all", "mixtral+win-all+tied", "qwen3_moe+win-all+dense0", "gpt_oss+win-alt"} <= names
    assert {"gemma2+win-alt+softcap+final-softcap+tied", "llama4_text+chunked+qknorm+nope1+temp+dense0"} <= names
    features = {f for c in CANDIDATES.values() for f in c.features}
    for feature in ("moe", "attention sinks", "attention softcap", "final-logit softcap", "chunked attention",
                    "q/k norm", "tied embeddings", "alternating sliding/full", "sliding window from layer 1",
                    "no rope on layer 1", "attention temperature tuning", "dense layer 0",
                    "shared expert"):  # fmt: skip
        assert feature in features, feature
    for candidate in CANDIDATES.values():  # a config gets only the fields its class declares
        assert set(candidate.kwargs()) <= combos.declared(candidate.family.config_class), candidate.name
    assert len(CANDIDATES) == len(combos.candidates())  # names are unique


def test_attention_patterns_are_read_from_the_probabilities_layer_by_layer():
    """``attention_kinds`` on hand-made probabilities: each pattern of non-zero keys is named, rows that sum below 1
    are sinks, and a pattern that is none of them is ``other``."""
    import torch

    n, w = 12, zoo.WINDOW
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]

    def probs(keep, mass=1.0):
        p = keep.double()
        return (p / p.sum(-1, keepdim=True) * mass)[None, None].expand(1, 2, n, n)

    causal = k <= q
    layers = [probs(causal), probs(causal & (k > q - w)), probs(causal & (k // w == q // w)), probs(k == 0)]
    assert combos.attention_kinds(layers) == (["full", "window", "chunk", "other"], False)
    assert combos.attention_kinds([probs(causal, mass=0.9)]) == (["full"], True)


def test_verification_keeps_what_the_model_applies_and_rejects_what_it_ignores():
    for name in ("qwen2_moe+win-alt", "phimoe+win-all", "gpt_oss+win-from1", "gemma2+softcap+final-softcap",
                 "llama4_text+chunked+nope1", "llama4_text+nope1+temp", "qwen3_moe+dense0+tied"):  # fmt: skip
        assert combos.verify(CANDIDATES[name]) == "", name
    ignored = {  # one window for every layer; a field stored and never read; tuning acts on NoPE layers only
        "phimoe+win-alt": "attention per layer ['window', 'window'], asked ['window', 'full']",
        "qwen3_moe+win-from1": "attention per layer ['window', 'window'], asked ['full', 'window']",
        "gemma3_text+softcap": "attention softcap: the logits do not change when it is turned off",
        "llama4_text+temp": "temperature tuning: the logits do not change when it is turned off",
    }
    for name, reason in ignored.items():
        assert combos.verify(CANDIDATES[name]) == reason, name
    # a family claiming what its model does not have: sinks, experts, a q/k norm, a shared expert
    mistral = CANDIDATES["mistral+base"]
    claims = (("attention sinks", "attention sinks not seen"), ("moe", "experts on layers"),
              ("q/k norm", "no parameter named like"), ("shared expert", "no parameter named like"))  # fmt: skip
    for claim, reason in claims:
        family = combos.Family("mistral", "MistralConfig", mistral.family.kwargs, (claim,))
        assert combos.verify(combos.Candidate(family, mistral.values)).startswith(reason), claim


@pytest.fixture(scope="module")
def combo_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("combinations"))


@settings(max_examples=6, deadline=None)
@given(candidate=zoo_combinations())
@example(candidate=CANDIDATES["qwen2_moe+win-alt"])  # MoE x a window that only the mask carries
@example(candidate=CANDIDATES["phimoe+win-all"])
@example(candidate=CANDIDATES["llama4_text+nope1+temp"])  # refused: temperature tuning counts positions from a cache
def test_cb_impl_is_exact_or_refused_up_front_on_drawn_feature_combinations(candidate, combo_dir):
    assume(combos.verify(candidate) == "")  # a candidate whose model ignores a switch is no combination
    assert_exact_or_refused_up_front(candidate.arch(), combo_dir)


def test_cb_impl_ignores_a_layer_types_field_the_family_does_not_declare(combo_dir):
    """PhiMoE builds one window mask for every layer; a stray ``layer_types`` in its config (stored, never read by
    the model) must not make cb_impl drop the window on the layers it calls full."""
    kwargs = dict(CANDIDATES["phimoe+win-all"].kwargs(), layer_types=[combos.SLIDING, combos.FULL])
    arch = zoo.Arch("phimoe-stray-layer-types", "PhimoeConfig", kwargs, (), family="phimoe")
    assert "layer_types" not in combos.declared("PhimoeConfig")
    assert assert_exact_or_refused_up_front(arch, combo_dir).status == "PASS"


def smallest_combination(finding: ArchitectureFinding) -> combos.Candidate:
    """The first candidate (fewest switches on) of the finding's families that has all of its features."""
    return next(c for c in CANDIDATES.values()
                if c.family.name in finding.architectures and set(finding.features) <= set(c.features))  # fmt: skip


def without(candidate: combos.Candidate, features: tuple[str, ...]) -> combos.Candidate:
    """``candidate`` with every switch whose value has one of ``features`` turned off."""
    values = tuple((s, combos.SWITCHES[s][0] if v.feature in features else v) for s, v in candidate.values)
    return combos.Candidate(candidate.family, values)


@pytest.mark.parametrize(
    "finding",
    [pytest.param(f, id=f.id, marks=pytest.mark.xfail(strict=True, raises=FindingReproduces, reason=f.id))
     for f in ARCHITECTURE_FINDINGS if f.features],
)  # fmt: skip
def test_the_engine_behind_each_combination_finding_matches_the_reference(finding: ArchitectureFinding, combo_dir):
    """Expected to fail (strict xfail) while the upstream behaviour stands on the finding's smallest combination; the
    same combination with the finding's features off passes (else the finding does not name the cause)."""
    engines = ("reference", finding.engine)
    candidate = smallest_combination(finding)
    control = without(candidate, finding.features)
    for c in (candidate, control):
        assert combos.verify(c) == "", c.name
    passing = {x.engine: x for x in run_architecture(control.arch(), combo_dir, engines)}[finding.engine]
    assert passing.status == "PASS", (control.name, passing)
    cell = {x.engine: x for x in run_architecture(candidate.arch(), combo_dir, engines)}[finding.engine]
    if cell.status == f"XFAIL({finding.id})":
        raise FindingReproduces(f"{finding.id}: {candidate.name}: {cell.detail}")
    assert cell.status == "PASS", f"{candidate.name}: {cell.status} {cell.detail}"


@pytest.mark.slow
@pytest.mark.parametrize("family", [f.name for f in combos.FAMILIES])
def test_every_engine_on_every_combination_passes_is_refused_up_front_or_fails_as_registered(family, combo_dir):
    kept, _ = combos.combinations([f for f in combos.FAMILIES if f.name == family])
    assert kept
    for arch in kept:
        verdicts = {c.engine: c for c in run_architecture(arch, combo_dir)}
        lines = [f"{arch.name} {c.engine}: {c.status} {c.detail}" for c in verdicts.values()]
        assert all(c.ok for c in verdicts.values()), "\n".join(lines)
        assert verdicts["reference"].status == "PASS", lines
        cell = verdicts["cb_impl"]
        assert cell.status == "N/A" or (cell.status == "PASS" and cell.identical), lines


@pytest.mark.slow
def test_the_coverage_doc_lists_every_verified_combination_and_its_command():
    text = (Path(__file__).resolve().parent.parent / "docs" / "coverage.md").read_text()
    assert "`cbverify zoo --combinations --markdown docs/coverage.md`" in text
    table = text.split("## Feature combinations")[1].split("Not combinations")[0]
    rows = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines() if line.startswith("| ")]
    kept, _ = combos.combinations()
    assert rows[1:] == [a.name for a in kept]  # under the header row, in generation order


def test_the_combination_table_counts_decisive_cells_per_engine():
    entries = [CANDIDATES[n].arch() for n in ("qwen2_moe+base", "llama4_text+chunked")]
    cells = [Cell("qwen2_moe+base", "cb_impl", "PASS"), Cell("llama4_text+chunked", "cb_impl", "N/A", "x: chunked"),
             Cell("qwen2_moe+base", "transformers-cb", "FAIL", "wrong"),
             Cell("llama4_text+chunked", "transformers-cb", "XFAIL(f)", "wrong")]  # fmt: skip
    text = render_markdown(cells, ("cb_impl", "transformers-cb"), entries=entries, rejected=[("mistral+win-alt", "r")])
    assert "- **cb_impl**: 1 of 2 decisive (N/A 1, PASS 1)" in text
    assert "- **transformers-cb**: 2 of 2 decisive (FAIL 1, XFAIL 1)" in text
    assert "| llama4_text+chunked | moe, chunked attention | N/A: x: chunked | XFAIL(f) |" in text
    assert "- mistral: r (1: `mistral+win-alt`)" in text and "--combinations --markdown docs/coverage.md" in text


def test_an_architecture_finding_explains_only_the_failure_it_predicts():
    """A registered crash excuses its own message on its architectures, never another failure of the same engine
    there (a second bug is a FAIL); the wrong-numbers finding excuses divergences and log-prob gaps, not crashes."""
    from cbverify.zoo.findings import ARCHITECTURE_FINDINGS, architecture_finding

    head = "generate raised EngineError: transformers-cb: request 'long-greedy' failed upstream: "
    own = head + "'PagedAttentionCache' object has no attribute 'get_seq_length'"
    assert architecture_finding("transformers-cb", "falcon", [own]).id == "cb-cache-lacks-get-seq-length"
    assert architecture_finding("transformers-cb", "falcon", [head + "KeyError: 'cu_seq_lens_q'"]) is None
    assert architecture_finding("transformers-cb", "falcon", [own, "log-probs off: max 0.2"]) is None
    wrong = ["request 'long-greedy': tokens diverge at position 3", "log-probs off: max 0.151 (at 'x' position 7)"]
    assert architecture_finding("transformers-cb", "gemma2", wrong, features=("attention softcap",)).id == (
        "cb-ignores-attention-softcap"
    )
    assert architecture_finding("transformers-cb", "gemma2", [own], features=("attention softcap",)) is None
    assert all(f.problems for f in ARCHITECTURE_FINDINGS)


RECURRENT_LAYER_TYPES = {"linear_attention", "conv", "hybrid", "hybrid_sliding"}  # transformers' cache layer types


def test_a_recurrent_decode_is_read_off_each_model_as_the_layer_types_its_config_declares(zoo_dir):
    """``tolerances.recurrent_state`` (cache tensors that keep their shape from a 2- to a 3-token prefill) against an
    independent path: the cache layer types transformers derives from the config (``get_layer_types_and_kwargs``:
    linear attention / mamba, short convolutions, hybrid layers), for every zoo entry; the zoo holds several of each
    kind (gated delta rule, state-space, convolution) beside attention."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    from cbverify.tolerances import recurrent_state

    kinds = []
    for arch in zoo.ARCHS:
        model, _ = zoo.load(arch, zoo_dir)
        declared = set(get_layer_types_and_kwargs(model.config)[0]) & RECURRENT_LAYER_TYPES
        assert bool(recurrent_state(model)) == bool(declared), (arch.name, declared, recurrent_state(model))
        kinds += [arch.name] if declared else []
    assert {"qwen3_next", "olmo_hybrid", "mamba", "mamba2", "bamba", "jamba", "falcon_h1", "lfm2"} <= set(kinds)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_next", "olmo_hybrid"])
def test_on_long_rollouts_of_a_delta_rule_checkpoint_hf_generate_passes_its_tier_with_every_token_equal(arch, zoo_dir):
    """The false alarm the recurrent tier exists for: greedy and sampled rollouts of 100 tokens (context 112) on a
    gated delta-rule checkpoint, hf-generate judged as ``verify`` judges it in ``tier_for_model``: PASS, every greedy
    token the oracle's. Printed: its max |Δ log-prob| and the oracle's own, against the fp32 tier's 5e-5 (the run is
    decisive when either is above it)."""
    from cbverify import report
    from cbverify.engines import get_engine
    from cbverify.tolerances import FP32, tier_for_model
    from reference.spec import RolloutRequest, SamplingParams

    model, _ = zoo.load(arch, zoo_dir)
    prompt = (1, 19, 4, 13, 7, 15, 9, 16, 18, 21, 20, 17)
    requests = [
        RolloutRequest("greedy", prompt, SamplingParams(temperature=0.0, max_new_tokens=100), eos_token_ids=())
    ]
    requests += [RolloutRequest(f"s{k}", prompt, SamplingParams(temperature=1.0, top_k=10, top_p=0.95,
                                                                 max_new_tokens=100), seed=k, eos_token_ids=())
                 for k in range(2)]  # fmt: skip
    tier = tier_for_model(model, max_length=len(prompt) + 100)
    oracle = get_engine("reference", model)
    reference = oracle.generate(requests)
    rows = {}
    for name, engine in (("reference", None), ("hf-generate", get_engine("hf-generate", model))):
        engine = engine or type("Replay", (), {"name": "reference", "capabilities": oracle.capabilities,
                                               "generate": lambda self, r: reference})()  # fmt: skip
        rows[name] = {t.name: report.evaluate_engine(engine, model, requests, reference, t) for t in (tier, FP32)}
    for name, by_tier in rows.items():
        row = by_tier[tier.name]
        print(
            f"{arch} {name}: {row.status} in {tier.name} ({tier.logprob_max_abs:.3g}); in fp32 "
            f"{by_tier['fp32'].status}: {' | '.join(by_tier['fp32'].problems)[:200]}"
        )
        assert row.status == "PASS", row.problems
    greedy = rows["hf-generate"][tier.name]
    assert greedy.tokens_compared >= 1 and greedy.tokens_equal == greedy.tokens_compared
