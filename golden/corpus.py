"""Reproducible bundled text for the chat model: natural-language documents and chat dialogues, generated in code.

Nothing is downloaded and no text file is committed: every string comes from templates over the word lists below,
drawn from ``random.Random(seed)``, so the same seed gives the same text on any machine. Used by
``golden.build_qwen3_chat`` to train the byte-level BPE tokenizer and the model.

- :func:`document`: a few paragraphs of templated sentences (varied punctuation, quotes, digits, bullet lists,
  blank lines) — plain-text pre-training data, ended by ``<|endoftext|>`` by the caller;
- :func:`arithmetic_question` / :func:`arithmetic_answer`: a ``reference.tasks`` problem as a user message and the
  assistant's gold chain (the task's own completion text, so ``tasks.parse_answer`` reads the answer);
- :func:`small_talk`: one user message and a short assistant reply of one to three sentences.

Simplifications: the language is a template grammar (no real corpus), so the text is repetitive by design.
"""

from __future__ import annotations

import random

from reference import tasks

NAMES = tuple(
    """
    Ada Ben Chloe Dmitri Elena Farid Grace Hiro Ines Jonas Kemi Luca Mira Noor Omar Priya Quinn Rosa Sven Tariq
    Uma Viktor Wen Yara Zoe
    """.split()
)
NOUNS = tuple(
    """
    river garden teacher window market letter bridge kitchen forest train library student mountain village lamp
    basket harbor painter clock road bakery island notebook museum orchard lighthouse bicycle storm meadow engine
    question answer number problem story song friend neighbor doctor farmer ladder tractor compass blanket candle
    chimney festival harvest journey kettle lantern mirror needle pocket rabbit saddle thunder umbrella valley
    wagon yard anchor balcony cabinet dragon elephant feather guitar hammer jacket keyboard ledger magnet napkin
    ocean pencil quilt ribbon sandwich tunnel violin whistle scientist sailor merchant captain gardener musician
    pilot printer cottage factory stadium hospital airport theater castle temple canal desert glacier volcano
    planet comet signal machine puzzle recipe journal
    """.split()
)
ADJECTIVES = tuple(
    """
    quiet old bright small busy green cold warm narrow wide careful happy tired strange simple heavy gentle early
    late clever red blue patient noisy empty famous hidden round tall wooden ancient brave curious distant eager
    fragile golden honest icy jolly kind lively modern nervous orange polite rapid silver tiny useful vivid wild
    yellow purple dusty shiny soft loud sharp smooth
    """.split()
)
VERBS_PAST = tuple(
    """
    opened watched painted carried visited found counted cleaned followed remembered fixed described crossed built
    shared wrote read checked borrowed noticed repaired measured discovered collected explained ordered delivered
    imagined climbed planted polished organized answered recorded
    """.split()
)
VERBS = tuple(
    """
    open watch paint carry visit find count clean follow remember fix describe cross build share write read check
    borrow notice repair measure discover collect explain order deliver imagine climb plant polish organize answer
    record
    """.split()
)
PLACES = ("the station", "the old town", "the harbor", "the hill", "the school", "the square", "the valley",
          "the park", "the coast", "the north road", "the market hall", "the big lake")  # fmt: skip
TIMES = ("In the morning", "After lunch", "On Monday", "Last winter", "At noon", "Before dawn", "Every Sunday",
         "Later that day", "In 1998", "At 7:30")  # fmt: skip
ADVERBS = ("slowly", "quickly", "carefully", "quietly", "twice", "again", "together", "alone", "early", "happily")
_SYLLABLES = tuple(
    """
    ka lo mir an tor el sun ra vin dal or ish be gra mon te lu has pe ri zan co fen wy dor ul mas ti ner bo quel
    sa vek ith nu por ald ze kir ob
    """.split()
)


def _coined(seed: int, num: int) -> tuple[str, ...]:
    """``num`` distinct made-up proper names of two or three syllables (towns, families): vocabulary for the BPE."""
    rng, names = random.Random(seed), {}
    while len(names) < num:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        names.setdefault(name, None)
    return tuple(names)


TOWNS = _coined(1, 300)
FAMILIES = _coined(2, 300)

