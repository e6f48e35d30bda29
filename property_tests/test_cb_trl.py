"""cb_impl as TRL's ``rollout_func``: a few offline ``GRPOTrainer`` steps on the bundled Llama.

The engine must be built once and stay alive across steps, and every step's rollouts must come from the weights
as they are at that step (the engine reads them live, no sync): checked by regenerating a few rows with the
reference oracle on the trainer's current model inside the rollout call and comparing tokens and log-probs.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from property_tests.helpers import assert_matches_reference
from reference import tasks
from reference.generate import generate as reference_generate
from reference.models import resolve
from reference.spec import Rollout, RolloutRequest

pytestmark = pytest.mark.upstream


class RecordingOracle:
    """A rollout engine that records the requests it is given and completes them with the reference oracle."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.requests = model, []

    def generate(self, requests):
        self.requests += list(requests)
        return [reference_generate(self.model, [r])[0] for r in requests]


def _weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def test_cb_rollout_func_trains_grpo_for_a_few_steps_with_one_live_engine(llama, tmp_path):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from cb_impl.config import EngineConfig
    from cb_impl.trl import make_rollout_func, row_seed, trainer_sampling

    torch.manual_seed(0)
    model, tokenizer = llama
    model = type(model).from_pretrained(resolve("tiny-llama-arith"), local_files_only=True)  # a copy we may train
    problems = tasks.make_problems(8, seed=7)
    dataset = Dataset.from_list([{"prompt": p.prompt} for p in problems])

    def reward(completions, **_):  # differs between distinct completions, so a group's advantages are rarely all 0
        return [float(int(hashlib.sha1(c.encode()).hexdigest(), 16) % 7) for c in completions]

    inner = make_rollout_func(config=EngineConfig(block_size=8, num_blocks=128, max_batch_tokens=128), seed=3)
    calls: list[dict] = []

    def rollout_func(prompts, trainer):
        out = inner(prompts, trainer)
        live = trainer.accelerator.unwrap_model(trainer.model)
        engine = inner.engine
        rows = (0, len(prompts) - 1)
        requests = [RolloutRequest(f"check{i}", tuple(out["prompt_ids"][i]), trainer_sampling(trainer),
                                   row_seed(3, int(trainer.state.global_step), i), tuple(trainer.eos_token_ids))
                    for i in rows]  # fmt: skip
        expected = reference_generate(live, requests)
        ours = [Rollout(request.request_id, request.prompt_ids, tuple(out["completion_ids"][i]),
                        tuple(out["logprobs"][i]), ref.finish_reason)
                for i, request, ref in zip(rows, requests, expected, strict=True)]  # fmt: skip
        # TRL's output carries no finish reason (taken from the oracle's), so the conventions are not judged here
        assert_matches_reference(live, requests, ours, engine="cb_impl", expected=expected, conventions=False)
        calls.append(dict(engine=id(engine), engine_model=engine.model is live, digest=_weights_digest(live),
                          rows=len(prompts), groups=len(set(prompts)), step=trainer.state.global_step,
                          attn=live.config._attn_implementation, training=live.training))  # fmt: skip
        return out

    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=12,
        max_steps=3, learning_rate=5e-3, beta=0.0, report_to="none", use_cpu=True, logging_steps=1,
        save_strategy="no", temperature=3.0, seed=0, dataloader_num_workers=0, bf16=False,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, rollout_func=rollout_func)  # fmt: skip
    original_attn = model.config._attn_implementation
    trainer.train()

    assert len(calls) >= 3, calls
    assert len({c["engine"] for c in calls}) == 1, "the engine must be built once and reused across steps"
    assert all(c["engine_model"] for c in calls), "the engine must drive the trainer's own model object"
    assert len({c["digest"] for c in calls}) >= 2, "no weight update happened between rollout calls"
    assert all(c["rows"] == 4 and c["groups"] == 1 for c in calls), calls  # one prompt x num_generations rows
    assert all(c["attn"] == original_attn for c in calls), "the model's attention implementation was not restored"
    assert inner.engine.stats["num_shared_prefills"] > 0, inner.engine.stats
    assert model.config._attn_implementation == original_attn
    assert not inner.engine.has_unfinished()


