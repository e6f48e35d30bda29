"""Finding ``logged-entropy-is-a-mean-of-rank-means`` (trl before 1.9): on several processes the logged entropy is
the mean of each process's token mean, not the batch's token mean.

``_compute_loss`` logs ``accelerator.gather(masked_batch_mean(entropies)).nanmean()``: every process's own token
mean, then their plain mean. When processes hold unequal numbers of completion tokens (always, with completions of
different lengths), that is not the entropy one process would log for the same global batch. trl 1.9 logs the global
token mean (``global_masked_mean``).

Here two processes (this script starts them: gloo on CPU, through accelerate's environment variables) each run
TRL's own ``_compute_loss`` on one row, with the forward replaced by known entropies: process 0 has 1 completion
token of entropy 1.0, process 1 has 3 of entropies 2.0, 3.0, 4.0. Standalone: imports only torch, transformers, trl,
datasets and the standard library; the model (a 2-layer Llama with seeded random weights) and its character tokenizer
are built here. Observed: the logged entropy against the global token mean (1 + 2 + 3 + 4) / 4. Exits 1 while the
behaviour is there, 0 once the global token mean is logged, 2 on an unexpected error.
"""

import inspect
import json
import os
import socket
import subprocess
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


ENTROPIES = {0: [[1.0, 0.0, 0.0]], 1: [[2.0, 3.0, 4.0]]}  # per process: one row's token entropies
MASKS = {0: [[1, 0, 0]], 1: [[1, 1, 1]]}


def rank_main(rank: int) -> None:
    """One process: TRL's loss on this rank's row; process 0 prints the entropy TRL logs."""
    model, tokenizer = tiny_model(_TMP.name)
    args = GRPOConfig(
        output_dir=_TMP.name, report_to="none", use_cpu=True, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=3, save_strategy="no", logging_strategy="no", loss_type="grpo", disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "Q:1+2\n"}] * 4),
                          processing_class=tokenizer)  # fmt: skip
    assert trainer.accelerator.num_processes == 2, "the two processes did not join one process group"
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
    trainer.model.train()
    logps, entropies = torch.zeros(1, 3, requires_grad=True), torch.tensor(ENTROPIES[rank])
    with_aux = "compute_aux_loss" in inspect.signature(trainer._get_per_token_logps_and_entropies).parameters  # 1.7+
    forward = (logps, entropies, None) if with_aux else (logps, entropies)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: forward
    mask = torch.tensor(MASKS[rank])
    inputs = {"prompt_ids": torch.ones(1, 1, dtype=torch.long), "prompt_mask": torch.ones(1, 1, dtype=torch.long),
              "completion_ids": torch.ones(1, 3, dtype=torch.long), "completion_mask": mask,
              "advantages": torch.tensor([1.0]), "num_items_in_batch": torch.tensor(4)}  # fmt: skip
    trainer._compute_loss(trainer.model, inputs)
    if rank == 0:
        print(f"LOGGED {trainer._metrics['train']['entropy'][-1]!r}", flush=True)


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, __file__], env=env | {"RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]  # fmt: skip
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a process failed (exit codes {[p.returncode for p in procs]})")
    logged = float(next(line.split()[1] for line in outputs[0].splitlines() if line.startswith("LOGGED")))
    per_rank = [[e for e, k in zip(ENTROPIES[r][0], MASKS[r][0], strict=True) if k] for r in (0, 1)]  # real tokens
    global_mean = sum(map(sum, per_rank)) / sum(map(len, per_rank))
    rank_means = [sum(tokens) / len(tokens) for tokens in per_rank]
    print(f"expected: logged entropy {global_mean} (the token mean of the global batch, as one process logs it)")
    print(f"observed: logged entropy {logged} (the mean of the processes' token means is {sum(rank_means) / 2})")
    return 1 if abs(logged - global_mean) > 1e-6 else 0


if __name__ == "__main__" and "RANK" in os.environ:
    rank_main(int(os.environ["RANK"]))
elif __name__ == "__main__":
    sys.exit(main())
