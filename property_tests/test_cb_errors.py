"""Bad input gets a clear ``ValueError`` before any work, and a model error during a step fails only that step's
requests, frees their blocks, restores the model and leaves the engine usable."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cb_impl.config import EngineConfig
from cb_impl.engine import EngineStepError, LLMEngine
from property_tests.helpers import assert_matches_reference
from reference.generate import generate as reference_generate
from reference.spec import RolloutRequest, SamplingParams

GOOD = RolloutRequest("good", (1, 5, 6, 7), SamplingParams(temperature=0.0, max_new_tokens=4), eos_token_ids=(2,))
BAD = dataclasses.replace(GOOD, request_id="bad")


def forged(request: RolloutRequest, **changes) -> RolloutRequest:
    """A request whose fields bypass the spec's own validation (as a buggy caller could produce)."""
    request = dataclasses.replace(request)
    for name, value in changes.items():
        object.__setattr__(request, name, value)
    return request


def forged_sampling(**changes) -> SamplingParams:
    params = SamplingParams()
    for name, value in changes.items():
        object.__setattr__(params, name, value)
    return params


@pytest.fixture(scope="module")
def engine(llama):
    return LLMEngine(llama.model, EngineConfig(block_size=4, num_blocks=16, max_batch_tokens=32))


BAD_REQUESTS = {
    "empty prompt": (forged(BAD, prompt_ids=()), "empty prompt"),
    "token id beyond the vocabulary": (dataclasses.replace(BAD, prompt_ids=(1, 5, 10_000)), "outside the vocab"),
    "prompt plus max_new_tokens beyond the context": (
        dataclasses.replace(BAD, sampling=SamplingParams(max_new_tokens=250), prompt_ids=(1,) * 10), "context"),
    "max_new_tokens below one": (forged(BAD, sampling=forged_sampling(max_new_tokens=0)), "max_new_tokens"),
    "negative temperature": (forged(BAD, sampling=forged_sampling(temperature=-0.5)), "temperature"),
    "top_p above one": (forged(BAD, sampling=forged_sampling(top_p=1.5)), "top_p"),
    "top_p of zero": (forged(BAD, sampling=forged_sampling(top_p=0.0)), "top_p"),
    "negative top_k": (forged(BAD, sampling=forged_sampling(top_k=-1)), "top_k"),
    "memory budget below one sequence": (
        dataclasses.replace(BAD, sampling=SamplingParams(max_new_tokens=80)), "memory budget"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_cb_rejects_bad_input_before_any_work_and_keeps_the_batch_atomic(engine, case):
    bad, message = BAD_REQUESTS[case]
    steps = engine.stats["num_steps"]
    with pytest.raises(ValueError, match=message):
        engine.generate([GOOD, bad])  # the good request must not run either
    with pytest.raises(ValueError, match=message):
        engine.add_request(bad)
    assert not engine.has_unfinished() and engine.stats["num_steps"] == steps


def test_cb_rejects_duplicate_request_ids_within_a_call_and_against_running_requests(engine):
    with pytest.raises(ValueError, match="duplicate request id 'good'"):
        engine.generate([GOOD, dataclasses.replace(GOOD, seed=1)])
    engine.add_request(GOOD)
    with pytest.raises(ValueError, match="duplicate request id 'good'"):
        engine.add_request(dataclasses.replace(GOOD, seed=1))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([dataclasses.replace(GOOD, request_id="other")])
    while engine.has_unfinished():
        engine.step()


def test_cb_rejects_invalid_configs_and_multimodal_models(llama):
    bad_configs = (
        dict(block_size=0),
        dict(num_blocks=0),
        dict(max_batch_tokens=-1),
        dict(max_num_seqs=True),
        dict(max_memory_fraction=0.0),
        dict(max_memory_fraction=1.5),
        dict(enable_prefix_sharing=1),
        dict(float64_attention=1),
        dict(cuda_graphs="yes"),
    )
    for bad in bad_configs:
        with pytest.raises(ValueError, match="EngineConfig"):
            EngineConfig(**bad)
    for edge in (dict(max_memory_fraction=1.0), dict(max_memory_fraction=1), dict(block_size=1, num_blocks=1)):
        EngineConfig(**edge)  # the closed ends of the documented ranges are accepted
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=8, patch_size=4)  # fmt: skip
    text = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    llava = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=39))
    with pytest.raises(ValueError, match="multimodal"):
        LLMEngine(llava, EngineConfig(num_blocks=8))


class Boom(RuntimeError):
    pass


