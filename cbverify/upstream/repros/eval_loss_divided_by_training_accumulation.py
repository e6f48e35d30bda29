"""Finding ``eval-loss-divided-by-training-accumulation`` (trl 0.22 to 0.27.0): the evaluation loss is divided by
the training loop's gradient-accumulation steps.

``GRPOTrainer._compute_loss`` divides the ``grpo``, ``bnpo`` and ``dr_grpo`` losses (and ``sapo`` where it exists)
by ``self.current_gradient_accumulation_steps`` in every mode, evaluation included, though evaluation accumulates
nothing. That attribute exists only once the training loop has set it, so ``trainer.evaluate()`` on a trainer that
has not trained raises ``AttributeError``; after training with ``gradient_accumulation_steps=k`` the reported
``eval_loss`` is the evaluation loss divided by ``k``. 0.27.1 divides only in training ("no accum in eval").

Standalone: imports only torch, transformers, trl, datasets and the standard library; the model (a 2-layer Llama with
seeded random weights) and its character tokenizer are built here. Observed: (1) ``evaluate()`` on a fresh ``bnpo``
trainer; (2) two trainers that differ only in ``gradient_accumulation_steps`` (1 and 4), each trained one step at
learning rate 0 (the weights stay equal), then evaluated on the same data from the same RNG state: their
``eval_loss`` must be equal. Exits 1 while the behaviour is there (the crash, or the second loss being the first
divided by 4), 0 once both evaluations report the same loss, 2 on an unexpected error (or an evaluation loss of 0,
which could not show a division).
"""

import json
import math
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


PROMPTS = [{"prompt": f"Q:{a}+{b}\n"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (8, 3)]]


def trainer(folder, accumulation):
    os.makedirs(folder, exist_ok=True)
    model, tokenizer = tiny_model(folder)
    args = GRPOConfig(
        output_dir=folder, report_to="none", use_cpu=True, per_device_train_batch_size=4,
        per_device_eval_batch_size=8, num_generations=4, max_completion_length=8, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, loss_type="bnpo", learning_rate=0.0, max_steps=1, seed=0,
        gradient_accumulation_steps=accumulation,
    )  # fmt: skip
    length_reward = lambda completions, **_: [float(len(c)) for c in completions]  # noqa: E731
    data = Dataset.from_list(PROMPTS)
    return GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=data, eval_dataset=data,
                       processing_class=tokenizer)  # fmt: skip


def evaluate(t):
    torch.manual_seed(1)  # the same sampling in every evaluation
    return t.evaluate()["eval_loss"]


def main() -> int:
    try:
        fresh = f"returned eval_loss {evaluate(trainer(_TMP.name, 1)):.6g}"
    except AttributeError as err:
        fresh = f"AttributeError: {err}"
    losses = {}
    for k in (1, 4):
        t = trainer(os.path.join(_TMP.name, str(k)), k)
        t.train()
        losses[k] = evaluate(t)
    print("expected: evaluate() on a fresh trainer returns its metrics, and eval_loss does not depend on "
          "gradient_accumulation_steps")  # fmt: skip
    print(f"observed: fresh trainer: {fresh}; eval_loss after training with 1 / 4 accumulation steps: "
          f"{losses[1]:.6g} / {losses[4]:.6g}")  # fmt: skip
    if losses[1] == 0.0:  # the excepthook makes it exit 2: the script could not show what it is for
        raise RuntimeError("the evaluation loss is 0: no division could show")
    crashed = "current_gradient_accumulation_steps" in fresh
    divided = math.isclose(losses[4], losses[1] / 4, rel_tol=1e-4) and not math.isclose(losses[4], losses[1])
    return 1 if crashed or divided else 0


if __name__ == "__main__":
    sys.exit(main())
