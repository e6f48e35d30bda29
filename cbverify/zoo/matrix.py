"""The architecture x engine matrix: every zoo checkpoint (and every feature combination,
:mod:`cbverify.zoo.combinations`) through every engine, judged as ``cbverify verify`` does.

Per architecture (:func:`run_architecture`): the reference generates :func:`zoo_requests` (greedy and sampled,
three of them 14 tokens long, well past the zoo's sliding window of ``zoo.WINDOW``), then each engine is built with
:data:`ENGINE_OPTIONS` and judged by ``report.evaluate_engine`` in
the tier of the dtype (``tolerances.tier_for``: float32 by default; bfloat16 / float16 cast the checkpoint; in
float32 a model whose decode is a recurrence gets ``tolerances.recurrent_tier``, read off its cache by
``tier_for_model``): tokens
identical where the spec fixes them, up to the tier's near-ties, log-probs against teacher forcing; no distribution
test, the cross-engine suite does that. The registered findings were measured in float32 and apply at every dtype.
A verdict is:

- ``PASS``; ``N/A`` with the engine's one-line reason (``NotApplicable``, e.g. cb_impl refusing a model up front);
- ``XFAIL(<id>)``: a FAIL covered by a registered architecture finding (:mod:`cbverify.zoo.findings`);
- ``FAIL`` (unregistered) or ``FIXED?(<id>)`` (a registered finding that passes again): both are test failures.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from cbverify import report
from cbverify.engines import LOCAL_ENGINES, NotApplicable, get_engine
from cbverify.tolerances import tier_for, tier_for_model
from cbverify.zoo import architectures as zoo
from cbverify.zoo.findings import architecture_finding
from reference.models import load as load_checkpoint
from reference.spec import RolloutRequest, SamplingParams

ENGINE_OPTIONS: dict[str, dict] = {
    # small blocks and chunks: windows, prefill chunks and decode cross block boundaries
    "cb_impl": {"block_size": 4, "num_blocks": 64, "max_batch_tokens": 8},
    "transformers-cb": {"page_size": 16, "max_batch_tokens": 64},
}
PROMPTS = ((1, 19, 4, 13, 7, 15, 9, 16, 18, 21, 20, 17), (1, 5, 14))


def zoo_requests() -> list[RolloutRequest]:
    """Greedy and sampled requests: three 14-token ones on one 12-token prompt (no EOS: they run past any window;
    the two sampled ones form a GRPO group), and two short ones that may stop on EOS."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=14)
    sampled = SamplingParams(temperature=1.0, top_k=10, top_p=0.95, max_new_tokens=14)
    cool = SamplingParams(temperature=0.7, max_new_tokens=8)
    long, short = PROMPTS
    return [
        RolloutRequest("long-greedy", long, greedy, seed=0, eos_token_ids=()),
        RolloutRequest("long-sampled-0", long, sampled, seed=1, eos_token_ids=()),
        RolloutRequest("long-sampled-1", long, sampled, seed=2, eos_token_ids=()),
        RolloutRequest("short-greedy", short, SamplingParams(temperature=0.0, max_new_tokens=8), eos_token_ids=(2,)),
        RolloutRequest("short-sampled", short, cool, seed=3, eos_token_ids=(2,)),
    ]


@dataclass(frozen=True, slots=True)
class Cell:
    """One (architecture, engine) verdict: ``status`` as in the module docstring, ``detail`` one line; ``identical``
    when every request's tokens equal the reference's (no divergence, not even at an accepted near-tie)."""

    arch: str
    engine: str
    status: str
    detail: str = ""
    identical: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "PASS" or self.status.startswith(("N/A", "XFAIL"))


def judge(arch: zoo.Arch, engine: str, row: report.EngineRow, num_requests: int = 0) -> Cell:
    """An ``EngineRow`` of ``num_requests`` requests -> a :class:`Cell`, registered architecture findings applied (by
    the entry's family and features)."""
    detail = " ".join(" | ".join(row.problems).split())[:300]
    identical = row.tokens_compared == num_requests > 0 and row.tokens_equal == row.tokens_compared
    family, features = arch.model_type, arch.features
    if row.status == "N/A":
        return Cell(arch.name, engine, "N/A", detail)
    if row.status == "PASS":  # a finding about this architecture that no longer shows
        finding = architecture_finding(engine, family, features=features)
        fixed = finding is not None and family in finding.architectures
        return Cell(arch.name, engine, f"FIXED?({finding.id})" if fixed else "PASS", "", identical)
    finding = architecture_finding(engine, family, row.problems, features=features)
    return Cell(arch.name, engine, f"XFAIL({finding.id})" if finding else "FAIL", detail, identical)


class _Replay:
    """The reference's rollouts replayed through ``evaluate_engine`` (conventions and teacher forcing)."""

    def __init__(self, engine, rollouts) -> None:
        self.name, self.capabilities, self.rollouts = engine.name, engine.capabilities, rollouts

    def generate(self, requests):
        return self.rollouts


