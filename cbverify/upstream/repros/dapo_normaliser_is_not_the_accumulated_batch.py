"""Finding ``dapo-normaliser-is-not-the-accumulated-batch`` (every trl release seen): with
``steps_per_generation != gradient_accumulation_steps``, ``dapo`` (and ``cispo``) divide an optimizer step's summed
token losses by a number that is not its accumulated batch's active tokens.

``GRPOConfig`` documents ``dapo`` as "normalizing with the number of active token in the global accumulated batch".
TRL divides each micro-batch's sum by ``num_items_in_batch``, the active tokens of the whole *generation* batch (all
``steps_per_generation`` micro-batches): up to 1.8 as it is, from 1.9 times ``gradient_accumulation_steps /
steps_per_generation`` (the generation batch's mean window). Both equal the window's tokens only when the window is
the generation batch, or when every window holds the same number of tokens.

Here a generation batch of 4 rows (2 windows of 2: ``steps_per_generation=2``, ``gradient_accumulation_steps=1``)
holds 8 active tokens in its first window and 2 in its second. TRL's own ``_compute_loss`` runs on the first window
with the log-prob forward replaced by a tensor we differentiate; documented: each real token's gradient is
``-A / 8``. TRL 1.16 divides by 10 * 1/2 = 5, TRL 1.8 by 10. Standalone: imports only torch, transformers, trl,
datasets and the standard library; the model (a 2-layer Llama with seeded random weights) and its character
tokenizer are built here. Observed: dloss/dlogps. Exits 1 while the behaviour is there, 0 once it is gone, 2 on an
unexpected error.
"""

import inspect
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
        steps_per_generation=2, gradient_accumulation_steps=1, max_completion_length=4, save_strategy="no",
        logging_strategy="no", loss_type="dapo",
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "Q:1+2\n"}] * 4),
                          processing_class=tokenizer)  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
    trainer.model.train()
    window_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]])  # the first window: 8 active tokens
    other_window_mask = torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0]])  # the second: 2
    advantages = torch.tensor([1.0, -1.0])
    logps = torch.zeros(2, 4, requires_grad=True)
    with_aux = "compute_aux_loss" in inspect.signature(trainer._get_per_token_logps_and_entropies).parameters  # 1.7+
    forward = (logps, torch.zeros(2, 4), None) if with_aux else (logps, torch.zeros(2, 4))
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: forward
    inputs = {"prompt_ids": torch.ones(2, 1, dtype=torch.long), "prompt_mask": torch.ones(2, 1, dtype=torch.long),
              "completion_ids": torch.ones(2, 4, dtype=torch.long), "completion_mask": window_mask,
              "advantages": advantages, "num_items_in_batch": window_mask.sum() + other_window_mask.sum()}  # fmt: skip
    trainer._compute_loss(trainer.model, inputs).backward()
    expected = -advantages[:, None] / window_mask.sum() * window_mask  # on-policy: d(ratio)/d(logp) = 1
    print(f"expected: dloss/dlogps {expected[:, 0].tolist()} per row (the window's 8 active tokens)")
    print(f"observed: dloss/dlogps {logps.grad[:, 0].tolist()} per row")
    return 0 if torch.allclose(logps.grad, expected) else 1


if __name__ == "__main__":
    sys.exit(main())
