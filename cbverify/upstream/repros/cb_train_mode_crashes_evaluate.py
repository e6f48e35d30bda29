"""Finding ``cb-train-mode-crashes-evaluate`` (trl 1.9+, its continuous-batching path): ``trainer.evaluate()`` crashes
with the default loss.

After ``cb-forces-train-mode`` (generation calls ``model.train()``), ``_compute_loss`` takes its training branch
during evaluation; from trl 1.9 that branch rescales the ``dapo`` (the default) and ``cispo`` normaliser by
``self.current_gradient_accumulation_steps``, an attribute only the training loop sets, so ``evaluate()`` raises
``AttributeError``. trl 1.7 and 1.8 finish ``evaluate()``.

Standalone: imports only torch, transformers, trl, datasets and the standard library; the model (a 2-layer Qwen2 with
seeded random weights: evaluation on the continuous-batching path fails a Llama's requests from transformers 5.24,
see ``cb-bf16-generation-crashes``) and its character tokenizer are built here. Observed: what ``trainer.evaluate()``
on a fresh trainer raises, or the metrics it returns. Exits 1 while the behaviour is there, 0 once ``evaluate()``
finishes, 2 on an unexpected error.
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
        output_dir=_TMP.name, report_to="none", use_cpu=True, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, num_generations=2, max_completion_length=4, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, loss_type="dapo", use_transformers_continuous_batching=True,
        transformers_continuous_batching_config={"num_blocks": 32, "max_batch_tokens": 128},
    )  # fmt: skip
    prompts = Dataset.from_list([{"prompt": "Q:1+2\n"}, {"prompt": "Q:3+4\n"}])
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                          args=args, train_dataset=prompts, eval_dataset=prompts,
                          processing_class=tokenizer)  # fmt: skip
    try:
        error, metrics = None, trainer.evaluate()
    except AttributeError as err:
        error, metrics = err, None
    print("expected: trainer.evaluate() returns its metrics (eval_loss among them)")
    print(f"observed: {f'AttributeError: {error}' if error else f'evaluate() returned {sorted(metrics)}'}")
    return 1 if error is not None and "current_gradient_accumulation_steps" in str(error) else 0


if __name__ == "__main__":
    sys.exit(main())
