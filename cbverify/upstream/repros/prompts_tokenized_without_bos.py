"""Finding ``prompts-tokenized-without-bos`` (trl before 0.27): GRPOTrainer generates from, and trains on, prompts
without the BOS token the model's tokenizer adds.

The trainer tokenizes the (chat-templated or plain) prompt with ``add_special_tokens=False``
(``GRPOTrainer._generate_single_turn`` up to 0.25; ``RLOOTrainer`` up to 0.26), so for a tokenizer that adds a BOS
token (Llama's) the generation and the loss see a context without it, one the model never saw in pre-training:
prompt ids ``[19, 17, ...]`` instead of ``[1, 19, 17, ...]``. 0.27 tokenizes as the tokenizer does.

Standalone: imports only torch, transformers, trl, datasets and the standard library; the model (a 2-layer Llama
with seeded random weights) and its character tokenizer (which adds ``<bos>``) are built here. Observed: the prompt
ids of both trainers' scored batches against ``tokenizer(prompt)``. Exits 1 while the behaviour is there, 0 once
both trainers' prompt ids are the tokenizer's, 2 on an unexpected error.
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
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

_TMP = tempfile.TemporaryDirectory(prefix="repro-")  # removed when the script exits


def tiny_model(folder, config_class=LlamaConfig, model_class=LlamaForCausalLM):
    """A 2-layer causal LM (Llama unless told) with seeded random weights, and a character tokenizer over digits,
    '+', 'Q', ':' and newline that adds a BOS token (as Llama's does), written to ``folder``/tokenizer.json."""
    bos = {"SpecialToken": {"id": "<bos>", "type_id": 0}}
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | {c: i + 3 for i, c in enumerate("0123456789+Q:\n")}
    special = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                "special": True} for t, i in list(vocab.items())[:3]]  # fmt: skip
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special, "normalizer": None,
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated",
                              "invert": False},
            "post_processor": {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                               "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                                        {"Sequence": {"id": "B", "type_id": 0}}],
                               "special_tokens": {"<bos>": {"id": "<bos>", "ids": [1], "tokens": ["<bos>"]}}},
            "decoder": {"type": "Fuse"},
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


def prompt_ids(trainer_class, config_class, model, tokenizer, prompts) -> list[int]:
    """The first prompt's ids in the batch ``trainer_class`` generates from and scores."""
    args = config_class(
        output_dir=_TMP.name, report_to="none", use_cpu=True, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=4, save_strategy="no", logging_strategy="no", disable_tqdm=True, beta=0.0,
    )  # fmt: skip
    trainer = trainer_class(model=model, reward_funcs=lambda completions, **_: [0.0, 1.0], args=args,
                            train_dataset=Dataset.from_list(prompts), processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    batch = trainer._generate_and_score_completions(prompts * 2)
    return batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist()


def main() -> int:
    model, tokenizer = tiny_model(_TMP.name)
    prompts = [{"prompt": "Q:1+2\n"}]
    expected = tokenizer(prompts[0]["prompt"])["input_ids"]
    used = {name: prompt_ids(trainer, config, model, tokenizer, prompts)
            for name, trainer, config in (("GRPOTrainer", GRPOTrainer, GRPOConfig),
                                          ("RLOOTrainer", RLOOTrainer, RLOOConfig))}  # fmt: skip
    print(f"expected: prompt ids {expected} (what the model's tokenizer gives, BOS first) for both trainers")
    print(f"observed: prompt ids {used}")
    return 1 if any(ids != expected and ids == expected[1:] for ids in used.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
