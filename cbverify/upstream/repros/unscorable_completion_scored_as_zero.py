"""Finding ``unscorable-completion-scored-as-zero`` (trl < 1.6): GRPOTrainer trains on a completion that no reward
function could score.

A reward function may return ``None`` for a completion it cannot score. TRL sums the reward functions with
``nansum``, so that completion's reward is 0, and the 0 enters its group's mean and std: the unscorable completion
gets a nonzero advantage (and moves the scorable ones'). From 1.6, NaN rewards are left out of the statistics and
their advantage is 0.

Standalone: imports only torch, transformers, trl, datasets and the standard library; the model (a 2-layer Llama
with seeded random weights) and its character tokenizer are built here. Observed: the advantages of two groups of
three completions rewarded 0, 1 and None. Exits 1 while the behaviour is there, 0 once it is gone, 2 on an
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


def reward(completions, **_):
    """0, 1, None for each group of three: the third completion is unscorable."""
    return [None if i % 3 == 2 else float(i % 3) for i in range(len(completions))]


def main() -> int:
    model, tokenizer = tiny_model(_TMP.name)
    args = GRPOConfig(
        output_dir=_TMP.name, report_to="none", use_cpu=True, per_device_train_batch_size=6, num_generations=3,
        max_completion_length=4, save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    prompts = [{"prompt": "Q:1+2\n"}, {"prompt": "Q:3+4\n"}]
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(prompts),
                          processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    # generation and scoring of one batch, as the training loop calls it (each prompt once per generation); no loss
    advantages = trainer._generate_and_score_completions([row for row in prompts for _ in range(3)])["advantages"]
    print("expected: the unscorable completions' advantages (every third) are 0")
    print(f"observed: advantages {advantages.tolist()}")
    return 1 if bool((advantages[2::3] != 0).any()) else 0


if __name__ == "__main__":
    sys.exit(main())