@example(
    temperature=0.7, top_k=7, top_p=0.9, min_p=0.05, do_sample=True, repetition_penalty=None, max_completion_length=5
)  # every filter on at once, accepted
@example(
    temperature=0.7, top_k=7, top_p=0.9, min_p=0.05, do_sample=False, repetition_penalty=1.0, max_completion_length=5
)  # greedy: do_sample=False wins over the temperature
@given(
    temperature=st.floats(0.1, 2.0),
    top_k=st.sampled_from([None, 0, 1, 7]),
    top_p=st.sampled_from([None, 1.0, 0.9]),
    min_p=st.sampled_from([None, 0.0, 0.05]),
    do_sample=st.sampled_from([None, True, False]),
    repetition_penalty=st.sampled_from([None, 1.0, 1.3]),
    max_completion_length=st.integers(1, 64),
)
def test_the_rollout_func_reads_the_trainers_generation_options_as_grpo_trainer_documents_them(
    temperature, top_k, top_p, min_p, do_sample, repetition_penalty, max_completion_length
):
    """None / 0 / 1.0 disable top-k, min-p and top-p; ``generation_config.do_sample=False`` is greedy (no
    generation_config: sampling); a repetition penalty other than 1 is refused, by name."""
    from types import SimpleNamespace

    from cb_impl.trl import trainer_sampling
    from reference.spec import SamplingParams

    trainer = SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repetition_penalty=repetition_penalty,
                              max_completion_length=max_completion_length)  # fmt: skip
    if do_sample is not None:
        trainer.generation_config = SimpleNamespace(do_sample=do_sample)
    if repetition_penalty not in (None, 1.0):
        with pytest.raises(ValueError, match=f"repetition_penalty={repetition_penalty}"):
            trainer_sampling(trainer)
        return
    want = SamplingParams(temperature=0.0 if do_sample is False else temperature, top_k=top_k or 0,
                          top_p=1.0 if top_p is None else top_p, min_p=min_p or 0.0,
                          max_new_tokens=max_completion_length)  # fmt: skip
    assert trainer_sampling(trainer) == want


def test_a_trainer_without_the_optional_generation_options_samples_unfiltered_and_stops_at_the_tokenizers_eos(llama):
    """A trainer (or a TRL release) that carries only ``temperature`` and ``max_completion_length``: no top-k,
    top-p, min-p or repetition penalty, sampling (no ``generation_config``), and without ``eos_token_ids`` the
    tokenizer's EOS id on every request."""
    from types import SimpleNamespace

    from cb_impl.trl import make_rollout_func, trainer_sampling
    from reference.spec import SamplingParams

    trainer = SimpleNamespace(temperature=0.8, max_completion_length=4)
    assert trainer_sampling(trainer) == SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0,
                                                       max_new_tokens=4)  # fmt: skip
    trainer.state, trainer.processing_class = SimpleNamespace(global_step=0), llama.tokenizer
    trainer.accelerator = SimpleNamespace(unwrap_model=lambda m: m, process_index=0)
    recording = RecordingOracle(llama.model)
    make_rollout_func(engine=recording)(["1+2="], trainer)
    assert [r.eos_token_ids for r in recording.requests] == [(llama.tokenizer.eos_token_id,)]


def test_the_rollout_func_uses_the_model_tokenizer_config_and_eos_list_it_is_given_over_the_trainers(llama):
    """Explicit arguments win over the trainer's: a trainer whose model and tokenizer would raise if used, a config
    that must reach the engine, and the trainer's full EOS list (several ids) on every request."""
    from types import SimpleNamespace

    from cb_impl.config import EngineConfig
    from cb_impl.trl import make_rollout_func

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the trainer's own {name!r} was used instead of the explicit argument")

    class Recording:
        def __init__(self, inner):
            self.inner, self.requests = inner, []

        def generate(self, requests):
            self.requests += list(requests)
            return self.inner.generate(requests)

    trainer = SimpleNamespace(
        temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0, max_completion_length=6,
        eos_token_ids=[2, 5], state=SimpleNamespace(global_step=3), processing_class=Untouchable(),
        model=Untouchable(), accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=0),
    )  # fmt: skip
    config = EngineConfig(num_blocks=40, block_size=4)
    rollout_func = make_rollout_func(llama.model, llama.tokenizer, config=config, seed=7)
    out = rollout_func(["1+2=", "3+4="], trainer)
    assert rollout_func.engine.config is config and rollout_func.engine.model is llama.model
    assert [len(c) for c in out["completion_ids"]] and all(len(c) <= 6 for c in out["completion_ids"])
    recording = Recording(rollout_func.engine)
    out = make_rollout_func(llama.model, llama.tokenizer, engine=recording)(["1+2="], trainer)
    assert [r.eos_token_ids for r in recording.requests] == [(2, 5)]
    assert recording.requests[0].prompt_ids == tuple(llama.tokenizer("1+2=")["input_ids"])


