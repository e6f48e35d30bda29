"""Finding ``luspo-token-level-loss-counts-padding`` (trl < 1.10): the luspo loss counts padded positions.

``loss_type="luspo"`` sums each sequence's per-token terms and averages over sequences. Up to 1.9 TRL writes it
``(per_token_loss * mask.sum(1, keepdim=True)).mean()``, right only for a (B, 1) per-sequence term; at
``importance_sampling_level="token"`` (the default) the term is (B, T), so every position, padding included, gets
the gradient ``-A * length / (B * T)`` instead of ``-A / B`` on real tokens and 0 on padding. 1.10 masks first.

Here TRL's own ``_compute_loss`` runs on a two-row batch (lengths 4 and 2, advantages +1 and -1, on-policy) with the
log-prob forward replaced by a tensor we differentiate. Standalone: imports only torch, transformers, trl and
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
    max_completion_length=4, save_strategy="no", logging_strategy="no", loss_type="luspo",
)  # fmt: skip
trainer = GRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(MODEL), reward_funcs=lambda completions, **_: [0.0] * len(completions),
    args=args, train_dataset=Dataset.from_list([{"prompt": "Q:1+2\n"}] * 2),
    processing_class=AutoTokenizer.from_pretrained(MODEL),
)  # fmt: skip
trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
trainer.model.train()

mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
advantages = torch.tensor([1.0, -1.0])
logps = torch.zeros(2, 4, requires_grad=True)
with_aux = "compute_aux_loss" in inspect.signature(trainer._get_per_token_logps_and_entropies).parameters  # 1.7+
forward = (logps, torch.zeros(2, 4), None) if with_aux else (logps, torch.zeros(2, 4))
trainer._get_per_token_logps_and_entropies = lambda *a, **k: forward
inputs = {"prompt_ids": torch.ones(2, 1, dtype=torch.long), "prompt_mask": torch.ones(2, 1, dtype=torch.long),
          "completion_ids": torch.ones(2, 4, dtype=torch.long), "completion_mask": mask, "advantages": advantages,
          "num_items_in_batch": mask.sum()}  # fmt: skip
trainer._compute_loss(trainer.model, inputs).backward()
expected = -advantages[:, None] / 2 * mask  # d/dlogp of mean over rows of (sum over real tokens of -A * ratio)
print(f"dloss/dlogps {logps.grad.tolist()}; expected {expected.tolist()}")
sys.exit(0 if torch.allclose(logps.grad, expected) else 1)
