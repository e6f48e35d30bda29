"""Finding ``is-correction-silently-off-without-vllm`` (every trl release seen): the importance-sampling correction
is silently off on every generation path but vLLM.

``GRPOConfig.vllm_importance_sampling_correction`` (on by default) corrects for the sampler not being the policy,
from the sampler's per-token log-probs. A ``rollout_func`` (or transformers' continuous batching) can return those
log-probs, and TRL keeps them (``sampling_per_token_logps`` in the scored batch), but the only switch that computes
``importance_sampling_ratio`` is gated on ``use_vllm`` in ``_generate_and_score_completions`` and
``_compute_loss``: no ratio is computed or applied, and nothing warns.

Standalone: imports only torch, transformers, trl, datasets and the standard library; the model (a 2-layer Llama
with seeded random weights) and its character tokenizer are built here; the ``rollout_func`` returns fixed
completions with log-probs 0.5 below the policy's (a sampler off the policy). Observed: which of
``sampling_per_token_logps`` and ``importance_sampling_ratio`` the scored batch holds. Exits 1 while the
behaviour is there, 0 once the ratio is computed (or the configuration is refused), 2 on an unexpected error.
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
    completion = tokenizer("3", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def rollout(prompts, *_):  # (prompts, trainer); older releases pass (prompts, args, processing_class)
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids[0] + completion])).logits[0, len(prompt_ids[0]) - 1 : -1]
        policy = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        return {"prompt_ids": prompt_ids, "completion_ids": [list(completion)] * len(prompts),
                "logprobs": [(policy - 0.5).tolist()] * len(prompts)}  # fmt: skip

    args = GRPOConfig(
        output_dir=_TMP.name, report_to="none", use_cpu=True, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        vllm_importance_sampling_correction=True,
    )  # fmt: skip
    try:
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0, 1.0] * (len(completions) // 2),
                              args=args, train_dataset=Dataset.from_list([{"prompt": "Q:1+2\n"}] * 2),
                              processing_class=tokenizer, rollout_func=rollout)  # fmt: skip
    except ValueError as err:  # a release that refuses the correction without vLLM says so: not silent
        print(f"observed: the configuration is refused: {err}")
        return 0
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": "Q:1+2\n"}] * 4)
    print("expected: importance_sampling_ratio in the scored batch (the correction is on and the rollout returned "
          "log-probs), or a refusal")  # fmt: skip
    print(f"observed: sampling_per_token_logps {'present' if 'sampling_per_token_logps' in batch else 'absent'}, "
          f"importance_sampling_ratio {'present' if 'importance_sampling_ratio' in batch else 'absent'}")  # fmt: skip
    return 1 if "importance_sampling_ratio" not in batch else 0


if __name__ == "__main__":
    sys.exit(main())