_SENTENCES = (
    "The {adj} {noun} {verb_past} the {noun2}.",
    "{name} {verb_past} the {adj} {noun} near {place}.",
    "{time}, {name} and {name2} {verb_past} {num} {noun}s.",
    "There were {num} {adj} {noun}s in {place}; {name} {verb_past} all of them.",
    "Why did {name} {verb} the {noun} {adverb}?",
    '{name} said, "The {noun} is {adj} today!"',
    "It was {adj}, {adj2} and a little {adj3}.",
    '{name} asked: "Can you {verb} the {noun} before {num_small} o\'clock?"',
    "The {noun} ({adj}, of course) {verb_past} {adverb} - nobody knew why.",
    "{time}, the {noun} near {place} was {adj}.",
    '"{adj_cap} {noun}s," {name} wrote, "are hard to {verb}."',
    "We {verb_past} {num} of the {noun}s and {num_small} of the {noun2}s.",
)
_QUESTIONS = (
    "What is {expr}?",
    "Please add {expr}.",
    "Can you compute {expr} for me?",
    "Add these numbers: {expr}",
    "{name} has {expr} apples in total. How many is that?",
    "Q:{expr}",
    "What do you get if you add up {expr}? Show your steps.",
    "I need the sum of {expr}, step by step.",
)
_TALK = (
    ("Tell me about the {noun}.", 2),
    ("What did {name} do {time_lower}?", 1),
    ("Write a short story about a {adj} {noun}.", 3),
    ("Hello! How are you today?", 1),
    ("Describe {place}.", 2),
    ("Who {verb_past} the {noun}?", 1),
    ("Give me one sentence about {name}.", 1),
)
_OPENERS = ("Sure.", "Of course!", "Here it is:", "Well,", "Okay.", "Good question.")


def _pick(rng: random.Random, words: tuple[str, ...], k: int = 1) -> list[str]:
    """``k`` distinct words drawn with Zipf weights 1/rank: frequent words are clearly more likely than rare ones, so
    a trained model's greedy choice among them is not a near-tie (uniform word lists would make genuine ties)."""
    picked: list[str] = []
    while len(picked) < k:
        word = rng.choices(words, weights=[1 / (r + 1) for r in range(len(words))])[0]
        if word not in picked:
            picked.append(word)
    return picked


def _slots(rng: random.Random) -> dict[str, str]:
    adj = _pick(rng, ADJECTIVES, 3)
    name = _pick(rng, NAMES, 2)
    noun = _pick(rng, NOUNS, 2)
    time = _pick(rng, TIMES)[0]
    town = _pick(rng, TOWNS, 2)
    return {
        "family": _pick(rng, FAMILIES)[0], "town": town[0], "town2": town[1], "year": str(rng.randint(1890, 2030)),
        "adj": adj[0], "adj2": adj[1], "adj3": adj[2], "adj_cap": adj[0].capitalize(), "name": name[0],
        "name2": name[1], "noun": noun[0], "noun2": noun[1], "verb": _pick(rng, VERBS)[0],
        "verb_past": _pick(rng, VERBS_PAST)[0], "place": _pick(rng, PLACES)[0] if rng.random() < 0.7 else town[0],
        "time": time, "time_lower": time[0].lower() + time[1:], "adverb": _pick(rng, ADVERBS)[0],
        "num": str(rng.randint(2, 999)), "num_small": str(rng.randint(1, 12)),
    }  # fmt: skip


def sentence(rng: random.Random) -> str:
    """One templated sentence with its slots filled."""
    return rng.choice(_SENTENCES).format(**_slots(rng))


def document(rng: random.Random) -> str:
    """One to four paragraphs (or bullet lists) separated by blank lines; no trailing newline."""
    blocks = []
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.2:
            blocks.append("\n".join(f"- {sentence(rng)}" for _ in range(rng.randint(2, 4))))
        else:
            blocks.append(" ".join(sentence(rng) for _ in range(rng.randint(1, 4))))
    return "\n\n".join(blocks)


def arithmetic_question(problem: tasks.ArithProblem, rng: random.Random) -> str:
    """The problem as a user message in one of several phrasings (the terms always appear as ``a+b+c``)."""
    expr = "+".join(map(str, problem.terms))
    return _pick(rng, _QUESTIONS)[0].format(expr=expr, name=_pick(rng, NAMES)[0])


def arithmetic_answer(problem: tasks.ArithProblem) -> str:
    """The assistant's reply: the task's gold chain, one partial sum per line, then ``A:<sum>``."""
    return problem.completion


def small_talk(rng: random.Random) -> tuple[str, str]:
    """``(user message, assistant reply)``: a templated request and one to three templated sentences."""
    template, num_sentences = rng.choice(_TALK)
    reply = " ".join(sentence(rng) for _ in range(num_sentences))
    if rng.random() < 0.5:
        reply = f"{rng.choice(_OPENERS)} {reply}"
    return template.format(**_slots(rng)), reply


def tokenizer_texts(num: int, *, seed: int) -> list[str]:
    """``num`` plain texts for training the tokenizer: documents, questions, answers and replies, in a fixed mix."""
    rng = random.Random(seed)
    texts = []
    for problem in tasks.make_problems(num, seed=seed + 1):
        kind = rng.random()
        if kind < 0.5:
            texts.append(document(rng))
        elif kind < 0.8:
            texts.append(arithmetic_question(problem, rng) + "\n" + arithmetic_answer(problem))
        else:
            texts.append("\n".join(small_talk(rng)))
    return texts
