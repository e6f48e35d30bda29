"""The TRL compatibility layer against the *installed* release.

``cbverify matrix`` runs this file in every TRL venv (0.24 on), so each test here is checked on each release: the
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


# the three shapes rollout_func calls take in TRL's GRPOTrainer: inside the vLLM branch only (0.25 to 0.27), handed to
# the vLLM backend and never called by the trainer (0.28), called before any backend is chosen (0.29 on)
_INSIDE_VLLM = """
def _generate_single_turn(self, prompts):
    if self.use_vllm:
        if self.vllm_mode == "server":
            pass
        elif self.vllm_mode == "colocate":
            if self.rollout_func is not None:
                output = self.rollout_func(prompts, self)
    else:
        output = self.model.generate(prompts)
"""
_HANDED_ON = """
def _generate_single_turn(self, prompts):
    if self.use_vllm:
        output = self.vllm_generation.generate(prompts)
    else:
        output = self.model.generate(prompts)
"""
_BEFORE_BACKENDS = """
def _generate(self, prompts):
    if self.rollout_func is not None:
        if self.use_vllm and self.state.global_step != self._last_loaded_step:
            self.sync()
        output = self.rollout_func(prompts, self)
    else:
        output = self._generate_single_turn(prompts)
"""
_IN_ELSE_OF_VLLM = """
def _generate_single_turn(self, prompts):
    if not self.use_vllm_flag and self.use_vllm:
        pass
    else:
        output = self.rollout_func(prompts, self)
"""


def test_a_rollout_func_call_counts_only_outside_every_vllm_branch():
    assert not compat.calls_rollout_func_off_vllm(_INSIDE_VLLM)
    assert not compat.calls_rollout_func_off_vllm(_HANDED_ON)
    assert compat.calls_rollout_func_off_vllm(_BEFORE_BACKENDS)
    assert compat.calls_rollout_func_off_vllm(_IN_ELSE_OF_VLLM)


def test_the_installed_trainer_calls_rollout_func_exactly_when_the_layer_says_it_does(llama):
    """A real one-step run with a ``rollout_func`` that counts its calls (and completes every row with EOS): the
    layer's :func:`~cbverify.upstream.trl_compat.rollout_func_off_vllm` must agree, and the rollout_func path is
    refused, naming the release, exactly where the trainer would not call it."""
    from cbverify.upstream.scenario import release_trainer

    calls = []

    def rollout_func(prompts, trainer):
        calls.append(len(prompts))
        ids = [llama.tokenizer(p)["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [[tasks.EOS_ID]] * len(ids), "logprobs": [[0.0]] * len(ids)}

    if "rollout_func" not in __import__("inspect").signature(compat.GRPOTrainer.__init__).parameters:
        pytest.skip(f"trl {compat.VERSION}: GRPOTrainer takes no rollout_func")
    trainer = build_trainer(TrainerScenario(path="rollout_func"), __import__("copy").deepcopy(llama.model),
                            llama.tokenizer, rollout_func=rollout_func)  # fmt: skip
    try:
        trainer.train()
    finally:
        release_trainer(trainer)
    assert bool(calls) == compat.rollout_func_off_vllm(), f"trl {compat.VERSION}: rollout_func called {len(calls)}x"
    if not calls:
        with pytest.raises(compat.MissingFeature, match=rf"trl {compat.VERSION}: .*only on its vLLM path"):
            compat.require_path("grpo", "rollout_func")
    else:
        compat.require_path("grpo", "rollout_func")


class _LogsScaleStd:  # the shape of trl 0.24 to 0.26
    def _generate_and_score_completions(self, rewards, std_rewards, mode):
        self._metrics[mode]["reward"].append(rewards.mean().item())
        self._metrics[mode]["reward_std"].append(std_rewards.mean().item())


class _LogsBatchStd:  # the shape of trl 0.27 on
    def _generate_and_score_completions(self, rewards, std_rewards, mode):
        advantages = rewards / (std_rewards + 1e-4)
        self._metrics[mode]["reward_std"].append(rewards.std().item())
        return advantages


class _LogsNoStd:
    def _generate_and_score_completions(self, rewards, mode):
        self._metrics[mode]["reward"].append(rewards.mean().item())


def test_the_logged_reward_std_is_read_off_the_release_s_source():
    assert compat.reward_std_logged(_LogsScaleStd) == "scale"
    assert compat.reward_std_logged(_LogsBatchStd) == "batch"  # std_rewards scales the advantages, not the log
    with pytest.raises(compat.MissingFeature, match="logs no reward_std"):
        compat.reward_std_logged(_LogsNoStd)
    assert compat.reward_std_logged() in ("scale", "batch")  # the installed release logs one of them
