"""The reasoning-length GRPO workload: long, long-tailed completions that the model ends itself with its EOS.

GRPO on reasoning tasks (GSM8K-style chains) is where generation dominates a step and where padding-bound
``generate()`` wastes the most: a group's rows run until the longest one stops. No trained checkpoint small enough for
a CPU benchmark writes long chains and then stops, so this one is built to: a random-weight Llama (the bench's CPU
shape: hidden 256, 4 layers, 8/4 heads, MLP 688) over the bundled ``tiny-qwen3-chat`` tokenizer (a byte-level BPE of
2,048 ids), whose EOS probability is the same at every position. That makes the completion length of every row a
geometric draw, cut at ``max_completion_length`` (256): median ``MEDIAN_COMPLETION`` (64) tokens, mean ~87, ~6% of the
rows cut at 256. The trainer sees only a model and its EOS: no length is forced by anyone.

How the EOS probability is pinned (:func:`build_model`): residual channel 0 holds a constant ``ANCHOR`` at every
position (every token embedding has it, and no attention or MLP output writes channel 0), large enough to dominate the
final RMS norm, so the normed hidden state's channel 0 is nearly constant; the LM head's EOS row reads channel 0 only,
so the EOS logit is nearly constant, while the other 2,047 logits stay those of a random model (near uniform). The
EOS weight is then calibrated on random sequences until the mean per-position EOS probability is the hazard that
gives the median (:func:`calibrate`). The run reports the lengths the trainer actually saw.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch

MAX_COMPLETION = 256
MEDIAN_COMPLETION = 64
HAZARD = 1 - 0.5 ** (1 / MEDIAN_COMPLETION)  # P(EOS) per position whose geometric length has median 64
ANCHOR = 10.0
TOKENIZER = "tiny-qwen3-chat"  # the bundled checkpoint whose tokenizer (2,048 ids, EOS <|im_end|>) is reused
PROMPT_WORDS = (20, 0.3, 8, 60)  # words per prompt: lognormal median, sigma, clip low, clip high (~1.5 tokens a word)
WORDS = (
    "how many apples does the farmer sell if each basket holds twelve and he fills seven baskets before noon "
    "then gives three to his neighbour what is the total cost of four pens at two coins each plus a book"
).split()


def expected_lengths(hazard: float = HAZARD, cap: int = MAX_COMPLETION) -> dict[str, float]:
    """Median, mean and share cut at ``cap`` of ``min(Geometric(hazard), cap)``: the lengths the model is built for."""
    survive = (1 - hazard) ** cap  # P(no EOS in the first cap tokens)
    return {"median": math.ceil(math.log(0.5) / math.log(1 - hazard)), "mean": (1 - survive) / hazard,
            "cut_share": survive}  # fmt: skip


def _config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip


def mean_eos_probability(model, eos: int, *, seed: int = 0, rows: int = 8, length: int = 320) -> float:
    """The mean probability of ``eos`` over every position of ``rows`` random sequences of ``length`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, eos, (rows, length), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return float(logits.log_softmax(-1)[..., eos].exp().mean())


def calibrate(model, eos: int, hazard: float = HAZARD, *, rounds: int = 6) -> float:
    """Scale the EOS row's channel-0 weight until the mean EOS probability is ``hazard`` (the EOS logit moves by
    ``log(target / measured)`` each round, exact while the EOS probability is small); returns the last measurement."""
    head, h0 = model.get_output_embeddings().weight, _channel0_scale(model)
    for _ in range(rounds):
        measured = mean_eos_probability(model, eos)
        if abs(measured / hazard - 1) < 0.005:
            break
        with torch.no_grad():
            head[eos, 0] += math.log(hazard / measured) / h0
    return mean_eos_probability(model, eos)


def _channel0_scale(model) -> float:
    """What the final norm makes of the anchor: ~``ANCHOR / rms * weight``, measured on one short sequence."""
    captured: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5, 6]]))
    finally:
        hook.remove()
    return float(captured[0][..., 0].mean())


def build_model(tokenizer, *, seed: int = 0):
    """The seeded random Llama with a position-independent EOS probability (see the module docstring), calibrated."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(tokenizer)).float().eval()
    eos = int(tokenizer.eos_token_id)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = ANCHOR
        for layer in model.model.layers:  # nothing writes residual channel 0: it stays ANCHOR everywhere
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        head = model.get_output_embeddings().weight
        head[eos] = 0
        head[eos, 0] = math.log(HAZARD / (1 - HAZARD) * (len(tokenizer) - 1)) / _channel0_scale(model)
    calibrate(model, eos)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def write_checkpoint(out_dir: Path, *, seed: int = 0) -> dict:
    """Build the model, save it with the tokenizer to ``out_dir`` (a checkpoint any engine can load, vLLM included);
    returns what was built: the hazard measured after calibration and the lengths it implies."""
    from reference.models import load_tokenizer, resolve

    tokenizer = load_tokenizer(resolve(TOKENIZER))
    model = build_model(tokenizer, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    hazard = mean_eos_probability(model, int(tokenizer.eos_token_id), seed=1)  # held-out sequences
    return {"hazard": hazard, "expected": expected_lengths(hazard), "parameters": sum(p.numel() for p in
            model.parameters()), "vocab_size": len(tokenizer)}  # fmt: skip


def prompts(count: int, seed: int = 7) -> list[str]:
    """``count`` question-like prompts of lognormal word counts (``PROMPT_WORDS``), drawn from ``WORDS``."""
    rng = random.Random(seed)
    median, sigma, lo, hi = PROMPT_WORDS
    out = []
    for i in range(count):
        n = min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0, 1)))))
        out.append(f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(n)) + "? Think step by step.")
    return out


def reward(completions, **_) -> list[float]:
    """A cheap reward with spread inside a group: the share of vowels among a completion's letters."""
    letters = [[ch for ch in c.lower() if ch.isalpha()] for c in completions]
    return [sum(ch in "aeiou" for ch in ls) / len(ls) if ls else 0.0 for ls in letters]
