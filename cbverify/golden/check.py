"""Check golden records: the reference and every applicable engine against what was recorded.

Contract: :func:`check_case` returns a :class:`CaseResult` whose ``failures`` is empty exactly when

1. teacher-forcing the *golden* tokens through ``reference.logprobs`` reproduces the recorded full-support and
   processed log-probs and the top-5 log-probs within ``cbverify.tolerances.GOLDEN_LOGPROBS[dtype]``
   (max |Δ| and |mean Δ|);
2. re-generating with the reference (and with each engine that applies) reproduces the golden tokens under the
   tier's token rule (``cbverify.compare.compare_tokens``), and the returned sampling log-probs match
   the recorded ones on the common prefix within the tolerance for that engine;
3. a recorded GRPO trajectory is reproduced within ``cbverify.tolerances.GOLDEN_TRAJECTORY``.

The golden tokens are teacher-forced once per check (:func:`teacher_force_golden`: one forward per golden rollout,
the oracle's unpadded ``reference.logprobs.completion_logits``); rules 1 and 2 read every quantity off that, for
the reference and for every engine.

Engines without ``capabilities.spec_sampling`` (their own RNG: ``hf-generate``, ``transformers-cb``) are checked on
greedy cases only; an engine that raises ``NotApplicable`` or whose adapter is missing is noted, not failed. A failure
names the case, the engine, the quantity, the first divergent (request, position) and the environment diff since
recording.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cbverify.compare import check_results, compare_tokens
from cbverify.devices import oracle_attention
from cbverify.divergence import cut_allowance
from cbverify.engines import ENGINE_NAMES, NotApplicable, get_engine
from cbverify.golden import env as golden_env
from cbverify.golden.cases import RECORDS_DIR, GoldenCase, record_path
from cbverify.golden.record import FORMAT_VERSION, TOP_K
from cbverify.tolerances import GOLDEN_LOGPROBS, GOLDEN_TRAJECTORY, Tolerance, tier_for
from reference import logprobs as ref_logprobs
from reference.models import load
from reference.spec import Rollout


@dataclass(frozen=True, slots=True)
class Failure:
    case: str
    engine: str
    quantity: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.case}] engine={self.engine} {self.quantity}: {self.detail}"


@dataclass(slots=True)
class CaseResult:
    case: str
    failures: list[Failure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    env_diff: str = ""

    @property
    def ok(self) -> bool:
        return not self.failures

    def report(self) -> str:
        head = f"{'PASS' if self.ok else 'FAIL'} {self.case}"
        lines = [head, *(f"  {f}" for f in self.failures), *(f"  note: {n}" for n in self.notes)]
        if not self.ok:
            lines.append(self.env_diff)
        return "\n".join(lines)


def load_record(case: GoldenCase, device_class: str, root: Path = RECORDS_DIR) -> dict:
    path = record_path(case, device_class, root)
    if not path.exists():
        raise FileNotFoundError(f"no golden record for {case.name} on {device_class} at {path}; "
                                f"record it with `cbverify golden record --case {case.name}`")  # fmt: skip
    data = json.loads(path.read_text())
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {data.get('format_version')} != {FORMAT_VERSION}; re-record")
    if data["case"] != case.describe():
        raise ValueError(f"{path}: the case definition changed since recording (stored {data['case']}, now "
                         f"{case.describe()}); re-record with --force")  # fmt: skip
    return data


def compare_series(
    golden: list[list[float]],
    actual: list[list[float]],
    tolerance: Tolerance,
    ids: list[str],
    cut: list[list[float]] | None = None,
) -> str | None:
    """``None`` when every |Δ| is within ``tolerance.bound(golden value)`` and |mean Δ| within ``mean_drift``;
    otherwise the reason, naming the first (request, position) out of bounds (or the worst one when only the drift
    fails).

    ``cut`` (same shape, processed series only): per position, how far a change of the processed support within the
    dtype's noise can move the value (``cbverify.divergence.cut_allowance``). A |Δ| above the bound but within the
    bound plus that allowance is explained by another kept set: it is left out of both bounds and counted."""
    cut = cut if cut is not None else [[0.0] * len(g) for g in golden]
    deltas = [(rid, i, a - g, tolerance.bound(g), allow)
              for rid, gs, acts, allows in zip(ids, golden, actual, cut, strict=True)
              for i, (g, a, allow) in enumerate(zip(gs, acts, allows, strict=True))]  # fmt: skip
    at_cut = [d for d in deltas if d[3] < abs(d[2]) <= d[3] + d[4]]
    deltas = [d[:4] for d in deltas if not d[3] < abs(d[2]) <= d[3] + d[4]]
    if not deltas:
        return None
    worst = max(deltas, key=lambda d: abs(d[2]) - d[3])
    mean = sum(d[2] for d in deltas) / len(deltas)
    if abs(worst[2]) <= worst[3] and abs(mean) <= tolerance.mean_drift:
        return None
    first = next((d for d in deltas if abs(d[2]) > d[3]), worst)
    return (f"|Δ|={abs(worst[2]):.3e} where the bound is {worst[3]:.1e} (max_abs {tolerance.max_abs:.1e} + rel "
            f"{tolerance.rel:.1e} x |value|), mean Δ={mean:+.3e} (tol {tolerance.mean_drift:.1e}) over {len(deltas)} "
            f"positions ({len(at_cut)} more explained by a processor cut); first out of bounds: request {first[0]} "
            f"position {first[1]} (Δ={first[2]:+.3e})")  # fmt: skip


@dataclass(frozen=True, slots=True)
class GoldenForced:
    """The golden tokens teacher-forced once: ``values`` holds, per golden rollout, what ``cbverify.golden.record.
    teacher_forced`` records (keys ``per_token_logps``, ``processed_per_token_logps``, ``top5_ids``,
    ``top5_logprobs``), ``cuts`` the :func:`cbverify.divergence.cut_allowance` at each position (0 in float32 and on
    greedy cases), ``forwards`` the model forwards it took (one per golden rollout with a completion)."""

    values: dict[str, list]
    cuts: list[list[float]]
    forwards: int


def teacher_force_golden(model, case: GoldenCase, data: dict) -> GoldenForced:
    """:class:`GoldenForced` for the record ``data`` of ``case``: one forward per golden rollout (on its recorded
    prompt), every quantity read off its logits with the recorder's own functions (``reference.logprobs``)."""
    tier = tier_for(case.dtype)
    sampling = case.sampling_params
    requests = {r.request_id: r for r in case.requests()}
    keys = ("per_token_logps", "processed_per_token_logps", "top5_ids", "top5_logprobs")
    values: dict[str, list] = {key: [] for key in keys}
    cuts, forwards = [], 0
    floats = lambda t: [float(x) for x in t.detach().to(torch.float32).cpu().tolist()]  # noqa: E731  (as recorded)
    for stored, g in zip(data["config"]["requests"], data["rollouts"], strict=True):
        prompt, completion = tuple(stored["prompt_ids"]), tuple(g["completion_ids"])
        request = requests[g["request_id"]]
        if request.prompt_ids != prompt:
            raise ValueError(f"the record's prompt of {g['request_id']} is not the case's; re-record with --force")
        forwards += bool(completion)
        with oracle_attention():  # no per-shape cuDNN plans (cbverify.devices)
            logits = ref_logprobs.completion_logits(model, prompt, completion)  # (L, V)
        top_values, top_ids = ref_logprobs.top_logprobs_of(logits, TOP_K)  # (L, 5), (L, 5)
        values["per_token_logps"].append(floats(ref_logprobs.logps_of(logits, completion, case.trainer_temperature)))
        values["processed_per_token_logps"].append(floats(ref_logprobs.processed_logps_of(logits, completion,
                                                                                           sampling)))  # fmt: skip
        values["top5_ids"].append([[int(i) for i in row] for row in top_ids.tolist()])
        values["top5_logprobs"].append([floats(row) for row in top_values])
        cuts.append(_cut_row(logits, request, tier))
    return GoldenForced(values, cuts, forwards)


