"""Every architecture of the zoo (``cbverify.zoo``) is exact or refused up front, on every engine.

For each architecture, ``cbverify.zoo.matrix.run_architecture`` runs greedy and sampled requests (two of them well
past the sliding window) through ``reference``, ``cb_impl``, ``hf-generate`` and ``transformers-cb`` in float32 and
judges them as ``cbverify verify`` does. Each (engine, architecture) must be PASS, NOT-APPLICABLE with a one-line
reason, or a registered architecture finding (``cbverify.zoo.findings.ARCHITECTURE_FINDINGS``) that still reproduces:
each finding is also a strict expected failure, so a fix upstream turns the suite red until the entry is removed.
cb_impl and the reference have no findings: cb_impl is exact or raises ``UnsupportedModel`` at construction.
"""

from __future__ import annotations

import pytest

from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from cb_impl.support import UnsupportedModel, unsupported_features
from cbverify import zoo
from cbverify.zoo.findings import ARCHITECTURE_FINDINGS, ArchitectureFinding
from cbverify.zoo.matrix import Cell, run_architecture

ARCH_NAMES = [a.name for a in zoo.ARCHS]
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
    for feature in ("sliding", "softcap", "sinks", "moe", "chunked", "convolution", "alibi", "state-space"):
        assert feature in features, feature
    for arch in zoo.ARCHS:
        assert arch.config().model_type == arch.name


@pytest.mark.parametrize("arch", ARCH_NAMES)
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


@pytest.mark.parametrize(
    "finding",
    [pytest.param(f, id=f.id, marks=pytest.mark.xfail(strict=True, raises=FindingReproduces, reason=f.id))
     for f in ARCHITECTURE_FINDINGS if f.architectures],  # the others: every architecture on some releases
)  # fmt: skip
def test_the_engine_behind_each_architecture_finding_matches_the_reference(finding: ArchitectureFinding, zoo_dir):
    """Expected to fail (strict xfail) while the upstream behaviour stands; an XPASS means it was fixed upstream."""
    verdicts = [cells(arch, zoo_dir)[finding.engine] for arch in finding.architectures]
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
    assert unsupported_features(SimpleNamespace(num_attention_heads=4)) == []  # no optional field: nothing to refuse


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
