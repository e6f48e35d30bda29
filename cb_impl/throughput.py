"""First throughput comparison: cb_impl vs transformers ``generate()`` vs ``generate_batch`` (CB), sampled, N prompts.

``python -m cb_impl.throughput --model golden/models/tiny-llama-arith --sizes 8 32 64``

Each engine completes the same N arithmetic prompts (temperature 1, EOS honoured, ``--max-new-tokens`` cap) after
one warm-up call; the best of ``--repeats`` timed calls is reported as generated tokens per wall and per CPU
second. Generated tokens are counted up to and including EOS for every engine (``generate()``'s padding after EOS
is not counted).
The full benchmark suite with memory and plots lives in ``bench/``; this is the engine's own quick check.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation import ContinuousBatchingConfig

from cb_impl.config import EngineConfig
from cb_impl.engine import LLMEngine
from reference.spec import RolloutRequest, SamplingParams


def make_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    texts = ["Q:" + "+".join(str(rng.randint(0, 99)) for _ in range(rng.randint(2, 8))) + "\n" for _ in range(n)]
    return [tokenizer(t)["input_ids"] for t in texts]


def count_until_eos(ids: list[int], eos: int) -> int:
    return ids.index(eos) + 1 if eos in ids else len(ids)


def run_cb_impl(engine: LLMEngine, prompts: list[list[int]], max_new: int, eos: int) -> int:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new)
    requests = [RolloutRequest(f"r{i}", tuple(p), sampling, seed=i, eos_token_ids=(eos,))
                for i, p in enumerate(prompts)]  # fmt: skip
    return sum(len(r.completion_ids) for r in engine.generate(requests))


def run_generate(model, tokenizer, prompts: list[list[int]], max_new: int, eos: int) -> int:
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])  # (N, P) left-padded
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=max_new, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return sum(count_until_eos(row.tolist(), eos) for row in out[:, width:])


def run_generate_batch(model, prompts: list[list[int]], max_new: int, eos: int, cb_config) -> int:
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                           eos_token_id=eos, pad_token_id=0)  # fmt: skip
    outs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config, warmup=False)
    return sum(count_until_eos(list(o.generated_tokens), eos) for o in outs.values())


def best_rates(fn, repeats: int) -> tuple[float, float, int]:
    """(tokens per wall second, tokens per CPU second of this process, tokens), best of ``repeats`` after a warm-up.
    CPU seconds are the robust figure on a shared machine: they do not count time spent waiting for a core."""
    fn()  # warm-up
    wall, cpu, tokens = float("inf"), float("inf"), 0
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = fn()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return tokens / wall, tokens / cpu, tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="golden/models/tiny-llama-arith", help="local checkpoint directory")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 64], help="numbers of prompts N")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="completion cap per request")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per engine and N (best is reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="torch device of the model")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    eos = tokenizer.eos_token_id
    engine = LLMEngine(model, EngineConfig(max_batch_tokens=512, num_blocks=1024))
    cb_config = ContinuousBatchingConfig(page_size=16, num_blocks=1024, max_batch_tokens=512)
    rows = []
    for n in args.sizes:
        prompts = make_prompts(tokenizer, n, seed=n)
        row = {"N": n}
        for name, fn in (
            ("cb_impl", lambda p=prompts: run_cb_impl(engine, p, args.max_new_tokens, eos)),
            ("generate", lambda p=prompts: run_generate(model, tokenizer, p, args.max_new_tokens, eos)),
            ("generate_batch", lambda p=prompts: run_generate_batch(model, p, args.max_new_tokens, eos, cb_config)),
        ):
            wall, cpu, tokens = best_rates(fn, args.repeats)
            row |= {f"{name}_tok_s": round(wall, 1), f"{name}_tok_cpu_s": round(cpu, 1), f"{name}_tokens": tokens}
        for other in ("generate", "generate_batch"):
            row[f"cb_impl_vs_{other}"] = round(row["cb_impl_tok_s"] / row[f"{other}_tok_s"], 2)
            row[f"cb_impl_vs_{other}_cpu"] = round(row["cb_impl_tok_cpu_s"] / row[f"{other}_tok_cpu_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"engine_stats": engine.stats}))


if __name__ == "__main__":
    main()
