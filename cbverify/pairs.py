"""Options in pairs: which options act on the same quantity, whether a run set each pair of them together, and a
drawing plan that makes sure it does.

A :class:`PairSpace` declares, for one searched space (the trainer's configuration space, each transformers CB fuzz
entry point), its options and their values (:class:`Option`), grouped by the quantity they act on (:class:`Group`:
the loss normaliser, the sampler, the batch layout, ...). A *pair* is two values of two different options of one
group, both non-default and effective (``Option.effective``): e.g. ``loss_type=dapo`` with
``steps_per_generation!=gradient_accumulation_steps``. Options a space cannot draw are listed as ``outside`` with the
reason, so a report names them rather than pretending they were covered.

What a case *really did* is read by the space's owner (the fuzzer's run, the trainer's recording) as labels
``option=value``, one set per *unit* (a request, a call, a trainer run: the thing the options act on together), and
counted by :class:`Coverage`: pairs reached within a unit, each value's share of the cases. Nothing here reads what a
case only asked for.

:func:`plan` turns a space into the forced values of a run's cases: first a covering design of the pairs (every pair
set together in some row; rows across groups merged), then, alternating with free draws, rows that walk every value
of every option, so each value is forced in a known share of any run (:func:`guaranteed_share`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# every value of every declared space is forced in at least this share of the cases of any run of 40 or more
# (guaranteed_share over 40-400 examples: 6.25% for generate_batch, whose cycle is 6 rows, 10.6% for the manager,
# 9.3% for the trainer's space; property_tests/test_pairs.py holds every space to it)
MIN_SHARE = 0.06


@dataclass(frozen=True, slots=True)
class Option:
    """One option and its values as labels: ``values`` every value a run should show (each in a stated share),
    ``effective`` the non-default ones that take part in pairs, ``requires`` per value the ``(option, value)`` it
    only means something with (e.g. a top-k cut with sampling on)."""

    name: str
    values: tuple[str, ...]
    effective: tuple[str, ...] = ()
    requires: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    def __post_init__(self) -> None:
        if not self.values or len(set(self.values)) != len(self.values):
            raise ValueError(f"option {self.name!r}: values must be distinct and non-empty, got {self.values}")
        if not set(self.effective) <= set(self.values):
            raise ValueError(f"option {self.name!r}: effective {self.effective} not among its values {self.values}")

    def label(self, value: str) -> str:
        return f"{self.name}={value}"

    def needs(self, value: str) -> tuple[tuple[str, str], ...]:
        return dict(self.requires).get(value, ())


@dataclass(frozen=True, slots=True)
class Group:
    quantity: str  # what the options act on together
    options: tuple[Option, ...]


@dataclass(frozen=True, slots=True)
class PairSpace:
    name: str
    groups: tuple[Group, ...]
    singles: tuple[Option, ...] = ()  # options counted for their share only (in no pair)
    outside: tuple[tuple[str, str], ...] = ()  # (option, why this space cannot draw it)

    def __post_init__(self) -> None:
        names = [o.name for o in self.options]
        if len(set(names)) != len(names):
            raise ValueError(f"space {self.name!r}: an option listed twice in {names}")
        for o in self.options:
            for other, value in (need for _, needs in o.requires for need in needs):
                if other not in names or value not in self.option(other).values:
                    raise ValueError(f"option {o.name!r} requires {other}={value}, not a value of this space")

    @property
    def options(self) -> tuple[Option, ...]:
        return tuple(o for g in self.groups for o in g.options) + self.singles

    def option(self, name: str) -> Option:
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(f"space {self.name!r} has no option {name!r}")

    def labels(self) -> tuple[str, ...]:
        return tuple(o.label(v) for o in self.options for v in o.values)

    def pairs(self) -> tuple[tuple[str, str], ...]:
        """Every pair: two effective values of two different options of one group, in declaration order."""
        out = []
        for g in self.groups:
            for i, a in enumerate(g.options):
                for b in g.options[i + 1 :]:
                    out += [(a.label(x), b.label(y)) for x in a.effective for y in b.effective]
        return tuple(out)


def parse(label: str) -> tuple[str, str]:
    name, sep, value = label.partition("=")
    if not sep:
        raise ValueError(f"not an option=value label: {label!r}")
    return name, value


@dataclass
class Coverage:
    """Pairs and values reached over a run's cases, from the labels each case's units really showed."""

    space: PairSpace
    cases: int = 0
    values: Counter = field(default_factory=Counter)  # label -> cases showing it
    pairs: Counter = field(default_factory=Counter)  # pair -> cases reaching it

    def add(self, units) -> None:
        """One case: ``units`` is an iterable of label sets, a pair counts where both are in one unit."""
        units = [set(u) for u in units]
        known = set(self.space.labels())
        for u in units:
            if unknown := u - known:
                raise ValueError(f"space {self.space.name!r}: unknown labels {sorted(unknown)}")
        self.cases += 1
        self.values.update(set().union(*units) if units else set())
        self.pairs.update({p for p in self.space.pairs() if any(p[0] in u and p[1] in u for u in units)})

    def merge(self, other: Coverage) -> None:
        self.cases += other.cases
        self.values.update(other.values)
        self.pairs.update(other.pairs)

    @property
    def missing(self) -> list[tuple[str, str]]:
        return [p for p in self.space.pairs() if not self.pairs[p]]

    @property
    def reached(self) -> int:
        return len(self.space.pairs()) - len(self.missing)

    def shares(self) -> dict[str, float]:
        return {lab: self.values[lab] / self.cases if self.cases else 0.0 for lab in self.space.labels()}

    def below(self, share: float) -> list[str]:
        """Values shown in fewer than ``share`` of the cases."""
        return [lab for lab, s in self.shares().items() if s < share]

    def line(self) -> str:
        """``pairs reached N/M`` and, loudly, every pair not reached; the options this space cannot draw."""
        text = f"pairs reached {self.reached}/{len(self.space.pairs())} ({self.space.name}, {self.cases} cases)"
        if self.missing:
            text += "; NOT REACHED: " + ", ".join(f"{a} x {b}" for a, b in self.missing)
        if self.space.outside:
            text += "; not drawn here: " + ", ".join(name for name, _ in self.space.outside)
        return text

    def to_json(self) -> dict:
        return {"space": self.space.name, "cases": self.cases, "pairs": len(self.space.pairs()),
                "reached": self.reached, "missing": [f"{a} x {b}" for a, b in self.missing],
                "values": {lab: self.values[lab] for lab in self.space.labels()},
                "outside": dict(self.space.outside)}  # fmt: skip


# ------------------------------------------------------------------------------------------------ the drawing plan
def _fits(space: PairSpace, row: dict[str, str], name: str, value: str) -> dict[str, str] | None:
    """``row`` with ``name=value`` and what it requires, or None where that contradicts the row."""
    if row.get(name, value) != value:
        return None
    out = {**row, name: value}
    for other, wanted in space.option(name).needs(value):
        if out.get(other) != wanted:
            out = _fits(space, out, other, wanted)
            if out is None:
                return None
    return out


def covering_rows(space: PairSpace) -> list[dict[str, str]]:
    """Rows (option -> value) such that every pair of ``space`` is set together in some row: greedy per group (a row
    starts from the first pair still uncovered, then each other option takes the value covering most uncovered pairs
    with the row), the groups' rows merged position by position. Deterministic."""
    per_group: list[list[dict[str, str]]] = []
    for g in space.groups:
        sub = PairSpace(space.name, (g,), singles=tuple(o for o in space.options if o not in g.options))
        todo = list(sub.pairs())
        rows: list[dict[str, str]] = []
        while todo:
            (na, va), (nb, vb) = parse(todo[0][0]), parse(todo[0][1])
            row = _fits(space, _fits(space, {}, na, va) or {}, nb, vb)
            if row is None:
                raise ValueError(f"space {space.name!r}: the pair {todo[0]} cannot be set together")
            for o in g.options:
                if o.name in row:
                    continue
                best, gain = None, 0
                for v in o.effective:
                    cand = _fits(space, row, o.name, v)
                    if cand is None:
                        continue
                    labels = {space.option(n).label(x) for n, x in cand.items()}
                    new = sum(1 for a, b in todo if a in labels and b in labels)
                    if new > gain:
                        best, gain = cand, new
                row = best or row
            labels = {space.option(n).label(x) for n, x in row.items()}
            todo = [(a, b) for a, b in todo if not (a in labels and b in labels)]
            rows.append(row)
        per_group.append(rows)
    merged: list[dict[str, str]] = []
    for k in range(max((len(r) for r in per_group), default=0)):
        row: dict[str, str] = {}
        for rows in per_group:
            if k < len(rows):
                for n, v in rows[k].items():
                    row = _fits(space, row, n, v) or row  # a group's row that contradicts another's loses that value
        merged.append(row)
    # a value dropped by a contradiction gets its own row
    labels_of = [{space.option(n).label(x) for n, x in r.items()} for r in merged]
    for rows in per_group:
        for r in rows:
            lab = {space.option(n).label(x) for n, x in r.items()}
            if not any(lab <= m for m in labels_of):
                merged.append(r)
                labels_of.append(lab)
    return merged


