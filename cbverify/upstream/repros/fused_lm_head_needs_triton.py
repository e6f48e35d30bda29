"""Finding ``fused-lm-head-needs-triton`` (trl 1.15): without Triton, no GRPO step runs.

1.15 patches the model's forward with a fused LM head (``add_fused_lm_head``) whose chunked log-prob function comes
from ``trl.kernels``, which imports ``triton``. ``trl.trainer.utils`` catches the ImportError and sets
``_ChunkedLogProbFunction = None``, but the fused forward calls it anyway: on a torch without Triton (the CPU wheels)
every training or evaluation forward raises ``AttributeError: 'NoneType' object has no attribute 'apply'``. 1.14 has
no fused head; 1.16 falls back to a torch implementation.

Standalone: imports only torch, transformers, trl and datasets; the model is the repository's bundled tiny Llama, read
from disk. Exits 1 while the behaviour is there (a one-step training run raises), 0 once it is gone.
"""

import importlib.util
import sys
import tempfile
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

_HERE = Path(__file__).resolve()  # a checkout's golden/models, or an installed cbverify's reference/_models
_MODELS = (_HERE.parents[3] / "golden" / "models", _HERE.parents[2] / "reference" / "_models")
MODEL = next((m for m in _MODELS if m.is_dir()), _MODELS[0]) / "tiny-llama-arith"

_OUT = tempfile.TemporaryDirectory(prefix="cbverify-repro-")  # removed when the script exits
args = GRPOConfig(
    output_dir=_OUT.name, report_to="none", use_cpu=True, per_device_train_batch_size=2, num_generations=2,
    max_completion_length=4, max_steps=1, save_strategy="no", logging_strategy="no", disable_tqdm=True,
)  # fmt: skip
trainer = GRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(MODEL), reward_funcs=lambda completions, **_: [0.0, 1.0], args=args,
    train_dataset=Dataset.from_list([{"prompt": "Q:1+2\n"}]), processing_class=AutoTokenizer.from_pretrained(MODEL),
)  # fmt: skip
print(f"triton installed: {importlib.util.find_spec('triton') is not None}")
try:
    trainer.train()
except AttributeError as err:
    print(f"one training step raised AttributeError: {err}")
    sys.exit(1)
print("one training step ran")
