"""The bundled checkpoints and the arithmetic task: what the project promises about them (offline, reproducible,
discriminating)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import tasks
from reference.models import BUNDLED, load, resolve


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


def test_tokenizer_round_trips_task_text_and_has_pad_bos_eos(bundled_model) -> None:
    _, _, tokenizer = bundled_model
    problem = tasks.make_problems(1, seed=7)[0]
    ids = tokenizer(problem.prompt)["input_ids"]
    assert ids == tasks.prompt_ids(problem)
    assert tokenizer.decode(ids, skip_special_tokens=True) == problem.prompt
    assert tokenizer(problem.prompt + problem.completion)["input_ids"][1:] == tasks.encode(
        problem.prompt + problem.completion
    )
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
