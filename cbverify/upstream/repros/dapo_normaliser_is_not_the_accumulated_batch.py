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
``-A / 8``. TRL 1.16 divides by 10 * 1/2 = 5, TRL 1.8 by 10. Standalone: imports only torch, transformers, trl and
datasets; the model is the repository's bundled tiny Llama, read from disk. Exits 1 while the behaviour is there.
"""

import inspect
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

_HERE = Path(__file__).resolve()  # a checkout's golden/models, or an installed cbverify's reference/_models
_MODELS = (_HERE.parents[3] / "golden" / "models", _HERE.parents[2] / "reference" / "_models")
MODEL = next((m for m in _MODELS if m.is_dir()), _MODELS[0]) / "tiny-llama-arith"

_OUT = tempfile.TemporaryDirectory(prefix="cbverify-repro-")  # removed when the script exits
args = GRPOConfig(
    output_dir=_OUT.name, report_to="none", use_cpu=True, per_device_train_batch_size=2, num_generations=2,
    steps_per_generation=2, gradient_accumulation_steps=1, max_completion_length=4, save_strategy="no",
    logging_strategy="no", loss_type="dapo",
)  # fmt: skip
trainer = GRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(MODEL), reward_funcs=lambda completions, **_: [0.0] * len(completions),
    args=args, train_dataset=Dataset.from_list([{"prompt": "Q:1+2\n"}] * 4),
    processing_class=AutoTokenizer.from_pretrained(MODEL),
)  # fmt: skip
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
print(f"dloss/dlogps {logps.grad[:, 0].tolist()} per row; documented {expected[:, 0].tolist()}")
sys.exit(0 if torch.allclose(logps.grad, expected) else 1)