def value_rows(space: PairSpace) -> list[dict[str, str]]:
    """Rows that force every value of every option at least once per cycle: each row takes the values forced least
    so far first (ties in declaration order), every one that fits the row (with what it requires)."""
    forced: Counter = Counter()
    rows: list[dict[str, str]] = []
    every = [(o.name, v) for o in space.options for v in o.values]
    while any(forced[space.option(n).label(v)] == 0 for n, v in every):
        row: dict[str, str] = {}
        for n, v in sorted(every, key=lambda nv: forced[space.option(nv[0]).label(nv[1])]):
            if n not in row:
                row = _fits(space, row, n, v) or row
        if all(forced[space.option(n).label(v)] for n, v in row.items()):
            raise ValueError(f"space {space.name!r}: some values can never be forced: {row}")
        forced.update(space.option(n).label(v) for n, v in row.items())
        rows.append(row)
    return rows


@dataclass
class Plan:
    """The forced values of a run: the covering rows first, then value rows for half of the cases left (cycling), the
    other half drawn freely. :meth:`rows` lists the forced rows of a run of ``examples`` cases, in the order they run;
    :func:`concrete` turns each into a case."""

    space: PairSpace
    cover: list[dict[str, str]] = field(default_factory=list)
    cycle: list[dict[str, str]] = field(default_factory=list)

    @staticmethod
    def of(space: PairSpace, *, drop: tuple[tuple[str, str], ...] = ()) -> Plan:
        """The plan of ``space``; ``drop``: pairs left out of every forced row (to watch a report name them)."""
        cover, cycle = covering_rows(space), value_rows(space)
        if drop:
            cover, cycle = _without(space, cover, drop), _without(space, cycle, drop)
        return Plan(space, cover, cycle)

    def rows(self, examples: int) -> list[dict[str, str]]:
        if examples < 0:
            raise ValueError(f"examples must be >= 0, got {examples}")
        left = max(0, examples - len(self.cover))
        walked = [self.cycle[j % len(self.cycle)] for j in range(-(-left // 2))] if self.cycle else []
        return (self.cover + walked)[:examples]


def _without(space: PairSpace, rows: list[dict[str, str]], drop) -> list[dict[str, str]]:
    """``rows`` where each dropped pair is never forced together: where a row forces both, the second option takes a
    value outside the pairs instead (or is left free where it has none)."""
    out = []
    for row in rows:
        row = dict(row)
        for a, b in drop:
            (na, va), (nb, vb) = parse(a), parse(b)
            if row.get(na) == va and row.get(nb) == vb:
                option, rest = space.option(nb), {k: v for k, v in row.items() if k != nb}
                fitted = (_fits(space, rest, nb, v) for v in option.values if v not in option.effective)
                row = next((f for f in fitted if f is not None), rest)
        out.append(row)
    return out


def guaranteed_share(space: PairSpace, examples: int, plan: Plan | None = None) -> float:
    """The share of a run of ``examples`` cases in which the plan forces each value, at the least (a run shows more
    where free draws add some, less where a forced value did not take effect)."""
    counts: Counter = Counter()
    for row in (plan or Plan.of(space)).rows(examples):
        counts.update(space.option(n).label(v) for n, v in row.items())
    return min(counts[lab] for lab in space.labels()) / examples


def concrete(strategy, seed: int):
    """One value of ``strategy``, the same for the same ``seed``: the last of a few seeded Hypothesis draws (the
    first draw of a run is the strategy's simplest value), no example database."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    got = []

    def keep(value) -> None:
        got.append(value)

    run = settings(max_examples=3, database=None, phases=[Phase.generate], deadline=None,
                   suppress_health_check=list(HealthCheck))(hypothesis_seed(seed)(given(strategy)(keep)))  # fmt: skip
    run()
    if not got:
        raise ValueError(f"the strategy drew nothing with seed {seed}")
    return got[-1]


# ----------------------------------------------------------------------------------- the trainer's configuration space
TRAINER_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
TRAINER_OUTSIDE = (
    ("processes", "the step checks record one trainer process; cbverify upstream --run --nproc 2 runs its scenarios "
     "across ranks (cbverify.upstream.distributed)"),
    ("tool masking", "TrainerScenario makes no tool calls and the oracle's rollout_func returns no tool mask"),
    ("repetition_penalty", "the rollout_func backends raise on it rather than drop it (cbverify.upstream.rollout)"),
)  # fmt: skip


def trainer_space(loss_types: tuple[str, ...] = TRAINER_LOSS_TYPES) -> PairSpace:
    """The GRPO step property's space (``property_tests.strategies.trainer_configs``) for the loss types a release
    has: the loss normaliser (loss type, truncated rows masked, a generation batch spread over several accumulation
    windows or a window over several generation batches), the sampler (temperature, top-k, top-p, min-p) and the
    batch layout (group size, how a micro-batch cuts the groups)."""
    if not loss_types:
        raise ValueError("trainer_space needs at least one loss type")
    return PairSpace(
        "trainer config space",
        (
            Group("loss normaliser", (
                Option("loss_type", tuple(loss_types), tuple(loss_types)),
                Option("mask_truncated_completions", ("false", "true+cut"), ("true+cut",)),
                Option("steps_per_generation", ("gas", "above-gas", "below-gas"), ("above-gas", "below-gas")),
            )),
            Group("sampler", (
                Option("temperature", ("1.0", "other"), ("other",)),
                Option("top_k", ("0", "cut"), ("cut",)),
                Option("top_p", ("1.0", "below-1"), ("below-1",)),
                Option("min_p", ("0", "above-0"), ("above-0",)),
            )),
            Group("batch layout", (
                Option("num_generations", ("2", "3"), ("3",)),
                Option("per_device_train_batch_size", ("one-group", "splits-a-group", "several-groups"),
                       ("splits-a-group", "several-groups")),
            )),
        ),
        outside=TRAINER_OUTSIDE,
    )  # fmt: skip


def trainer_labels(scenario, record) -> set[str]:
    """What a GRPO trainer run really did, as labels of :func:`trainer_space`: nothing where it trained on nothing
    (a crash before the first loss call); ``mask_truncated_completions=true+cut`` only where some row generated in
    the run did not end on EOS and some did (a run whose every row is masked trains on nothing)."""
    if record.error is not None or not record.losses:
        return set()
    ended = [bool(c) and c[-1] in record.eos_token_ids for g in record.generations for c in g.completion_ids]
    cut = not all(ended) and any(ended)
    ng, per_device = scenario.num_generations, scenario.per_device_train_batch_size or scenario.batch_size
    layout = "splits-a-group" if per_device % ng else "several-groups" if per_device >= 2 * ng else "one-group"
    out = {
        f"loss_type={scenario.loss_type}",
        f"steps_per_generation={_spg(scenario.spg, scenario.gradient_accumulation_steps)}",
        f"temperature={'1.0' if scenario.temperature == 1.0 else 'other'}",
        f"top_k={'cut' if 0 < scenario.top_k < _vocab() else '0'}",
        f"top_p={'below-1' if scenario.top_p < 1.0 else '1.0'}",
        f"min_p={'above-0' if scenario.min_p > 0 else '0'}",
        f"num_generations={ng}",
        f"per_device_train_batch_size={layout}",
    }
    if scenario.mask_truncated_completions and cut:
        out.add("mask_truncated_completions=true+cut")
    elif not scenario.mask_truncated_completions:
        out.add("mask_truncated_completions=false")
    return out


def _spg(spg: int, gas: int) -> str:
    """A generation batch spread over several accumulation windows (above), or a window over several generation
    batches (below): the two ways the normaliser's batch and the optimizer step's differ."""
    return "gas" if spg == gas else "above-gas" if spg > gas else "below-gas"


def _vocab() -> int:
    from reference import tasks

    return tasks.VOCAB_SIZE
