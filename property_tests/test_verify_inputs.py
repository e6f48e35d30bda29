"""``cbverify verify`` on a user's checkpoint: prompts in TRL's formats, the GRPO recipe as TRL reads it, EOS / pad as
TRL resolves them, and every kind of bad input refused in one line before any model work."""

from __future__ import annotations

import json
import shutil
import tempfile

import pytest
from hypothesis import given, settings

from cbverify.checkpoint import eos_token_ids, open_checkpoint, preflight
from cbverify.cli import main
from cbverify.grpo_config import load_rollout_config, rollout_config_from
from cbverify.prompts import builtin_prompts, load_prompts, token_ids
from property_tests.helpers import grpo_trainer_generation_config
from property_tests.strategies import grpo_sampling_fields
from reference.models import MODELS_DIR
from reference.spec import SamplingParams

LLAMA_DIR = MODELS_DIR / "tiny-llama-arith"


def test_prompt_files_in_every_trl_format_load_to_the_same_prompts(tmp_path):
    rows = [{"prompt": "2+2?"}, {"prompt": [{"role": "user", "content": "hi"}]}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "p.json").write_text(json.dumps(rows))
    (tmp_path / "c.json").write_text(json.dumps({"prompt": [r["prompt"] for r in rows]}))
    (tmp_path / "p.txt").write_text("2+2?\n\n")
    jsonl, listed, column = (load_prompts(tmp_path / f) for f in ("p.jsonl", "p.json", "c.json"))
    assert jsonl == listed == column
    assert [p.conversational for p in jsonl] == [False, True]
    assert jsonl[1].as_messages() == [{"role": "user", "content": "hi"}]
    assert load_prompts(tmp_path / "p.txt") == jsonl[:1]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [("e.jsonl", "", "holds no prompts"), ("b.jsonl", "{oops", "not valid JSON"), ("m.json", '[{"text": "x"}]',
     "'prompt' field"), ("t.csv", "a", "unknown format"), ("n.json", '[{"prompt": 3}]', "must be a non-empty"),
     ("r.jsonl", '{"prompt": [{"role": "user"}]}', "message 0")],
)  # fmt: skip
def test_bad_prompt_files_are_refused_naming_the_file_and_the_rule(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompts(tmp_path / name)


def test_conversational_prompts_need_a_chat_template(llama):
    (conversation,) = [p for p in builtin_prompts(conversational=True) if p.conversational][:1]
    with pytest.raises(ValueError, match="chat template"):
        token_ids(conversation, llama.tokenizer)
    assert len(builtin_prompts(conversational=False)) >= 16


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_trl_recipe_yaml_gives_its_sampling_and_lists_what_is_not_sampling(tmp_path):
    recipe = ("model_name_or_path: x\ndataset_name: y\nuse_peft: true\nenv:\n  A: '1'\nnum_generations: 6\n"
              "per_device_train_batch_size: 4\ntemperature: 0.7\ntop_k: 5\nmax_completion_length: 33\n")  # fmt: skip
    path = _write(tmp_path, "r.yaml", recipe)
    config = load_rollout_config(path)
    assert config.sampling == SamplingParams(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0, max_new_tokens=33)
    assert config.num_generations == 6 and config.extra_options == {}
    assert set(config.unused_keys) == {
        "env",
        "model_name_or_path",
        "dataset_name",
        "use_peft",
        "per_device_train_batch_size",
    }


def test_options_outside_the_spec_are_kept_to_be_reported_and_generation_kwargs_win(tmp_path):
    path = _write(tmp_path, "r.json", json.dumps({"repetition_penalty": 1.2, "generation_kwargs": {
        "do_sample": False, "no_repeat_ngram_size": 3, "eos_token_id": [5, 6]}}))  # fmt: skip
    config = load_rollout_config(path)
    assert config.sampling.greedy and config.eos_token_ids == (5, 6)
    assert config.extra_options == {"repetition_penalty": 1.2, "no_repeat_ngram_size": 3}


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [("u.yaml", "temprature: 0.7\n", "temprature is not a field"), ("s.json", '{"dataset_name": "x"}',
     "dataset_name is not a field of GRPOConfig"), ("b.yaml", "a: [1, 2\n", "not valid YAML"),
     ("l.yaml", "- 1\n", "expected a mapping"), ("v.yaml", "temperature: hot\n", "temperature must be a number"),
     ("g.yaml", "num_generations: 1\n", "GRPOConfig rejects it: GRPO requires at least 2"),
     ("x.toml", "a = 1", "unknown format")],
)  # fmt: skip
def test_bad_recipes_are_refused_with_the_key_or_the_parse_error(tmp_path, name, text, message):
    with pytest.raises(ValueError, match=message):
        load_rollout_config(_write(tmp_path, name, text))


