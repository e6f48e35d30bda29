"""Build the bundled checkpoints under ``golden/models/`` reproducibly: ``python -m golden.build_models``.

- ``tiny-llama-arith``: Llama with grouped-query attention, trained on ``reference.tasks`` (a miniature GSM8K) until
  sampled answers at temperature 1 are right often but not always (so GRPO has reward variance to learn from).
- ``tiny-qwen2-random``: Qwen2 (q/k/v biases, a different GQA ratio), random weights from a fixed seed, initialised
  with std 0.14 (not transformers' 0.02) so attention is far from uniform and greedy steps are not near-ties.
- ``tiny-qwen3-chat``: Qwen3 with a byte-level BPE tokenizer, a chat template and two EOS ids, trained briefly on chat
  arithmetic and bundled text (``golden.build_qwen3_chat``).

The first two share the character-level tokenizer built here with the ``tokenizers`` library. Each model directory
gets a README with the build command, seed, parameter count, training time and measured figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from golden import build_qwen3_chat, model_stats
from reference import tasks

MODELS_DIR = Path(__file__).resolve().parent / "models"
SEED = 1234
EVAL_SEED = 99  # held-out problems: a different stream from training's
MAX_NEW_TOKENS = 128
# transformers' default 0.02 leaves attention near-uniform (max weight ~1/L): attention bugs average out. 0.15 was
# tried first: with it, one bf16 sampled golden token falls outside the teacher-forced top-p support (processed
# log-prob -inf, which a golden record cannot store); 0.13, 0.14, 0.16 record cleanly at 1 and 2 threads, and 0.14
# has no greedy top-2 gap below 1e-3 on the README prompts (0.16 has 4 of 1247, min 1.4e-4).
QWEN2_INIT_STD = 0.14
ALL_MODELS = ("tiny-llama-arith", "tiny-qwen2-random", build_qwen3_chat.NAME)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level WordLevel tokenizer: every character is one token; BOS is prepended on encode."""
    tok = Tokenizer(models.WordLevel(vocab=dict(tasks.VOCAB), unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{tasks.BOS} $A", pair=f"{tasks.BOS} $A $B", special_tokens=[(tasks.BOS, tasks.BOS_ID)]
    )
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=tasks.BOS, eos_token=tasks.EOS, pad_token=tasks.PAD, padding_side="left"
    )


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=tasks.VOCAB_SIZE, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=tasks.BOS_ID, eos_token_id=tasks.EOS_ID, pad_token_id=tasks.PAD_ID,
    )  # fmt: skip


def qwen2_config(initializer_range: float = QWEN2_INIT_STD) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=tasks.VOCAB_SIZE, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=tasks.BOS_ID, eos_token_id=tasks.EOS_ID, pad_token_id=tasks.PAD_ID,
        initializer_range=initializer_range,
    )  # fmt: skip


def qwen2_figures(model) -> dict:
    """Attention far from uniform and no greedy near-ties, measured against the same seed at std 0.02 (before)."""
    problems = tasks.make_problems(32, seed=EVAL_SEED, max_terms=4)
    sequences = [tasks.prompt_ids(p) + tasks.encode(p.completion) for p in problems[:16]]
    torch.manual_seed(SEED)
    before = Qwen2ForCausalLM(qwen2_config(initializer_range=0.02)).eval()
    gaps = {"eos_token_ids": [tasks.EOS_ID], "max_new_tokens": 64}
    prompts = [tasks.prompt_ids(p) for p in problems]
    return {
        "initializer_range": QWEN2_INIT_STD,
        "attention_last_position": model_stats.attention_stats(model.eval(), sequences),
        "attention_last_position_before_at_std_0.02": model_stats.attention_stats(before, sequences),
        "greedy_top2_gap": model_stats.greedy_gap_stats(model, prompts, **gaps),
        "greedy_top2_gap_before_at_std_0.02": model_stats.greedy_gap_stats(before, prompts, **gaps),
        "measured_on": f"attention: 16 held-out prompts + gold chains (make_problems(32, seed={EVAL_SEED}, "
        "max_terms=4)[:16]), every layer and head; gaps: greedy decoding of all 32 prompts, max 64 new tokens",
    }


