"""The TRL compatibility layer against the *installed* release.

``cbverify matrix`` runs this file in every TRL venv (1.0 on), so each test here is checked on each release: the
layer's names reach the installed trainers and configs, a missing feature is refused naming the release (never
dropped), and what it reads off a real trainer (EOS ids, ``_generate``'s layout, the IS-bound attributes) is what
that trainer uses.
"""

from __future__ import annotations

import pytest

from cbverify.upstream import trl_compat as compat
from cbverify.upstream.scenario import TrainerScenario, _common_args, build_trainer
from reference import tasks
from reference.loss import LOSS_TYPES

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def trainer(llama):
    """A GRPO trainer on a model whose generation config lists a second EOS (newline): releases differ in using it."""
    import copy

    model = copy.deepcopy(llama.model)
    model.generation_config.eos_token_id = [tasks.EOS_ID, tasks.VOCAB["\n"]]
    return build_trainer(TrainerScenario(), model, llama.tokenizer)


def test_every_field_the_scenarios_set_exists_on_the_installed_configs(tmp_path):
    for trainer in compat.TRAINERS:
        for path in ("generate", "cb"):
            scenario = TrainerScenario(path=path, trainer=trainer)
            try:
                compat.require_path(trainer, path)
            except compat.MissingFeature as missing:
                assert missing.args[0].startswith(f"trl {compat.VERSION}: ") and path == "cb"
                continue
            config = compat.config(trainer, **_common_args(scenario, str(tmp_path)))
            assert config.max_completion_length == scenario.max_completion_length


def test_a_field_or_path_the_release_lacks_is_refused_with_its_name_and_the_version(tmp_path):
    with pytest.raises(compat.MissingFeature, match=rf"trl {compat.VERSION}: GRPOConfig has no not_a_field"):
        compat.config("grpo", output_dir=str(tmp_path), not_a_field=1)
    with pytest.raises(compat.MissingFeature, match=rf"trl {compat.VERSION}: RLOOTrainer takes no rollout_func"):
        compat.require_path("rloo", "rollout_func")
    with pytest.raises(compat.MissingFeature, match=rf"trl {compat.VERSION}: .*no loss_type 'ppo'"):
        compat.require_loss_type("ppo")


def test_the_loss_types_read_off_compute_loss_include_the_basic_ones():
    assert {"grpo", "bnpo", "dr_grpo", "dapo"} <= set(compat.loss_types()) <= set(LOSS_TYPES) | {"sapo", "vespo"}


def test_generate_layout_names_what_the_capture_reads():
    layouts = {name: compat.generate_layout(cls) for name, (cls, _) in compat.TRAINERS.items()}
    for layout in layouts.values():
        assert layout[:2] == (compat.PROMPT_IDS, compat.COMPLETION_IDS)
    assert compat.SAMPLER_LOGPROBS in layouts["grpo"] and compat.SAMPLER_LOGPROBS not in layouts["rloo"]
    values = {name: name for name in layouts["grpo"]}
    assert compat.generated(compat.GRPOTrainer.__new__(compat.GRPOTrainer), compat.generate_output(
        compat.GRPOTrainer, **values, unused_elsewhere=0)) == values  # fmt: skip
    with pytest.raises(compat.MissingFeature, match=rf"trl {compat.VERSION}: .*also returns"):
        compat.generate_output(compat.GRPOTrainer)


def test_a_real_trainer_generates_with_the_eos_ids_read_by_the_layer_and_holds_the_is_bound_attributes(trainer):
    used = trainer.generation_config.eos_token_id  # what generate() and the CB path stop on
    assert compat.eos_token_ids(trainer) == tuple(used if isinstance(used, list) else [used])
    assert compat.eos_token_ids(trainer)[0] == tasks.EOS_ID
    assert all(hasattr(trainer, name) for name in compat.is_bound_attributes(None, 3.0))
    if compat.has_is_clip_min():
        assert all(hasattr(trainer, name) for name in compat.is_bound_attributes(0.5, 3.0))
    else:
        with pytest.raises(compat.MissingFeature, match=rf"trl {compat.VERSION}: .*no lower IS bound"):
            compat.is_bound_attributes(0.5, 3.0)