def _cut_row(logits: torch.Tensor, request, tier) -> list[float]:
    """:func:`cbverify.divergence.cut_allowance` at each of a rollout's positions (its (L, V) teacher-forced logits)
    under ``tier``: 0 everywhere in float32 and on greedy requests."""
    if tier.ulp == 0 or request.sampling.greedy:
        return [0.0] * len(logits)
    return [cut_allowance(row, request.sampling, tier.near_tie_gap / 2 * tier.unit(float(row.abs().max())))
            for row in logits.cpu()]  # fmt: skip


def cut_allowances(model, case: GoldenCase, golden: list[dict], lengths: list[int] | None = None) -> list[list[float]]:
    """Per golden rollout (its first ``lengths[k]`` tokens), :func:`cbverify.divergence.cut_allowance` at each
    position under the case's tier (0 everywhere in float32 and on greedy cases); one forward per rollout (the
    checks read them off :func:`teacher_force_golden` instead)."""
    tier = tier_for(case.dtype)
    requests = {r.request_id: r for r in case.requests()}
    lengths = lengths if lengths is not None else [len(g["completion_ids"]) for g in golden]
    out = []
    for g, n in zip(golden, lengths, strict=True):
        request = requests[g["request_id"]]
        if tier.ulp == 0 or request.sampling.greedy:
            out.append([0.0] * n)
            continue
        with oracle_attention():
            logits = ref_logprobs.completion_logits(model, request.prompt_ids, g["completion_ids"][:n])  # (n, V)
        out.append(_cut_row(logits, request, tier))
    return out


