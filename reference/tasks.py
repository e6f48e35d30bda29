"""The synthetic multi-step arithmetic task: a miniature GSM8K with a checkable reward.

One module for the prompts, the gold chains of reasoning, the character vocabulary and the reward, reused by model
building (``golden.build_models``), the GRPO loop (``reference.train``), tests and benchmarks.

A problem adds 2-8 numbers in [0, 99]. The prompt is the question; the completion is one step per line, then the
answer, then EOS::

    prompt:      "Q:12+7+33\\n"
    completion:  "12+7=19\\n19+33=52\\nA:52"  + <eos>

Simplifications versus GSM8K: no natural language, one operation, a character-level tokenizer.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
CHARACTERS = "0123456789+-*=:?QA \n"
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
VOCAB_SIZE = 32  # padded beyond len(VOCAB) (23) so that a few ids are never produced by the tokenizer
PAD_ID, BOS_ID, EOS_ID = VOCAB[PAD], VOCAB[BOS], VOCAB[EOS]

_ANSWER = re.compile(r"A:(\d+)")


@dataclass(frozen=True, slots=True)
class ArithProblem:
    terms: tuple[int, ...]

    @property
    def answer(self) -> int:
        return sum(self.terms)

    @property
    def prompt(self) -> str:
        return "Q:" + "+".join(map(str, self.terms)) + "\n"

    @property
    def completion(self) -> str:
        """The gold chain: one partial sum per line, then the answer (EOS is appended by the tokenizer's caller)."""
        lines, total = [], self.terms[0]
        for term in self.terms[1:]:
            lines.append(f"{total}+{term}={total + term}")
            total += term
        return "\n".join(lines) + f"\nA:{total}"


def make_problems(num: int, *, seed: int, min_terms: int = 2, max_terms: int = 8) -> list[ArithProblem]:
    """``num`` problems drawn from ``random.Random(seed)``: a uniform number of terms, each uniform in [0, 99]."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if not 2 <= min_terms <= max_terms:
        raise ValueError(f"need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
    rng = random.Random(seed)
    return [
        ArithProblem(tuple(rng.randint(0, 99) for _ in range(rng.randint(min_terms, max_terms)))) for _ in range(num)
    ]


def encode(text: str) -> list[int]:
    """Characters -> token ids (no BOS/EOS). Raises ``ValueError`` on a character outside the vocabulary."""
    try:
        return [VOCAB[ch] for ch in text]
    except KeyError as err:
        raise ValueError(f"character {err.args[0]!r} is not in the arithmetic vocabulary") from None


def decode(ids: list[int] | tuple[int, ...]) -> str:
    """Token ids -> text, dropping special tokens and ids outside the character vocabulary."""
    inverse = {i: tok for tok, i in VOCAB.items() if tok not in SPECIAL_TOKENS}
    return "".join(inverse.get(int(i), "") for i in ids)


def prompt_ids(problem: ArithProblem) -> list[int]:
    """The prompt as the model sees it: BOS + question."""
    return [BOS_ID, *encode(problem.prompt)]


def parse_answer(completion_text: str) -> int | None:
    """The integer after the first ``A:``, or ``None`` when there is none."""
    match = _ANSWER.search(completion_text)
    return int(match.group(1)) if match else None


def reward(problem: ArithProblem, completion_ids: list[int] | tuple[int, ...]) -> float:
    """Exact-answer reward: 1.0 when the completion states the right sum and ends on EOS, else 0.0."""
    ids = list(completion_ids)
    if not ids or ids[-1] != EOS_ID:
        return 0.0
    return 1.0 if parse_answer(decode(ids)) == problem.answer else 0.0