def test_cb_model_error_fails_that_steps_requests_frees_blocks_and_engine_stays_usable(llama):
    model = llama.model
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=32, max_batch_tokens=64))
    original_attn, was_training = model.config._attn_implementation, model.training
    sampling = SamplingParams(temperature=1.0, top_k=5, max_new_tokens=8)
    requests = [RolloutRequest(f"r{i}", (1, 5, 6, 7, 8), sampling, seed=i, eos_token_ids=()) for i in range(3)]
    calls = {"n": 0}

    def explode(module, args):
        calls["n"] += 1
        if calls["n"] == 3:  # the third forward: requests are mid-decode, blocks shared and allocated
            raise Boom("injected failure")

    handle = model.model.layers[1].register_forward_pre_hook(explode)
    try:
        with pytest.raises(EngineStepError, match="injected failure") as info:  # after aborting the whole call
            engine.generate(requests)
    finally:
        handle.remove()
    assert isinstance(info.value.__cause__, Boom) and sorted(info.value.request_ids) == ["r0", "r1", "r2"]
    assert model.config._attn_implementation == original_attn and model.training == was_training
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants([])

    handle = model.model.layers[0].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(Boom("again")))
    engine.add_request(requests[0])
    try:
        with pytest.raises(EngineStepError, match="again") as info:
            engine.step()
    finally:
        handle.remove()
    assert info.value.request_ids == ["r0"] and isinstance(info.value.__cause__, Boom)
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    after = engine.generate(requests)  # still usable, and still exact
    ref = reference_generate(model, requests)
    assert [r.completion_ids for r in after] == [r.completion_ids for r in ref]
    assert engine.stats["num_failed_requests"] == 4


def test_cb_restores_training_mode_and_attention_even_for_a_training_model(llama):
    model = llama.model
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=16))
    original = model.config._attn_implementation
    model.train()
    try:
        out = engine.generate([GOOD])
        assert model.training and model.config._attn_implementation == original
        model.eval()
        assert out == engine.generate([GOOD]), "dropout or train-mode state leaked into generation"
    finally:
        model.eval()
    assert torch.is_grad_enabled()


def test_abort_all_drops_running_requests_frees_their_blocks_and_leaves_the_engine_reusable(llama):
    engine = LLMEngine(llama.model, EngineConfig(num_blocks=32, block_size=4, max_batch_tokens=16))
    sampling = SamplingParams(temperature=1.0, top_k=10, max_new_tokens=12)
    prompt = (1, 6, 5, 16, 7, 5, 3)
    for i in range(3):
        engine.add_request(RolloutRequest(f"a{i}", prompt, sampling, seed=i, eos_token_ids=()))
    with engine.runner.attached():
        engine.step()
        engine.step()
    assert engine.has_unfinished() and engine.block_manager.num_free_blocks < 32
    engine.abort_all()
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == 32, "aborted requests kept their KV blocks"
    # the same request ids again: nothing of the aborted requests is left to collide with
    fresh = [RolloutRequest(f"a{i}", prompt, sampling, seed=10 + i, eos_token_ids=(2,)) for i in range(3)]
    assert engine.generate(fresh) == reference_generate(llama.model, fresh)


def _tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.14, **overrides)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_a_head_dim_other_than_hidden_over_heads_is_read_from_the_config_and_stays_exact():
    """Qwen3 / Gemma style: ``head_dim`` (24) is not ``hidden_size / num_attention_heads`` (16); the cache and the
    attention must use the configured one (the bundled models cannot tell the two apart)."""
    model = _tiny_llama(head_dim=24)
    requests = [RolloutRequest(f"r{i}", (1, 6, 5, 16, 7, 5, 3)[: 3 + i], SamplingParams(temperature=1.0, top_k=8,
                max_new_tokens=6), seed=i, eos_token_ids=()) for i in range(3)]  # fmt: skip
    engine = LLMEngine(model, EngineConfig(num_blocks=16, block_size=4))
    assert_matches_reference(model, requests, engine.generate(requests), engine="cb_impl")


def test_a_config_without_a_context_length_needs_max_model_len_and_says_which_fields_it_looked_for():
    model = _tiny_llama()
    object.__setattr__(model.config, "max_position_embeddings", None)  # past the config's own validation
    with pytest.raises(ValueError, match="max_position_embeddings.*set max_model_len"):
        LLMEngine(model, EngineConfig(num_blocks=16, block_size=4))
    engine = LLMEngine(model, EngineConfig(num_blocks=16, block_size=4, max_model_len=32))
    assert engine.runner.max_model_len == 32


