"""``tiny-qwen3-chat``: a bundled checkpoint shaped like a modern chat model (``python -m golden.build_models``).

What makes it look like a released Qwen3 checkpoint, at 1/500 000 of the size:

- ``Qwen3ForCausalLM``: q/k RMS norms, grouped-query attention (4 query / 2 key-value heads), ``head_dim`` 64 with
  ``num_heads * head_dim != hidden_size``, tied input/output embeddings, RoPE theta 1e6, bfloat16 weights on disk,
  and a model vocabulary padded beyond the tokenizer's (2112 vs 2048 ids), as Qwen pads 151 669 to 151 936;
- a byte-level BPE tokenizer trained here with ``tokenizers`` on :mod:`golden.corpus` text (NFC normaliser, Qwen2's
  pre-tokenizer regex then ``ByteLevel``, so digits are single tokens), declared as ``Qwen2Tokenizer``, with the
  special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` at the end of the vocabulary;
- a ChatML Jinja chat template in ``tokenizer_config.json``; two EOS ids in ``generation_config.json``
  (``<|im_end|>`` ends a chat turn, ``<|endoftext|>`` a plain document), ``<|im_end|>`` in ``config.json``.

Training data per batch: chat-formatted ``reference.tasks`` problems (2-3 terms; the assistant answers with the gold
chain, then ``<|im_end|>``), small-talk chats and plain documents ending in ``<|endoftext|>``. Loss on the assistant
turn (chats) or the whole text (documents). Figures are measured on the saved bfloat16 weights, loaded in float32.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from golden import corpus, model_stats
from reference import tasks

NAME = "tiny-qwen3-chat"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOKENIZER_VOCAB_SIZE = 2048  # BPE merges + 256 bytes + the 3 special tokens
MODEL_VOCAB_SIZE = 2112  # padded to a multiple of 64; ids >= 2048 are never produced by the tokenizer
PRETOKENIZE_REGEX = (  # Qwen2's: contractions, letters, single digits, punctuation runs, newlines, spaces
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MIN_TERMS, MAX_TERMS = 2, 3  # short chains: a few minutes of training give a non-zero accuracy
MAX_DOCUMENT_TOKENS = 48
MAX_NEW_TOKENS = 128
EVAL_SEED = 99


def build_tokenizer(*, seed: int, num_texts: int = 20_000) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``corpus.tokenizer_texts(num_texts, seed=seed)``; special tokens appended last."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - 3, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(corpus.tokenizer_texts(num_texts, seed=seed), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (ENDOFTEXT, IM_START, IM_END)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, chat_template=CHAT_TEMPLATE, padding_side="left"
    )


def qwen3_config(tokenizer) -> Qwen3Config:
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    return Qwen3Config(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=True,
        bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=endoftext,
    )  # fmt: skip


def chat_prompt(tokenizer, user: str) -> list[int]:
    """The user turn rendered by the chat template, with the assistant generation prompt."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))  # fmt: skip


