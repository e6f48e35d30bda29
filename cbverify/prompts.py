"""Prompts for ``cbverify verify``: the user's file in TRL's dataset formats, or a built-in set; tokenised as TRL does.

Formats (``--prompts FILE``), as TRL's GRPO datasets hold them:

- ``.jsonl`` (one JSON object per line) or ``.json`` (a list of objects, or ``{"prompt": [...]}`` columns), each
  with a ``prompt`` field that is either a string ("standard") or a list of ``{"role", "content"}`` messages
  ("conversational");
- ``.txt``: one standard prompt per non-empty line.

Tokenisation follows ``GRPOTrainer._tokenize_prompts`` (trl 1.16): a standard prompt is ``tokenizer(text)``'s
``input_ids`` (special tokens included, as the tokenizer adds them); a conversational one is
``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: ``text`` (standard) or ``messages`` (conversational), never both."""

    text: str | None = None
    messages: tuple[tuple[tuple[str, str], ...], ...] | None = None  # ((("role", r), ("content", c)), ...)

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("a prompt is either a string or a list of messages")

    @property
    def conversational(self) -> bool:
        return self.messages is not None

    def as_messages(self) -> list[dict[str, str]]:
        return [dict(m) for m in self.messages or ()]


def from_field(value: object, where: str) -> Prompt:
    """A ``prompt`` field's value as a :class:`Prompt`; ``where`` names it in errors."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: the prompt is empty")
        return Prompt(text=value)
    if isinstance(value, list) and value:
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"{where}: message {i} is not a {{'role': str, 'content': str}} object")
            messages.append((("role", m["role"]), ("content", m["content"])))
        return Prompt(messages=tuple(messages))
    raise ValueError(f"{where}: 'prompt' must be a non-empty string or list of messages, got {type(value).__name__}")


def load_prompts(path: str | Path) -> list[Prompt]:
    """Every prompt in ``path`` (see the module docstring); ``ValueError`` with the file and line on bad input."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file")
    text = read_text(path, "--prompts")
    if path.suffix == ".txt":
        prompts = [Prompt(text=line) for line in text.splitlines() if line.strip()]
    elif path.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                prompts.append(from_field(_row(_json(line, f"{path}:{n}"), f"{path}:{n}"), f"{path}:{n}"))
    elif path.suffix == ".json":
        data = _json(text, str(path))
        rows = data if isinstance(data, list) else [{"prompt": p} for p in _column(data, path)]
        prompts = [from_field(_row(r, f"{path}[{i}]"), f"{path}[{i}]") for i, r in enumerate(rows)]
    else:
        raise ValueError(f"--prompts {path}: unknown format {path.suffix!r} (use .jsonl, .json or .txt)")
    if not prompts:
        raise ValueError(f"--prompts {path}: the file holds no prompts")
    return prompts


def read_text(path: Path, flag: str) -> str:
    """``path``'s text; ``ValueError`` naming ``flag`` and the file when it is unreadable, not UTF-8 or binary."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot be read ({type(err).__name__}: {err.strerror or err})") from None
    if "\x00" in text:
        raise ValueError(f"{flag} {path}: binary data (a NUL byte at offset {text.index(chr(0))}), not text")
    return text


def _json(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg}, line {err.lineno} column {err.colno})") from None
    except RecursionError:
        raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None


def _row(row: object, where: str) -> object:
    if not isinstance(row, dict) or "prompt" not in row:
        raise ValueError(f"{where}: expected an object with a 'prompt' field")
    return row["prompt"]


def _column(data: object, path: Path) -> list:
    if isinstance(data, dict) and isinstance(data.get("prompt"), list):
        return data["prompt"]
    raise ValueError(f"--prompts {path}: expected a list of objects or a {{'prompt': [...]}} column")


def token_ids(prompt: Prompt, tokenizer) -> list[int]:
    """The prompt's token ids as TRL's ``GRPOTrainer`` makes them (see the module docstring); ``ValueError`` in one
    line when the tokenizer or its chat template refuses the prompt."""
    if prompt.conversational and not getattr(tokenizer, "chat_template", None):
        raise ValueError("conversational prompts need a chat template, and this tokenizer has none")
    try:
        if prompt.conversational:
            out = tokenizer.apply_chat_template(prompt.as_messages(), add_generation_prompt=True, tokenize=True,
                                                return_dict=True)  # fmt: skip
            ids = out["input_ids"]
        else:
            ids = tokenizer(text=prompt.text)["input_ids"]
        ids = [int(t) for t in (ids[0] if ids and isinstance(ids[0], list) else ids)]
    except Exception as err:  # a template's raise_exception, a tokenizer error: the prompt is refused, in one line
        what = "the chat template" if prompt.conversational else "the tokenizer"
        detail = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        raise ValueError(f"{what} refuses prompt {_short(prompt)}: {detail}") from None
    if not ids:
        raise ValueError(f"prompt {_short(prompt)} tokenises to nothing")
    return ids


def _short(prompt: Prompt) -> str:
    """The prompt for an error message: on one line, at most 60 characters."""
    text = prompt.text if prompt.text is not None else " / ".join(m["content"] for m in prompt.as_messages())
    return repr(text if len(text) <= 60 else text[:57] + "...")


_STANDARD = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Write a haiku about autumn leaves.",
    "def fibonacci(n):",
    "Q: What is 17 times 23?\nA:",
    "List three uses of a paperclip:\n1.",
    "Translate to German: The weather is nice today.",
    "In 1969, the first humans walked on the Moon. Describe how the astronauts trained for the mission, what the "
    "landing was like, and why the event still matters to people who were not yet born.",
    "Summarise the following in one sentence: Photosynthesis is the process by which green plants use sunlight, "
    "water and carbon dioxide to make glucose and oxygen.",
    "A train leaves at 3 pm travelling at 60 km/h; another leaves at 4 pm at 80 km/h. When does the second catch up?",
    "Hello",
    "Explain recursion to a five-year-old.",
    "The three primary colours are",
    "Dear Sir or Madam, I am writing to complain about",
    "import numpy as np\n\n# compute the mean of each row of a matrix\n",
    "Why is the sky",
)
_CONVERSATIONAL = (
    (("user", "What is the boiling point of water at sea level?"),),
    (("system", "You are a terse assistant."), ("user", "Name a prime number greater than 100.")),
    (("user", "Give me a word that rhymes with 'light'."),),
    (
        ("user", "I have 3 apples and eat one. How many are left?"),
        ("assistant", "2."),
        ("user", "And if I then buy five more?"),
    ),  # fmt: skip
    (
        (
            "user",
            "Write one sentence about the ocean, please. Make it vivid, with at least one colour and one sound "
            "in it, and do not use the word 'blue'.",
        ),
    ),  # fmt: skip
    (("system", "Answer in French."), ("user", "What day comes after Monday?")),
)


def builtin_prompts(*, conversational: bool) -> list[Prompt]:
    """The built-in natural-language set: 16 standard prompts of 1 to ~50 words, plus (with ``conversational``, for
    a tokenizer that has a chat template) 6 conversations, system prompts and multi-turn included."""
    prompts = [Prompt(text=t) for t in _STANDARD]
    if conversational:
        prompts += [Prompt(messages=tuple((("role", r), ("content", c)) for r, c in conv)) for conv in _CONVERSATIONAL]
    return prompts
