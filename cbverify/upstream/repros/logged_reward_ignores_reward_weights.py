"""Finding ``logged-reward-ignores-reward-weights`` (trl 0.27 to 0.29): the logged reward is not the reward trained on.

With several reward functions and ``reward_weights``, GRPO trains on the weighted sum of the functions (its
advantages use it), but from 0.27 to 0.29 ``_generate_and_score_completions`` logs ``reward`` and ``reward_std`` from
``rewards_per_func.nansum(dim=1)``, the unweighted sum. 0.24 to 0.26 log the weighted sum's group statistics; trl
1.0 applies the weights to the logged statistics.

Standalone: imports only torch, transformers, trl, datasets and the standard library; the model (a 2-layer Llama
with seeded random weights) and its character tokenizer are built here. Two reward functions (the completion's index
in the batch, and 1.0) weighted (2.0, 0.5). Observed: the logged ``reward`` against the mean of the weighted and of
the unweighted sums. Exits 1 while the behaviour is there, 0 once the weighted mean is logged, 2 on an unexpected
error.
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
    weights = [2.0, 0.5]
    args = GRPOConfig(
        output_dir=_TMP.name, report_to="none", use_cpu=True, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        reward_weights=weights,
    )  # fmt: skip
    index_reward = lambda completions, **_: [float(i) for i in range(len(completions))]  # noqa: E731
    one_reward = lambda completions, **_: [1.0] * len(completions)  # noqa: E731
    prompts = [{"prompt": "Q:1+2\n"}, {"prompt": "Q:3+4\n"}]
    trainer = GRPOTrainer(model=model, reward_funcs=[index_reward, one_reward], args=args,
                          train_dataset=Dataset.from_list(prompts), processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    trainer._generate_and_score_completions([row for row in prompts for _ in range(2)])
    logged = trainer._metrics["train"]["reward"][-1]
    weighted = sum(weights[0] * i + weights[1] * 1.0 for i in range(4)) / 4
    unweighted = sum(i + 1.0 for i in range(4)) / 4
    print(f"expected: logged reward {weighted} (the mean of the weighted sum the advantages use)")
    print(f"observed: logged reward {logged} (the unweighted sum's mean is {unweighted})")
    return 1 if abs(logged - weighted) > 1e-6 else 0


if __name__ == "__main__":
    sys.exit(main())