def test_without_num_blocks_the_cache_takes_its_memory_fraction_capped_at_what_its_sequences_can_use(
    llama, monkeypatch
):
    """The auto-sized cache (TRL's ``max_memory_percent`` path): blocks = fraction x free memory // block bytes,
    one of them the scratch block (``cb_impl.graphs``), never more than ``max_num_seqs`` sequences of
    ``max_model_len`` tokens need, and a fraction too small for one block is refused by name. Free memory is pinned
    so the numbers are exact."""
    import psutil

    from cb_impl import kv_cache

    cfg = llama.model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_hidden_layers * 4 * cfg.num_key_value_heads * head_dim * 4  # K and V, float32
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 1000 * block_bytes})())
    by_memory = LLMEngine(llama.model, EngineConfig(block_size=4, max_memory_fraction=0.05, max_model_len=64))
    assert by_memory.block_manager.num_blocks == 49
    assert by_memory.runner.cache.num_bytes == 50 * block_bytes, "the cache takes its fraction, scratch included"
    capped = LLMEngine(llama.model, EngineConfig(block_size=4, max_memory_fraction=0.9, max_num_seqs=3,
                                                 max_model_len=64))  # fmt: skip
    assert capped.block_manager.num_blocks == 3 * 16
    one = LLMEngine(llama.model, EngineConfig(block_size=4, max_memory_fraction=0.002, max_model_len=64))
    assert one.block_manager.num_blocks == 1, "a fraction that holds exactly one block and the scratch is enough"
    with pytest.raises(ValueError, match="max_memory_fraction=0.001 of free memory holds no KV-cache block beside"):
        LLMEngine(llama.model, EngineConfig(block_size=4, max_memory_fraction=0.001, max_model_len=64))
    assert kv_cache.free_device_memory(torch.device("cpu")) == 1000 * block_bytes
    # a bfloat16 model: half the bytes per block, so twice the blocks, and a cache of that dtype (K and V both)
    import copy

    bf16 = LLMEngine(copy.deepcopy(llama.model).to(torch.bfloat16),
                     EngineConfig(block_size=4, max_memory_fraction=0.05, max_model_len=64))  # fmt: skip
    cache = bf16.runner.cache
    assert bf16.block_manager.num_blocks == 99
    assert cache.key.dtype == cache.value.dtype == torch.bfloat16
    assert cache.key.nbytes + cache.value.nbytes == 100 * block_bytes // 2


def test_requests_exactly_at_the_vocabulary_context_and_memory_limits_are_accepted_and_one_past_refused(llama):
    """The boundaries, each on both sides: token ids in [0, V); prompt + max_new_tokens <= max_model_len; the cache
    holds every token but the last sampled one (never written), so 8 blocks of 4 serve 33 tokens, not 34."""
    vocab = llama.model.config.vocab_size

    def request(prompt_len: int, total: int, last: int = 5) -> RolloutRequest:
        prompt = (0, *[5] * (prompt_len - 2), last)
        return RolloutRequest("r", prompt, SamplingParams(temperature=0.0, max_new_tokens=total - prompt_len), 0, ())

    def accepts(engine, r) -> bool:
        try:
            engine.add_request(r)
        except ValueError:
            return False
        engine.abort_all()
        return True

    context = LLMEngine(llama.model, EngineConfig(block_size=4, num_blocks=16, max_model_len=32))
    assert accepts(context, request(4, 32, last=vocab - 1)) and not accepts(context, request(4, 33))
    with pytest.raises(ValueError, match="exceeds the model's context of 32"):
        context.add_request(request(4, 33))
    with pytest.raises(ValueError, match=f"token id {vocab} outside the vocabulary"):
        context.add_request(request(4, 8, last=vocab))
    memory = LLMEngine(llama.model, EngineConfig(block_size=4, num_blocks=8, max_model_len=64))
    assert accepts(memory, request(4, 33))
    with pytest.raises(ValueError, match="needs 9 KV-cache blocks of 4 tokens but the memory budget holds 8"):
        memory.add_request(request(4, 34))


def test_the_default_config_with_a_progress_bar_and_an_idle_step_change_nothing(llama):
    """No config means ``EngineConfig()``; a progress bar is display only; a step with nothing scheduled returns
    nothing, touches no block and leaves the engine usable."""
    engine = LLMEngine(llama.model)
    assert engine.config == EngineConfig()
    with engine.runner.attached():
        assert engine.step() == []
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    sampling = SamplingParams(temperature=1.0, top_k=10, max_new_tokens=6)
    requests = [RolloutRequest(f"r{i}", (1, 6, 5, 16, 7), sampling, seed=i, eos_token_ids=(2,)) for i in range(3)]
    assert_matches_reference(llama.model, requests, engine.generate(requests, progress=True), engine="cb_impl")


def test_the_paged_attention_refuses_a_call_outside_an_engine_step_before_and_after_one(llama):
    """The attention function reads the step's metadata; called with none (before a fresh engine's first step, or
    after one ended) it must say so, not fail somewhere inside with stale or missing metadata."""
    engine = LLMEngine(llama.model, EngineConfig(block_size=4, num_blocks=16, max_batch_tokens=32))
    attention, layer = engine.runner.attention, engine.model.model.layers[0].self_attn
    q = torch.zeros(1, 2, 3, 8)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="called outside an engine step"):
            attention(layer, q, q, q, None)
        engine.generate([RolloutRequest("r", (1, 2, 3), SamplingParams(temperature=0.0, max_new_tokens=2))])
