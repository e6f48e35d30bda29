"""The bundled checkpoints and the arithmetic task: what the project promises about them (offline, reproducible,
discriminating)."""

from __future__ import annotations

import json
import unicodedata

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import tasks
from reference.models import BUNDLED, MODELS_DIR, load, resolve


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_checkpoint_is_a_small_hugging_face_folder_with_provenance(name: str) -> None:
    path = resolve(name)
    for file in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"):
        assert (path / file).is_file(), f"{name} lacks {file}"
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size <= 8 * 2**20, f"{name} is {size / 2**20:.1f} MB on disk (limit 8 MB)"
    assert "python -m golden.build_models" in (path / "README.md").read_text()


def test_llama_uses_grouped_query_attention_and_qwen2_a_different_ratio_with_biases(llama, qwen2) -> None:
    lc, qc = llama.model.config, qwen2.model.config
    assert lc.model_type == "llama" and lc.num_attention_heads > lc.num_key_value_heads
    assert qc.model_type == "qwen2" and qc.num_attention_heads > qc.num_key_value_heads
    assert lc.num_attention_heads // lc.num_key_value_heads != qc.num_attention_heads // qc.num_key_value_heads
    assert qwen2.model.model.layers[0].self_attn.q_proj.bias is not None


def test_tokenizer_round_trips_task_text_and_has_pad_and_eos(bundled_model) -> None:
    """Every bundled tokenizer round-trips the arithmetic task's text and has a pad and an EOS the model stops on; a
    tokenizer whose vocabulary is the task's (the character-level checkpoints) gives the task's own ids, BOS, pad and
    EOS (tiny-qwen3-chat's byte-level BPE is checked by the chat tests below)."""
    name, model, tokenizer = bundled_model
    problem = tasks.make_problems(1, seed=7)[0]
    text = problem.prompt + problem.completion
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text, name
    eos = model.generation_config.eos_token_id
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id in (eos if isinstance(eos, list) else [eos])
    if tokenizer.get_vocab() != tasks.VOCAB:
        assert name == "tiny-qwen3-chat", f"{name}: a tokenizer that is not the task's"
        return
    ids = tokenizer(problem.prompt)["input_ids"]
    assert ids == tasks.prompt_ids(problem)
    assert tokenizer.decode(ids, skip_special_tokens=True) == problem.prompt
    assert tokenizer(text)["input_ids"][1:] == tasks.encode(text)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        tasks.PAD_ID, tasks.BOS_ID, tasks.EOS_ID,
    )  # fmt: skip


def test_tiny_llama_tokenizer_loads_with_auto_tokenizer() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve("tiny-llama-arith"), local_files_only=True)
    assert tokenizer("Q:1+2\n")["input_ids"] == [tasks.BOS_ID, *tasks.encode("Q:1+2\n")]


def test_loader_gives_a_clear_error_for_a_missing_path_or_a_folder_that_is_not_a_checkpoint(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a bundled name"):
        load(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load(tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        load("tiny-llama-arith", dtype="float8")


def test_loader_takes_any_local_checkpoint_path(tmp_path, llama) -> None:
    model, tokenizer = llama
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    again, _ = load(tmp_path)
    ids = torch.tensor([tasks.prompt_ids(tasks.make_problems(1, seed=3)[0])])
    assert torch.equal(again(ids).logits, model(ids).logits)


@given(st.integers(0, 10**9))
def test_gold_completion_earns_the_reward_and_a_wrong_answer_does_not(seed: int) -> None:
    problem = tasks.make_problems(1, seed=seed)[0]
    gold = tasks.encode(problem.completion) + [tasks.EOS_ID]
    assert tasks.reward(problem, gold) == 1.0
    assert tasks.reward(problem, gold[:-1]) == 0.0  # no EOS: unfinished
    wrong = tasks.encode(problem.completion.rsplit(":", 1)[0] + f":{problem.answer + 1}") + [tasks.EOS_ID]
    assert tasks.reward(problem, wrong) == 0.0
    assert 2 <= len(problem.terms) <= 8 and all(0 <= t <= 99 for t in problem.terms)


def test_trained_model_figures_in_its_readme_hold_greedy_ends_with_eos(llama) -> None:
    """Greedy completions of held-out prompts end with EOS within 128 tokens for >= 95% of them."""
    model, tokenizer = llama
    readme = (resolve("tiny-llama-arith") / "README.md").read_text()
    eos_line = next(line for line in readme.splitlines() if line.startswith("- greedy_eos_rate:"))
    problems = tasks.make_problems(32, seed=99)  # the README's held-out stream (EVAL_SEED), first 32
    enc = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=128, do_sample=False, pad_token_id=tasks.PAD_ID)
    ended = [(row[enc["input_ids"].shape[1] :] == tasks.EOS_ID).any().item() for row in out]
    assert sum(ended) / len(ended) >= 0.95
    assert json.loads(eos_line.split(":", 1)[1]) >= 0.95


# tiny-qwen3-chat: a checkpoint shaped like a modern chat model (byte-level BPE, chat template, two EOS ids). Its
# golden cases ask the arithmetic problems as chats through its own template (``cbverify.golden.cases``).
CHAT_PATH = MODELS_DIR / "tiny-qwen3-chat"
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 12+7+33?"}],
    [{"role": "user", "content": "Please add 5+81."}],
    [{"role": "user", "content": "Tell me about the river."}],
    [{"role": "user", "content": "Hello! How are you today?"}],
]


@pytest.fixture(scope="module")
def chat():
    """tiny-qwen3-chat through the suite's loader, float32 on CPU: ``(model, tokenizer)``."""
    return load(CHAT_PATH)


def _special_ids(tokenizer) -> tuple[int, int, int]:
    return tuple(tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))