def _batch(problems: list[tasks.ArithProblem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels); labels cover the completion and its EOS only."""
    rows = [(tasks.prompt_ids(p), tasks.encode(p.completion) + [tasks.EOS_ID]) for p in problems]
    return build_qwen3_chat.batch(rows, tasks.PAD_ID)


@torch.no_grad()
def evaluate(model, tokenizer, problems: list[tasks.ArithProblem], *, seed: int) -> dict:
    """Greedy EOS rate, greedy/sampled accuracy and the greedy completion-length distribution."""
    model.eval()
    enc = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True)
    out = {}
    for mode in ("greedy", "sampled"):
        torch.manual_seed(seed)
        gen = model.generate(
            **enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=mode == "sampled", temperature=1.0, top_k=0, top_p=1.0,
            pad_token_id=tasks.PAD_ID, eos_token_id=tasks.EOS_ID,
        )[:, enc["input_ids"].shape[1] :]  # fmt: skip
        completions = [row[: (row == tasks.EOS_ID).nonzero()[0, 0] + 1] if (row == tasks.EOS_ID).any() else row
                       for row in gen]  # fmt: skip
        out[f"{mode}_accuracy"] = statistics.mean(
            tasks.reward(p, c.tolist()) for p, c in zip(problems, completions, strict=True)
        )
        if mode == "greedy":
            lengths = sorted(len(c) for c in completions)
            out["greedy_eos_rate"] = statistics.mean(float(c[-1] == tasks.EOS_ID) for c in completions)
            at = [lengths[min(len(lengths) - 1, int(f * len(lengths)))] for f in (0.1, 0.5, 0.9)]
            out["greedy_length"] = {"min": lengths[0], "p10": at[0], "median": at[1], "p90": at[2], "max": lengths[-1]}
    model.train()
    return out


def train_llama(*, max_steps: int, batch_size: int, target_sampled_accuracy: float, log) -> tuple:
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config())
    tokenizer = build_tokenizer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.01)

    def schedule(s: int) -> float:  # 100 warm-up steps, then cosine decay to 10%
        return min(1.0, (s + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / max_steps)))

    lr_sched = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    held_out = tasks.make_problems(128, seed=EVAL_SEED)
    start, metrics, step = time.perf_counter(), {}, 0
    for step in range(1, max_steps + 1):
        ids, mask, labels = _batch(tasks.make_problems(batch_size, seed=SEED * 1_000_003 + step))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(), lr_sched.step(), optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:
            metrics = evaluate(model, tokenizer, held_out, seed=SEED)
            log(f"step {step:5d}  loss {loss.item():.4f}  {json.dumps(metrics)}  ({time.perf_counter() - start:.0f}s)")
            if metrics["greedy_eos_rate"] >= 0.95 and metrics["sampled_accuracy"] >= target_sampled_accuracy:
                break
    return model, tokenizer, {"steps": step, "train_seconds": round(time.perf_counter() - start, 1), **metrics}


def save(model, tokenizer, path: Path, readme: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tasks.BOS_ID, eos_token_id=tasks.EOS_ID, pad_token_id=tasks.PAD_ID, max_new_tokens=MAX_NEW_TOKENS
    )
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "README.md").write_text(readme)


def _readme(name: str, description: str, model, figures: dict) -> str:
    params = sum(p.numel() for p in model.parameters())
    lines = [f"# {name}", "", description, "", "Built by `python -m golden.build_models` (defaults: --max-steps 3000 "
             f"--batch-size 64 --target-sampled-accuracy 0.3 --threads 1; seed {SEED}; torch {torch.__version__}). "
             "Training is deterministic (`torch.use_deterministic_algorithms`); train_seconds is wall time on a "
             "shared 2-core CPU.", "", f"- parameters: {params:,}"]  # fmt: skip
    lines += [f"- {k}: {json.dumps(v)}" for k, v in figures.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=MODELS_DIR, help="directory that receives the model folders")
    parser.add_argument(
        "--models", nargs="+", choices=ALL_MODELS, default=list(ALL_MODELS),
        help="which checkpoints to build (default: all; each is independent of the others)",
    )  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=3000, help="upper bound on Llama training steps")
    parser.add_argument("--batch-size", type=int, default=64, help="training problems per step")
    parser.add_argument(
        "--target-sampled-accuracy", type=float, default=0.3,
        help="stop once temperature-1 sampled accuracy on held-out problems reaches this (and greedy EOS >= 95%%)",
    )  # fmt: skip
    parser.add_argument("--chat-steps", type=int, default=300, help="training steps of tiny-qwen3-chat (fixed)")
    parser.add_argument("--chat-batch-size", type=int, default=48, help="tiny-qwen3-chat training rows per step")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (fixed for reproducibility)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    if "tiny-llama-arith" in args.models:
        model, tokenizer, figures = train_llama(
            max_steps=args.max_steps,
            batch_size=args.batch_size,
            target_sampled_accuracy=args.target_sampled_accuracy,
            log=print,
        )
        figures["held_out_problems"] = f"128 (reference.tasks.make_problems(128, seed={EVAL_SEED}))"
        save(model, tokenizer, args.out / "tiny-llama-arith", _readme(
            "tiny-llama-arith", "Llama (GQA 4 query / 2 key-value heads) trained on the arithmetic task of "
            "`reference/tasks.py`. Figures on held-out problems, max 128 new tokens, transformers `generate()`.",
            model, figures))  # fmt: skip
        print(json.dumps(figures, indent=2))

    if "tiny-qwen2-random" in args.models:
        torch.manual_seed(SEED)
        qwen = Qwen2ForCausalLM(qwen2_config())
        figures = qwen2_figures(qwen)
        save(qwen, build_tokenizer(), args.out / "tiny-qwen2-random", _readme(
            "tiny-qwen2-random", "Qwen2 (q/k/v biases; GQA 6 query / 2 key-value heads), random weights from "
            f"`torch.manual_seed(SEED)` with `initializer_range` {QWEN2_INIT_STD} (transformers' default 0.02 made "
            "attention near-uniform, so attention bugs barely moved the outputs), the same character tokenizer as "
            "tiny-llama-arith. Its output distributions stay broad (top token ~0.3 over 32 ids), which the sampling "
            "tests rely on. Built alone by `python -m golden.build_models --models tiny-qwen2-random`.",
            qwen, figures))  # fmt: skip
        print(json.dumps(figures, indent=2))

    if build_qwen3_chat.NAME in args.models:
        command = (f"python -m golden.build_models --models {build_qwen3_chat.NAME} --chat-steps {args.chat_steps} "
                   f"--chat-batch-size {args.chat_batch_size} --threads {args.threads}")  # fmt: skip
        figures = build_qwen3_chat.build(args.out, seed=SEED, steps=args.chat_steps, batch_size=args.chat_batch_size,
                                         command=command, log=print)  # fmt: skip
        print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