def check_teacher_forced(model, case: GoldenCase, data: dict, forced: GoldenForced | None = None) -> list[Failure]:
    """Rule 1: the reference, teacher-forced on the golden tokens (``forced``: :func:`teacher_force_golden`,
    computed here when not given)."""
    forced = forced if forced is not None else teacher_force_golden(model, case, data)
    golden = data["rollouts"]
    values = forced.values
    ids = [r["request_id"] for r in golden]
    failures = []
    cuts = {"per_token_logps": None, "processed_per_token_logps": forced.cuts}
    for key, cut in cuts.items():
        why = compare_series([r[key] for r in golden], values[key], GOLDEN_LOGPROBS[case.dtype], ids, cut)
        if why:
            failures.append(Failure(case.name, "reference", f"teacher-forced {key}", why))
    flat = lambda rows: [[v for pos in req for v in pos] for req in rows]  # noqa: E731
    why = compare_series(flat([r["top5_logprobs"] for r in golden]), flat(values["top5_logprobs"]),
                         GOLDEN_LOGPROBS[case.dtype], [f"{i}(flattened top-5)" for i in ids])  # fmt: skip
    if why:
        failures.append(Failure(case.name, "reference", "teacher-forced top-5 log-probs", why))
    return failures


def check_rollouts(
    model,
    case: GoldenCase,
    data: dict,
    engine: str,
    rollouts: list[Rollout],
    *,
    logprobs: str = "processed",
    forced: GoldenForced | None = None,
) -> tuple[list[Failure], list[str]]:
    """Rule 2 for one engine's rollouts of the golden requests: ``(failures, notes on accepted divergences)``.

    ``logprobs`` is the engine's ``logprob_semantics``: ``processed`` log-probs are compared with the golden sampling
    log-probs, ``raw`` ones only on greedy cases (where raw and processed coincide), ``none`` not at all. The cut
    allowances are read off ``forced`` (:func:`teacher_force_golden`; rows of the whole golden rollout, the same
    logits as its prefix's under a causal model), computed per rollout when not given.
    """
    golden = data["rollouts"]
    requests = {r.request_id: r for r in case.requests()}
    failures, notes, common_golden, common_actual, ids = [], [], [], [], []
    problems = check_results(list(requests.values()), rollouts)
    if problems:
        return [Failure(case.name, engine, "completeness/order", "; ".join(problems))], notes
    tier = tier_for(case.dtype)
    for g, r in zip(golden, rollouts, strict=True):
        request = requests[r.request_id]
        recorded = Rollout(r.request_id, request.prompt_ids, g["completion_ids"], g["sampling_logprobs"],
                           g["finish_reason"])  # fmt: skip
        div = compare_tokens(model, request, recorded, r, engine=engine, tier=tier, repro=f"cbverify golden check "
                             f"--case {case.name} --engine {engine}")  # fmt: skip
        pos = None if div is None else div.position
        if div is not None and div.accepted:
            notes.append(f"accepted divergence against the golden (golden = 'reference' below):\n{div.describe()}")
        elif div is not None:
            failures.append(Failure(case.name, engine, "tokens", f"first divergent position {pos} against the golden "
                                    f"(golden = 'reference' below):\n{div.describe()}"))  # fmt: skip
        n = len(g["completion_ids"]) if pos is None else pos
        common_golden.append(g["sampling_logprobs"][:n])
        common_actual.append(list(r.logprobs[:n]))
        ids.append(r.request_id)
    if logprobs == "none" or (logprobs == "raw" and not case.sampling_params.greedy):
        notes.append(f"{engine}: log-probs not compared (engine returns {logprobs!r} log-probs on a sampled case)")
        return failures, notes
    lengths = [len(c) for c in common_golden]
    if forced is not None:
        cut = [row[:n] for row, n in zip(forced.cuts, lengths, strict=True)]
    else:
        cut = cut_allowances(model, case, golden, lengths)
    why = compare_series(common_golden, common_actual, GOLDEN_LOGPROBS[case.dtype], ids, cut)
    if why:
        failures.append(Failure(case.name, engine, "sampling log-probs (common prefix)", why))
    return failures, notes