def example(tokenizer, rng: random.Random, problem: tasks.ArithProblem) -> tuple[list[int], list[int]]:
    """One training row ``(context ids, target ids)``: an arithmetic chat (80%), small talk (12%) or a document."""
    kind = rng.random()
    if kind < 0.92:
        user, reply = (
            (corpus.arithmetic_question(problem, rng), corpus.arithmetic_answer(problem))
            if kind < 0.8
            else corpus.small_talk(rng)
        )
        return chat_prompt(tokenizer, user), tokenizer.encode(reply) + [tokenizer.convert_tokens_to_ids(IM_END)]
    ids = tokenizer.encode(corpus.document(rng)) + [tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    ids = ids[:MAX_DOCUMENT_TOKENS]
    return ids[:1], ids[1:]


def batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``; labels cover the targets only."""
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (context, target) in enumerate(rows):
        n = len(context) + len(target)
        ids[i, :n] = torch.tensor(context + target)
        mask[i, :n] = 1
        labels[i, len(context) : n] = torch.tensor(target)
    return ids, mask, labels


def eval_prompts(tokenizer, num: int = 64) -> tuple[list[tasks.ArithProblem], list[list[int]], list[list[int]]]:
    """Held-out ``(problems, arithmetic chat prompts, small-talk prompts)`` from ``EVAL_SEED`` streams."""
    rng = random.Random(EVAL_SEED)
    problems = tasks.make_problems(num, seed=EVAL_SEED, min_terms=MIN_TERMS, max_terms=MAX_TERMS)
    arith = [chat_prompt(tokenizer, corpus.arithmetic_question(p, rng)) for p in problems]
    talk = [chat_prompt(tokenizer, corpus.small_talk(rng)[0]) for _ in range(num // 2)]
    return problems, arith, talk


@torch.no_grad()
def evaluate(model, tokenizer, *, seed: int) -> dict:
    """Greedy and T=1 sampled generation on held-out prompts (max 128 new tokens, stop on either EOS)."""
    eos = list(model.generation_config.eos_token_id)
    problems, arith, talk = eval_prompts(tokenizer)
    out: dict = {}
    for mode in ("greedy", "sampled"):
        torch.manual_seed(seed)
        completions = []
        for prompts in (arith, talk):
            enc = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
            gen = model.generate(
                **enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=mode == "sampled", temperature=1.0, top_k=0,
                top_p=1.0, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
            )[:, enc["input_ids"].shape[1] :].tolist()  # fmt: skip
            completions += [next((row[: i + 1] for i, t in enumerate(row) if t in eos), row) for row in gen]
        ended = [c[-1] in eos for c in completions]
        answers = [corpus_answer(tokenizer, c, eos) for c in completions[: len(problems)]]
        right = [float(a == p.answer) for a, p in zip(answers, problems, strict=True)]
        out[mode] = {
            "arithmetic_accuracy": round(statistics.mean(right), 4),
            "eos_fraction": round(statistics.mean(map(float, ended)), 4),
            "ended_on_im_end": sum(c[-1] == eos[0] for c in completions),
            "ended_on_endoftext": sum(c[-1] == eos[1] for c in completions),
            "length": model_stats.summary([len(c) for c in completions], digits=1),
        }
    out["greedy_top2_gap"] = model_stats.greedy_gap_stats(model, arith[:24] + talk[:8], eos_token_ids=eos,
                                                          max_new_tokens=MAX_NEW_TOKENS)  # fmt: skip
    out["held_out"] = f"{len(arith)} arithmetic + {len(talk)} small-talk chat prompts (seed {EVAL_SEED})"
    return out


def corpus_answer(tokenizer, completion: list[int], eos: list[int]) -> int | None:
    """The answer stated by a completion that ended on an EOS id, else ``None`` (the task's reward rule)."""
    if not completion or completion[-1] not in eos:
        return None
    return tasks.parse_answer(tokenizer.decode(completion, skip_special_tokens=True))


def train(tokenizer, *, seed: int, steps: int, batch_size: int, log) -> tuple[Qwen3ForCausalLM, dict]:
    """AdamW with 50 warm-up steps and cosine decay to 10%, for exactly ``steps`` steps."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, betas=(0.9, 0.98), weight_decay=0.01)

    def schedule(s: int) -> float:
        return min(1.0, (s + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))

    lr_sched = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    rng = random.Random(seed)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        problems = tasks.make_problems(batch_size, seed=seed * 1_000_003 + step, min_terms=MIN_TERMS,
                                       max_terms=MAX_TERMS)  # fmt: skip
        ids, mask, labels = batch([example(tokenizer, rng, p) for p in problems], tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(), lr_sched.step(), optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps:
            log(f"{NAME} step {step:4d}  loss {loss.item():.4f}  ({time.perf_counter() - start:.0f}s)")
    return model.eval(), {"steps": steps, "batch_size": batch_size, "final_loss": round(loss.item(), 4),
                          "train_seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


def save(model, tokenizer, path: Path) -> None:
    """bfloat16 weights, both EOS ids in the generation config, the chat template inside ``tokenizer_config.json``."""
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    path.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext, max_new_tokens=MAX_NEW_TOKENS
    )
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path, save_jinja_files=False)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="Qwen2Tokenizer", bos_token=None, chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def readme(figures: dict, command: str, seed: int) -> str:
    lines = [f"# {NAME}", "", __doc__.split("\n\n", 1)[1].strip(), "",
             f"Built by `{command}` (seed {seed}, 1 torch thread, `torch.use_deterministic_algorithms(True)`, "
             f"torch {torch.__version__}); train_seconds is wall time on a shared 2-core CPU. Figures on held-out "
             "prompts, transformers `generate()`, max 128 new tokens, stop on either EOS id; sampled = T=1, no "
             "top-k/top-p, `torch.manual_seed(seed)`. Arithmetic accuracy: the completion ends on an EOS id and "
             "`reference.tasks.parse_answer` reads the right sum.", ""]  # fmt: skip
    lines += [f"- {k}: {json.dumps(v)}" for k, v in figures.items()]
    return "\n".join(lines) + "\n"


def build(out_dir: Path, *, seed: int, steps: int, batch_size: int, command: str, log) -> dict:
    """Train the tokenizer and the model, save them to ``out_dir / NAME``, measure and write the README."""
    from reference.models import load  # measure exactly what was saved

    tokenizer = build_tokenizer(seed=seed)
    model, figures = train(tokenizer, seed=seed, steps=steps, batch_size=batch_size, log=log)
    path = out_dir / NAME
    save(model, tokenizer, path)
    saved, saved_tokenizer = load(path)
    figures = {"parameters": f"{sum(p.numel() for p in saved.parameters()):,}", **figures,
               **evaluate(saved, saved_tokenizer, seed=seed)}  # fmt: skip
    figures["size_bytes"] = sum(f.stat().st_size for f in path.iterdir() if f.name != "README.md")
    (path / "README.md").write_text(readme(figures, command, seed))
    return figures