def run_architecture(
    arch: zoo.Arch | str, directory: Path | str, engines=LOCAL_ENGINES, dtype: str = "float32"
) -> list[Cell]:
    """Build/load ``arch`` under ``directory`` (in ``dtype``) and judge every engine in ``engines`` on
    :func:`zoo_requests` in ``tier_for_model`` (``tier_for(dtype)``; in float32 a model with a recurrent decode gets
    ``recurrent_tier`` of the longest request)."""
    arch = zoo.by_name(arch) if isinstance(arch, str) else arch
    model, _ = zoo.load(arch, directory)  # built there first if absent
    if dtype != "float32":  # loaded in that dtype as a user would (rotary frequencies stay float32)
        model, _ = load_checkpoint(Path(directory) / arch.name, dtype=dtype)
    requests = zoo_requests()
    longest = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
    tier = tier_for_model(model, dtype, max_length=longest)  # a recurrent decode's float32 noise grows with length
    oracle = get_engine("reference", model)
    reference = oracle.generate(requests)
    cells = []
    for name in engines:
        if name == "reference":
            row = report.evaluate_engine(_Replay(oracle, reference), model, requests, reference, tier)
        else:
            try:
                engine = get_engine(name, model, **ENGINE_OPTIONS.get(name, {}))
            except NotApplicable as err:
                cells.append(Cell(arch.name, name, "N/A", err.reason))
                continue
            which = f"--archs --combinations {arch.name}" if arch.family else f"--archs {arch.name}"
            repro = f"cbverify zoo {which} --engines {name} --dtype {dtype}"
            row = report.evaluate_engine(engine, model, requests, reference, tier, repro=repro)
        cells.append(judge(arch, name, row, len(requests)))
    return cells


def run_matrix(
    directory: Path | str, archs=zoo.ARCHS, engines=LOCAL_ENGINES, progress: bool = False, dtype: str = "float32"
) -> list[Cell]:
    """:func:`run_architecture` for each of ``archs``, in order (one line per architecture when ``progress``)."""
    cells = []
    for arch in archs:
        start = time.perf_counter()
        new = run_architecture(arch, directory, engines, dtype)
        cells += new
        if progress:
            print(f"{arch.name}: {time.perf_counter() - start:.1f}s " + " ".join(c.status for c in new), flush=True)
    return cells


def _short(cell: Cell) -> str:
    if cell.status == "N/A":
        return "N/A: " + re.sub(r"^\S+ is not supported by cb_impl: ", "", cell.detail).replace("|", "/")
    return cell.status


HEADER = (
    "Generated by `cbverify zoo {flags}` (do not edit): the tiny random checkpoints of "
    "`cbverify.zoo`, {dtype} on CPU, each engine judged against the reference oracle by `cbverify.zoo.matrix`. "
    "N/A: the engine refuses the model up front, with its reason; XFAIL(id): a registered upstream finding "
    "(`cbverify.zoo.findings.ARCHITECTURE_FINDINGS`)."
)
COMBINATIONS_HEADER = (
    "Each row is a family's config with feature switches (`cbverify.zoo.combinations`: sliding window on all layers "
    "/ alternating / from layer 1, attention and final-logit soft-capping, chunked attention, q/k norm, a NoPE layer, "
    "attention temperature tuning, a dense first layer in an MoE, tied embeddings), kept only where the model, "
    "observed in eager attention, applies every switch; the same requests and judging as the architectures above. "
    "Decisive: PASS, FAIL or XFAIL, not N/A."
)


def _table(names: list[str], entries: dict[str, zoo.Arch], by: dict, engines, first: str) -> list[str]:
    lines = [f"| {first} | features | " + " | ".join(engines) + " |", "|---|---|" + "---|" * len(engines)]
    for name in names:
        features = ", ".join(entries[name].features)
        lines.append(f"| {name} | {features} | " + " | ".join(_short(by[name, e]) for e in engines) + " |")
    return lines


def render_markdown(cells: list[Cell], engines=LOCAL_ENGINES, dtype: str = "float32", entries=zoo.ARCHS,
                    rejected: list[tuple[str, str]] = ()) -> str:  # fmt: skip
    """The coverage tables: architecture x engine (PASS / N/A reason / XFAIL(finding)), features, versions; then,
    when ``cells`` hold feature combinations (``entries`` with a ``family``), their table, each engine's count of
    decisive cells, and the ``rejected`` candidates with the reason each is no combination."""
    env = report.environment("cpu", dtype, "cbverify.zoo", tier_for(dtype))
    env = {k: v for k, v in env.items() if k not in ("model", "device", "dtype", "tier")}
    by = {(c.arch, c.engine): c for c in cells}
    entries = {a.name: a for a in entries}
    names = list(dict.fromkeys(c.arch for c in cells))
    archs = [n for n in names if not entries[n].family]
    combos = [n for n in names if entries[n].family]
    flags = "--combinations --markdown docs/coverage.md" if combos else "--markdown docs/coverage.md"
    header = HEADER.format(dtype=dtype, flags=flags if dtype == "float32" else f"--dtype {dtype} --markdown FILE")
    lines = ["# Architecture coverage", "", header, "", " · ".join(f"**{k}** {v}" for k, v in env.items()), ""]
    if archs:
        lines += _table(archs, entries, by, engines, "architecture")
    if combos:
        lines += ["", "## Feature combinations", "", COMBINATIONS_HEADER, ""]
        for e in engines:
            kinds = [by[n, e].status.split("(")[0] for n in combos]  # XFAIL(id) -> XFAIL
            counts = ", ".join(f"{k} {kinds.count(k)}" for k in dict.fromkeys(sorted(kinds)))
            decisive = len(kinds) - kinds.count("N/A")
            lines.append(f"- **{e}**: {decisive} of {len(combos)} decisive ({counts})")
        lines += [""] + _table(combos, entries, by, engines, "combination")
    if rejected:
        lines += ["", f"Not combinations ({len(rejected)} candidates: the model does not apply a switch):", ""]
        reasons: dict[str, list[str]] = {}
        for name, reason in rejected:
            reasons.setdefault(f"{name.split('+')[0]}: {reason}", []).append(name)
        lines += [f"- {reason} ({len(ns)}: {', '.join(f'`{n}`' for n in ns)})" for reason, ns in reasons.items()]
    return "\n".join(lines) + "\n"