def available_engines() -> list[str]:
    """Every engine the harness registers (``cbverify.engines.ENGINE_NAMES``), ``reference`` first."""
    return list(ENGINE_NAMES)


def check_case(
    case: GoldenCase,
    device: str = "cpu",
    *,
    engines: list[str] | None = None,
    model=None,
    root: Path = RECORDS_DIR,
    trajectory: bool = True,
) -> CaseResult:
    """Check one case (see the module contract). ``model`` overrides loading the bundled one (tests perturb it)."""
    data = load_record(case, golden_env.device_class(device), root)
    result = CaseResult(case.name, env_diff=golden_env.format_diff(data["env"], golden_env.capture(device)))
    if model is None:
        model, _ = load(case.model, dtype=case.dtype, device=device)
    with torch.no_grad():
        forced = teacher_force_golden(model, case, data)
        result.failures += check_teacher_forced(model, case, data, forced)
    for name in engines if engines is not None else available_engines():
        try:  # an adapter that cannot be built is an error; one that does not apply here (no vllm venv) a note
            engine = get_engine(name, model)
        except NotApplicable as err:
            result.notes.append(str(err))
            continue
        caps = engine.capabilities
        if not (caps.spec_sampling or case.sampling_params.greedy):
            result.notes.append(f"{name}: not checked on a sampled case (own RNG; see the distribution tests)")
            continue
        try:
            rollouts = engine.generate(case.requests())
        except NotApplicable as err:
            result.notes.append(str(err))
            continue
        failures, notes = check_rollouts(model, case, data, name, rollouts, logprobs=caps.logprob_semantics,
                                         forced=forced)  # fmt: skip
        result.failures += failures
        result.notes += notes
    if trajectory and data.get("trajectory"):
        from cbverify.golden.record import run_trajectory

        stored = data["trajectory"]
        rerun = run_trajectory(case, device, model=model, config=stored["config"])
        for why in compare_trajectory(stored, rerun):
            result.failures.append(Failure(case.name, "reference.train", "GRPO trajectory", why))
    return result


def compare_trajectory(golden: dict, actual: dict) -> list[str]:
    """Reasons the re-run trajectory differs from the golden one (empty when within ``TRAJECTORY``)."""
    g_steps, a_steps = golden["steps"], actual["steps"]
    if len(g_steps) != len(a_steps):
        return [f"trajectory length {len(a_steps)} != golden {len(g_steps)}"]
    reasons = []
    for metric, t in GOLDEN_TRAJECTORY.items():
        deltas = [a[metric] - g[metric] for g, a in zip(g_steps, a_steps, strict=True)]
        worst = max(range(len(deltas)), key=lambda i: abs(deltas[i]))
        mean = sum(deltas) / len(deltas)
        if abs(deltas[worst]) > t.max_abs or abs(mean) > t.mean_drift:
            first = next(i for i, d in enumerate(deltas) if abs(d) > t.max_abs) if abs(deltas[worst]) > t.max_abs \
                else worst  # fmt: skip
            reasons.append(f"{metric}: max |Δ|={abs(deltas[worst]):.3e} (tol {t.max_abs:.1e}), mean Δ={mean:+.3e} "
                           f"(tol {t.mean_drift:.1e}); first divergent step {g_steps[first]['step']} "
                           f"(golden {g_steps[first][metric]!r}, now {a_steps[first][metric]!r})")  # fmt: skip
    return reasons
