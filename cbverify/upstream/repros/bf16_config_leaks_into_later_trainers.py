"""Finding ``bf16-config-leaks-into-later-trainers`` (transformers 4.x): a ``Trainer`` whose ``TrainingArguments``
say ``bf16=False`` trains in bf16 mixed precision when a ``TrainingArguments(bf16=True)`` was built earlier in the
same process.

``TrainingArguments.__post_init__`` reads ``ACCELERATE_MIXED_PRECISION`` from the environment as its default and then
writes its own choice back there (``os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"``), so every later
``TrainingArguments`` of the process (a sweep, a notebook, GRPOTrainer and RLOOTrainer runs one after another) starts
from ``bf16``, and the ``Accelerator`` its ``Trainer`` builds autocasts the forward passes to bf16 although its own
config asks for none. transformers 5.0 keeps the choice on the arguments and no longer writes the environment.

Standalone: imports only torch, transformers and the standard library; the model (a 2-layer Llama with seeded random
weights) is built here. Observed: the second trainer's ``accelerator.mixed_precision`` and how far its forward under
its own autocast context is from a plain float32 forward. Exits 1 while the behaviour is there, 0 once the second
trainer runs in float32, 2 on an unexpected error.
"""

import os
import sys
import tempfile
import traceback

sys.excepthook = lambda *exc: (traceback.print_exception(*exc), sys.exit(2))  # an error is not the behaviour

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

_TMP = tempfile.TemporaryDirectory(prefix="repro-")  # removed when the script exits


def trainer(model, bf16: bool) -> Trainer:
    args = TrainingArguments(output_dir=_TMP.name, bf16=bf16, use_cpu=True, report_to="none", save_strategy="no")
    return Trainer(model=model, args=args)


def main() -> int:
    os.environ.pop("ACCELERATE_MIXED_PRECISION", None)  # the process starts with no precision chosen
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    trainer(model, bf16=True)  # a first run in bf16, then released
    second = trainer(model, bf16=False)
    ids = torch.randint(0, 32, (2, 12))
    with torch.no_grad():
        plain = torch.log_softmax(model(ids).logits.float(), -1)
        with second.accelerator.autocast():
            autocast = torch.log_softmax(model(ids).logits.float(), -1)
    gap = float((plain - autocast).abs().max())
    print(
        "expected: the second trainer (TrainingArguments(bf16=False)) has mixed precision 'no', and its forward "
        "equals a float32 forward"
    )
    print(
        f"observed: mixed precision {second.accelerator.mixed_precision!r}, ACCELERATE_MIXED_PRECISION="
        f"{os.environ.get('ACCELERATE_MIXED_PRECISION')!r}, its forward's log-probs off float32 by {gap:.2e}"
    )
    return 1 if second.accelerator.mixed_precision == "bf16" else 0


if __name__ == "__main__":
    sys.exit(main())
