"""Finding ``cb-bf16-casts-training-weights`` (trl 1.7+, its continuous-batching path): with ``bf16=True``,
generation casts the trained model to bfloat16 for good.

``GRPOTrainer._generate_single_turn`` runs ``unwrapped_model.to(torch.bfloat16)`` before ``generate_batch`` (to
generate in the mixed-precision dtype) and never casts back: every trained float32 parameter is bfloat16 from the
first generation on, and the optimizer updates bfloat16 weights. ``bf16=True`` is documented as mixed precision
(float32 master weights, bfloat16 compute), not as training in bfloat16.

Standalone: imports only torch, transformers, trl, datasets and the standard library; the model (a 2-layer Qwen2
with seeded random weights: a Llama crashes there from transformers 5.24, see ``cb-bf16-generation-crashes``) and its
character tokenizer are built here. Observed: the parameters' dtypes before and after one generation-and-scoring
call. Exits 1 while the behaviour is there, 0 once the weights stay float32, 2 on an unexpected error.
"""

import json
import os
import sys
import tempfile
import traceback

sys.excepthook = lambda *exc: (traceback.print_exception(*exc), sys.exit(2))  # an error is not the behaviour

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
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
    model, tokenizer = tiny_model(_TMP.name, Qwen2Config, Qwen2ForCausalLM)
    args = GRPOConfig(
        output_dir=_TMP.name, report_to="none", use_cpu=True, bf16=True, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=4, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config={"num_blocks": 32, "max_batch_tokens": 128},
    )  # fmt: skip
    prompts = [{"prompt": "Q:1+2\n"}, {"prompt": "Q:3+4\n"}]
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list(prompts), processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    before = sorted({str(p.dtype) for p in model.parameters()})
    trainer._generate_and_score_completions([row for row in prompts for _ in range(2)])
    after = sorted({str(p.dtype) for p in model.parameters()})
    print(f"expected: the trained parameters stay {before} across a generation (bf16=True is mixed precision)")
    print(f"observed: parameter dtypes {before} -> {after}")
    return 1 if after != before else 0


if __name__ == "__main__":
    sys.exit(main())