@settings(max_examples=12)  # a real trainer per example (~1 s each)
@given(fields=grpo_sampling_fields())
def test_the_sampling_config_equals_the_one_grpo_trainer_builds_for_generate(fields):
    """Independent path: TRL's own ``GRPOTrainer.__init__`` assembles its ``generation_config`` from the same
    ``GRPOConfig``; every spec option of ours must equal that config's (``top_k`` None or 0 both mean off)."""
    import trl

    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(output_dir=out, report_to="none", use_cpu=True, **fields)
        ours = rollout_config_from(config).sampling
        theirs = grpo_trainer_generation_config(config)
    assert ours.greedy == (not theirs.do_sample)
    if not ours.greedy:
        assert (ours.temperature, ours.top_p) == (theirs.temperature, theirs.top_p)
        assert ours.top_k == (theirs.top_k or 0) and ours.min_p == (theirs.min_p or 0.0)
    assert ours.max_new_tokens == theirs.max_new_tokens


def test_eos_ids_follow_trl_generation_config_list_with_the_tokenizer_eos_first(tmp_path, llama):
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(LLAMA_DIR, ckpt_dir)
    (ckpt_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert eos_token_ids(ckpt_dir, llama.tokenizer) == (2, 7, 8)
    (ckpt_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert eos_token_ids(ckpt_dir, llama.tokenizer) == (2,)
    ckpt = open_checkpoint(ckpt_dir)
    assert ckpt.pad_token_id == 0 and ckpt.arithmetic and ckpt.context_length == 256


def test_directories_that_are_not_usable_checkpoints_are_refused_before_loading(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a bundled name"):
        preflight(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        preflight(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True}))
    with pytest.raises(ValueError, match="encoder-decoder"):
        preflight(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        preflight(tmp_path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--max-new-tokens", "300"], "exceeds the context of 256"), (["--prompts", "EMPTY"], "holds no prompts"),
     (["--grpo-config", "BAD"], "not valid YAML")],
)  # fmt: skip
def test_verify_refuses_bad_input_in_one_line_with_exit_2(tmp_path, capsys, extra, message):
    (tmp_path / "EMPTY.txt").write_text("\n")
    (tmp_path / "BAD.yaml").write_text("a: [\n")
    extra = [str(tmp_path / "EMPTY.txt") if e == "EMPTY" else str(tmp_path / "BAD.yaml") if e == "BAD" else e
             for e in extra]  # fmt: skip
    assert main(["verify", "--engines", "cb_impl", "--num-prompts", "1", "--dist-samples", "0", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_verify_runs_the_real_checkpoint_path_on_the_bundled_chat_model(tmp_path, capsys):
    """The bundled Qwen3-style chat checkpoint end to end: its byte-level BPE tokenizer and chat template render the
    built-in conversations, both EOS ids of its generation config reach every request, the recipe's sampling and
    group size are used, and every engine passes."""
    from cbverify.checkpoint import open_checkpoint
    from cbverify.workload import build_workload

    ckpt = open_checkpoint("tiny-qwen3-chat")
    assert len(ckpt.eos_token_ids) == 2 and not ckpt.arithmetic and ckpt.tokenizer.chat_template
    workload = build_workload(ckpt, prompts_file=None, num_prompts=2, seed=0, max_new_tokens=12)
    generation_prompt = ckpt.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    conversation = workload.requests[workload.group_size + 1]  # the second prompt: the first conversation
    assert list(conversation.prompt_ids[-len(generation_prompt) :]) == generation_prompt
    argv = [
        "verify",
        "--model",
        "tiny-qwen3-chat",
        "--grpo-config",
        "examples/grpo_recipe.yaml",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "12",
        "--dist-samples",
        "0",
        "--no-pressure",
        "--json",
        str(tmp_path / "r.json"),
    ]
    assert main(argv) == 0, capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["status"] for r in report["engines"]] == ["PASS"] * 4
    assert report["environment"]["eos_token_ids"] == str(list(ckpt.eos_token_ids))
    assert "T=0.8/k=20/p=0.95/min_p=0.02" in report["environment"]["sampled"]
