"""Finding ``fused-lm-head-needs-triton`` (trl 1.15): without Triton, no GRPO step runs.

1.15 patches the model's forward with a fused LM head (``add_fused_lm_head``) whose chunked log-prob function comes
from ``trl.kernels``, which imports ``triton``. ``trl.trainer.utils`` catches the ImportError and sets
``_ChunkedLogProbFunction = None``, but the fused forward calls it anyway: on a torch without Triton (the CPU wheels)
every training or evaluation forward raises ``AttributeError: 'NoneType' object has no attribute 'apply'``. 1.14 has
no fused head; 1.16 falls back to a torch implementation.

Standalone: imports only torch, transformers, trl, datasets and the standard library; the model (a 2-layer Llama
with seeded random weights) and its character tokenizer are built here. Observed: what one training step raises, or
that it runs. Exits 1 while the behaviour is there, 0 once it is gone, 2 on an unexpected error.
"""

import importlib.util
import json
import os
import sys
import tempfile
import traceback

sys.excepthook = lambda *exc: (traceback.print_exception(*exc), sys.exit(2))  # an error is not the behaviour

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

_TMP = tempfile.TemporaryDirectory(prefix="repro-")  # removed when the script exits


def tiny_model(folder, config_class=LlamaConfig, model_class=LlamaForCausalLM):
    """A 2-layer causal LM (Llama unless told) with seeded random weights, and a character tokenizer over digits,
    '+', 'Q', ':' and newline written to ``folder``/tokenizer.json."""
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
    config = config_class(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                          eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return model_class(config), tokenizer


def main() -> int:
    model, tokenizer = tiny_model(_TMP.name)
    args = GRPOConfig(
        output_dir=_TMP.name, report_to="none", use_cpu=True, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=4, max_steps=1, save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0, 1.0], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "Q:1+2\n"}]),
                          processing_class=tokenizer)  # fmt: skip
    try:
        error = None
        trainer.train()
    except AttributeError as err:
        error = err
    print(f"expected: one training step runs (triton installed: {importlib.util.find_spec('triton') is not None})")
    print(f"observed: {f'the step raised AttributeError: {error}' if error else 'the step ran'}")
    return 1 if error is not None and "'apply'" in str(error) else 0


if __name__ == "__main__":
    sys.exit(main())
