"""The arithmetic task's own pieces, fast: the character vocabulary, the answer parser, the reward and the problems,
each against a definition written out here, and the random-weight twin of a bundled checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from reference import models, tasks

texts = st.text(alphabet=tasks.CHARACTERS, max_size=40)


@given(text=texts, noise=st.lists(st.integers(-5, 2 * tasks.VOCAB_SIZE), max_size=6))
def test_decode_inverts_encode_and_drops_special_and_unknown_ids(text, noise):
    """Every character round-trips; special tokens and ids outside the character vocabulary decode to nothing,
    wherever they sit."""
    ids = tasks.encode(text)
    assert len(ids) == len(text) and tasks.decode(ids) == text
    character_ids = {tasks.VOCAB[c] for c in tasks.CHARACTERS}
    dropped = [i for i in noise if i not in character_ids] + [tasks.PAD_ID, tasks.BOS_ID, tasks.EOS_ID]
    assert tasks.decode(dropped + ids + dropped) == text
    with pytest.raises(ValueError, match="not in the arithmetic vocabulary"):
        tasks.encode(text + "x")


def _first_answer(text: str) -> int | None:
    """The definition, scanned by hand: the digits right after the first ``A:`` that has any."""
    for i in range(len(text) - 1):
        if text[i : i + 2] == "A:":
            digits = ""
            for ch in text[i + 2 :]:
                if not ch.isdigit():
                    break
                digits += ch
            if digits:
                return int(digits)
    return None


@given(text=texts)
@example(text="12+7=19\nA:52")
@example(text="A:\nA:7 A:8")
@example(text="AA:05")
@example(text="A 3")
def test_parse_answer_reads_the_integer_after_the_first_answer_marker(text):
    assert tasks.parse_answer(text) == _first_answer(text)


@given(seed=st.integers(0, 2**32), num=st.integers(0, 6), low=st.integers(2, 8), span=st.integers(0, 4))
def test_problems_are_reproducible_in_range_and_their_gold_chain_sums_up(seed, num, low, span):
    high = low + span
    problems = tasks.make_problems(num, seed=seed, min_terms=low, max_terms=high)
    assert problems == tasks.make_problems(num, seed=seed, min_terms=low, max_terms=high) and len(problems) == num
    for p in problems:
        assert low <= len(p.terms) <= high and all(0 <= t <= 99 for t in p.terms)
        lines = p.completion.split("\n")
        totals = [sum(p.terms[: k + 2]) for k in range(len(p.terms) - 1)]
        assert lines[:-1] == [f"{totals[k] - p.terms[k + 1]}+{p.terms[k + 1]}={totals[k]}" for k in range(len(totals))]
        assert lines[-1] == f"A:{p.answer}" and p.answer == sum(p.terms)
        assert p.prompt == "Q:" + "+".join(map(str, p.terms)) + "\n"
        assert tasks.prompt_ids(p) == [tasks.BOS_ID, *tasks.encode(p.prompt)]
        gold = tasks.encode(p.completion)
        assert tasks.reward(p, [*gold, tasks.EOS_ID]) == 1.0
        assert tasks.reward(p, gold) == 0.0, "no EOS: no reward"
        assert tasks.reward(p, [*tasks.encode(f"A:{p.answer + 1}"), tasks.EOS_ID]) == 0.0
        assert tasks.reward(p, []) == 0.0
    for bad in (dict(num=-1), dict(num=1, min_terms=1), dict(num=1, min_terms=5, max_terms=4)):
        with pytest.raises(ValueError):
            tasks.make_problems(**bad, seed=seed)


def test_random_like_keeps_the_architecture_and_tokenizer_with_fresh_weights_from_the_seed():
    trained, tokenizer = models.load("tiny-llama-arith")
    fresh, fresh_tokenizer = models.random_like("tiny-llama-arith", seed=3)
    again, _ = models.random_like("tiny-llama-arith", seed=3)
    other, _ = models.random_like("tiny-llama-arith", seed=4)
    assert type(fresh) is type(trained) and not fresh.training
    assert fresh.config.to_dict() | {"dtype": None} == trained.config.to_dict() | {"dtype": None}
    assert fresh_tokenizer.get_vocab() == tokenizer.get_vocab()
    pairs = list(zip(fresh.state_dict().items(), trained.state_dict().items(), strict=True))
    assert all(a[0] == b[0] and a[1].shape == b[1].shape for a, b in pairs)
    weights = [n for n, t in fresh.state_dict().items() if t.dim() == 2]
    assert any(not torch.equal(fresh.state_dict()[n], trained.state_dict()[n]) for n in weights), "trained weights"
    assert all(torch.equal(fresh.state_dict()[n], again.state_dict()[n]) for n in weights), "not reproducible"
    assert any(not torch.equal(fresh.state_dict()[n], other.state_dict()[n]) for n in weights), "seed ignored"
    default, _ = models.random_like("tiny-llama-arith")
    zero, _ = models.random_like("tiny-llama-arith", seed=0)
    assert all(torch.equal(default.state_dict()[n], zero.state_dict()[n]) for n in weights), "the default seed is 0"


def test_load_gives_the_dtype_asked_the_declared_tokenizer_class_and_no_tokenizer_without_its_files(tmp_path):
    from transformers import PreTrainedTokenizerFast

    model, tokenizer = models.load("tiny-qwen2-random", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training
    # a declared generic backend is honoured (AutoTokenizer would pick Qwen2Tokenizer, which drops "\n" tokens)
    assert type(tokenizer) is PreTrainedTokenizerFast
    assert tokenizer.decode(tokenizer.encode("1+2\n", add_special_tokens=False)) == "1+2\n"
    chat = models.load_tokenizer(models.resolve("tiny-qwen3-chat"))  # a specialised class: AutoTokenizer's choice
    assert type(chat).__name__ == "Qwen2Tokenizer"
    declared = tmp_path / "declared"  # the generic class by its own name is honoured too
    declared.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (declared / name).symlink_to(models.resolve("tiny-qwen2-random") / name)
    config = json.loads((models.resolve("tiny-qwen2-random") / "tokenizer_config.json").read_text())
    (declared / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    generic = models.load_tokenizer(declared)
    assert type(generic) is PreTrainedTokenizerFast
    assert generic.decode(generic.encode("1+2\n", add_special_tokens=False)) == "1+2\n"
    bare = tmp_path / "bare"  # a checkpoint without tokenizer files
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(models.resolve("tiny-llama-arith") / name)
    assert models.load(bare)[1] is None
    with pytest.raises(ValueError, match="dtype must be one of"):
        models.parse_dtype("float8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            models.load("tiny-llama-arith", device="cuda:0")


def test_problems_default_to_two_to_eight_terms_and_an_unknown_model_is_a_file_not_found_error():
    lengths = {len(p.terms) for p in tasks.make_problems(300, seed=0)}
    assert min(lengths) == 2 and max(lengths) == 8
    with pytest.raises(FileNotFoundError, match="neither a bundled name"):
        models.resolve("no-such-model")
