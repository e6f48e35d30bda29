"""Finding ``cb-bf16-generation-crashes`` (transformers 5.24, Llama; TRL's continuous-batching path with
``bf16=True``): every continuous-batching request fails and the GRPO step dies.

``LlamaModel.forward`` returns the cache it is given whatever ``use_cache`` says (``Qwen2Model`` returns ``None`` with
``use_cache`` off, as continuous batching calls it), and accelerate's mixed-precision forward wrapper calls
``.float()`` on every output, here a ``PagedAttentionCache``: ``'PagedAttentionCache' object has no attribute
'float'``. ``generate_batch`` only logs the failed requests and returns empty completions, and TRL dies with
``IndexError`` in ``_generate``. transformers 5.8 to 5.23 generate.

Standalone: imports only torch, transformers, trl, datasets and the standard library; the model (a 2-layer Llama
with seeded random weights) and its character tokenizer are built here. Observed: what one training step raises, or
that it finishes. Exits 1 while the behaviour is there (the step raises IndexError), 0 once it finishes, 2 on an
unexpected error.
"""

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
        output_dir=_TMP.name, report_to="none", use_cpu=True, bf16=True, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=4, max_steps=1, save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_transformers_continuous_batching=True,
        transformers_continuous_batching_config={"num_blocks": 32, "max_batch_tokens": 128},
    )  # fmt: skip
    prompts = [{"prompt": "Q:1+2\n"}, {"prompt": "Q:3+4\n"}]
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list(prompts), processing_class=tokenizer)  # fmt: skip
    try:
        error = None
        trainer.train()
    except IndexError as err:
        error = err
    print("expected: one bf16 training step on the continuous-batching path finishes")
    print(f"observed: {f'the step raised IndexError: {error}' if error else 'the step finished'}")
    return 1 if error is not None else 0


if __name__ == "__main__":
    sys.exit(main())