def test_each_process_seeds_its_rows_of_the_global_batch(llama):
    """Process r of a data-parallel run completes rows r*B .. (r+1)*B-1 of the global batch: its requests carry
    those rows' ids and seeds, so no two processes share a seed and N processes draw what one process would."""
    from types import SimpleNamespace

    from cb_impl.trl import make_rollout_func

    def trainer(process_index):
        return SimpleNamespace(
            temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0, max_completion_length=3,
            eos_token_ids=[2], state=SimpleNamespace(global_step=5), processing_class=llama.tokenizer,
            model=llama.model, accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=process_index),
        )  # fmt: skip

    prompts = ["1+2=", "1+2=", "3+4=", "3+4="]
    one, halves = RecordingOracle(llama.model), [RecordingOracle(llama.model), RecordingOracle(llama.model)]
    make_rollout_func(engine=one)(prompts, trainer(0))
    for rank, recording in enumerate(halves):
        make_rollout_func(engine=recording)(prompts[2 * rank : 2 * rank + 2], trainer(rank))
    split = [r for recording in halves for r in recording.requests]
    assert [(r.request_id, r.seed) for r in split] == [(r.request_id, r.seed) for r in one.requests]
    assert len({r.seed for r in split}) == len(split)


def test_without_a_config_the_engine_holds_one_generation_batch_and_its_cache_no_more(llama):
    """The default engine admits at most the first call's batch at once (the trainer generates one batch at a time),
    so its KV cache is sized for that many full-context sequences, not the engine default's 256; a later, larger
    batch still completes every row (the rest wait their turn); after each call the cache's pages are handed back."""
    import math
    from types import SimpleNamespace

    from cb_impl.trl import make_rollout_func

    trainer = SimpleNamespace(
        temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0, max_completion_length=3,
        eos_token_ids=[2], state=SimpleNamespace(global_step=0), processing_class=llama.tokenizer,
        model=llama.model, accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=0),
    )  # fmt: skip
    rollout_func = make_rollout_func()
    rollout_func(["1+2=", "1+2=", "3+4="], trainer)
    engine = rollout_func.engine
    released = []
    engine.release_cache = lambda: released.append(engine.has_unfinished())
    context = llama.model.config.max_position_embeddings
    assert engine.config.max_num_seqs == 3 and engine.config.block_size == 16
    assert engine.block_manager.num_blocks == 3 * math.ceil(context / 16)
    out = rollout_func(["1+2="] * 5, trainer)
    assert len(out["completion_ids"]) == 5 and all(1 <= len(c) <= 3 for c in out["completion_ids"])
    assert released == [False], "after each call, idle, the engine hands its KV pages back for the trainer's update"


def test_a_conversational_prompt_is_refused_naming_its_type(llama):
    """This rollout_func tokenizes plain text; a conversational prompt (a list of messages) is refused by type."""
    from types import SimpleNamespace

    from cb_impl.trl import make_rollout_func

    trainer = SimpleNamespace(temperature=1.0, max_completion_length=3, state=SimpleNamespace(global_step=0),
                              processing_class=llama.tokenizer,
                              accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=0))  # fmt: skip
    with pytest.raises(ValueError, match="takes plain-text prompts, got list"):
        make_rollout_func(engine=RecordingOracle(llama.model))([[{"role": "user", "content": "1+2="}]], trainer)