def test_chat_checkpoint_is_a_small_qwen3_folder_with_q_k_norms_gqa_and_provenance(chat) -> None:
    model, _ = chat
    for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):  # fmt: skip
        assert (CHAT_PATH / file).is_file(), f"tiny-qwen3-chat lacks {file}"
    size = sum(f.stat().st_size for f in CHAT_PATH.iterdir())
    assert size <= 4 * 2**20, f"tiny-qwen3-chat is {size / 2**20:.1f} MB on disk (limit 4 MB)"
    assert "python -m golden.build_models" in (CHAT_PATH / "README.md").read_text()
    config = model.config
    assert config.model_type == "qwen3" and config.num_attention_heads > config.num_key_value_heads
    assert config.num_attention_heads * config.head_dim != config.hidden_size  # head_dim is its own setting
    assert model.model.layers[0].self_attn.q_norm is not None and config.tie_word_embeddings
    assert 500_000 <= sum(p.numel() for p in model.parameters()) <= 2_000_000


def test_chat_tokenizer_is_byte_level_bpe_and_loads_alike_with_auto_tokenizer_and_the_suite_loader(chat) -> None:
    from transformers import AutoTokenizer

    _, tokenizer = chat
    auto = AutoTokenizer.from_pretrained(CHAT_PATH, local_files_only=True)
    spec = json.loads((CHAT_PATH / "tokenizer.json").read_text())
    assert spec["model"]["type"] == "BPE" and spec["decoder"]["type"] == "ByteLevel"
    assert len(tokenizer) == len(auto) == 2048
    assert _special_ids(tokenizer) == _special_ids(auto) == (2045, 2046, 2047)  # appended last, as in Qwen
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    text = "Q:12+7+33\n12+7=19\n19+33=52\nA:52 The quiet river, said Ada."
    assert auto(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert [tokenizer.decode([i]) for i in tokenizer("12+7")["input_ids"]] == ["1", "2", "+", "7"]  # digit by digit


@pytest.mark.parametrize("text", [
    "Hello  world!\n\nWhat is 12+7+33?\n12+7=19\r\n\ttabs,  spaces   and ünïcödé 😀 (ok) - \"quotes\" 'n' it's\n",
    "\n", "   ", "<|im_start|>user\nhi<|im_end|>\n", "A:100\n\n\n", "",
])  # fmt: skip
def test_chat_tokenizer_round_trips_text_exactly_including_newlines_and_special_tokens(chat, text: str) -> None:
    _, tokenizer = chat
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


@given(st.text(max_size=60).filter(lambda s: unicodedata.normalize("NFC", s) == s))
def test_chat_tokenizer_round_trips_any_nfc_text(chat, text: str) -> None:
    """Byte-level BPE covers every byte; the NFC normaliser (as Qwen's) is the only change, so NFC text round-trips."""
    _, tokenizer = chat
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_chat_template_renders_chatml_and_ends_with_the_generation_prompt(chat) -> None:
    _, tokenizer = chat
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")  # fmt: skip
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == text and ids[0] == _special_ids(tokenizer)[1]
    generation_prompt = tokenizer.encode("<|im_start|>assistant\n")
    assert ids[-len(generation_prompt) :] == generation_prompt
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without.endswith("What is 1+2?<|im_end|>\n") and text.startswith(without)
    assert "chat_template" in json.loads((CHAT_PATH / "tokenizer_config.json").read_text())


def test_chat_generation_config_declares_two_eos_ids_and_config_json_the_turn_end(chat) -> None:
    from transformers import GenerationConfig

    model, tokenizer = chat
    endoftext, _, im_end = _special_ids(tokenizer)
    assert GenerationConfig.from_pretrained(CHAT_PATH).eos_token_id == [im_end, endoftext]
    assert model.generation_config.eos_token_id == [im_end, endoftext]
    assert model.generation_config.pad_token_id == endoftext == tokenizer.pad_token_id
    assert model.config.eos_token_id == im_end


def test_chat_model_greedy_completions_of_chat_prompts_end_with_one_of_the_eos_ids(chat) -> None:
    model, tokenizer = chat
    eos = model.generation_config.eos_token_id
    for messages in CHAT_PROMPTS:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        mask = torch.ones((1, len(ids)), dtype=torch.long)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=mask, do_sample=False, max_new_tokens=128,
                                 eos_token_id=eos, pad_token_id=eos[-1])  # fmt: skip
        completion = out[0, len(ids) :].tolist()
        assert completion and completion[-1] in eos, f"{messages[0]['content']!r}: {tokenizer.decode(completion)!r}"
        assert not any(t in eos for t in completion[:-1])
