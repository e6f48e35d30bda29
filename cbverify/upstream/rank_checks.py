"""The checks of a multi-process run (:mod:`cbverify.upstream.distributed` launches it and gathers the ranks' records).

:func:`check_ranks` runs every single-process check on each rank's capture (a rank's rewards are the gathered ones,
its advantages its slice of them) and the checks that only exist across ranks (:data:`RANK_CHECKS`):

- ``ranks_really_distributed``: every rank saw N processes under a distributed type (``accelerate launch --cpu
  --num_processes 2`` without a multi-process config runs N copies of a single-process job: each says NO / 1);
- ``ranks_cover_the_global_batch``: per generation, the ranks' prompts together hold each prompt of the global batch
  exactly ``num_generations`` times, ranks hold equal shares, and every rank saw the same gathered rewards;
- ``ranks_weights_identical``: after every optimizer step the parameters are bit-identical on every rank;
- ``ranks_sample_distinct_streams``: sampled scenarios only; two rows of one prompt on two ranks must not draw the
  same completion because the ranks share a stream (two ranks' torch RNG states at a generation, and same-prompt
  rows at the same local position identical on every such pair where chance makes that unlikely enough: its
  false-alarm probability is computed from the model, NOT-APPLICABLE above ``STREAM_ALPHA``);
- ``ranks_match_one_process``: the N-process step against one process training the same global batch (``nproc``
  times the prompts per device): the same gathered rewards and, where the completions are the same, the gradient of
  each optimizer step within the float32 trainer tier (``TRAINER_FP32_PARAM_GRAD``) of the gradient's size;
- ``ranks_log_what_one_process_logs``: there too, every number logged per step equals the single process's.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import TYPE_CHECKING

import torch

from cbverify.tolerances import STREAM_ALPHA, TRAINER_FP32_PARAM_GRAD, TRAINER_METRIC
from cbverify.upstream import checks
from cbverify.upstream.capture import Capture
from cbverify.upstream.findings import FAIL, NA, PASS, CheckResult
from cbverify.upstream.findings import scenario_result as _result
from cbverify.upstream.scenario import TrainerScenario
from reference.spec import SamplingParams

if TYPE_CHECKING:
    from cbverify.upstream.distributed import Launch

RANK_CHECKS = (
    "ranks_really_distributed", "ranks_cover_the_global_batch", "ranks_weights_identical",
    "ranks_sample_distinct_streams", "ranks_match_one_process", "ranks_log_what_one_process_logs",
)  # fmt: skip
NOT_COMPARED = ("time", "runtime", "per_second", "epoch")  # logged keys that measure the machine, not the step


def check_ranks(scenario: TrainerScenario, run: Launch, model, one: Launch | None = None) -> list[CheckResult]:
    """Every single-process check on each rank (a FAIL on any rank is the check's FAIL, naming the rank) and
    :data:`RANK_CHECKS` (``one``: the same global batch on one process, for ``ranks_match_one_process``)."""
    from cbverify.upstream.suite import CHECKS, check_capture

    if (why := run.error()) is not None:  # what the ranks that wrote a record say about the launch, if any did
        seen = [really_distributed(scenario, [record["capture"] for record in run.ranks])] if run.ranks else []
        failed = [_result(c, scenario, FAIL, why) for c in ("run_completes", *RANK_CHECKS) if c not in
                  [r.check for r in seen]]  # fmt: skip
        return seen + failed + [_result(c, scenario, NA, "the launch failed") for c in CHECKS if c != "run_completes"]
    per_check: dict[str, list[tuple[int, CheckResult]]] = {}
    for rank, record in enumerate(run.ranks):
        capture = record["capture"]
        if record["run_error"] is not None:
            capture.run_error = RuntimeError(record["run_error"])
        for r in check_capture(scenario, capture, model):
            per_check.setdefault(r.check, []).append((rank, r))
    out = []
    for check, results in per_check.items():
        failing = [(rank, r) for rank, r in results if r.status == FAIL]
        if failing:
            rank, r = failing[0]
            out.append(_result(check, scenario, FAIL, f"rank {rank}: {r.reason}"))
        elif all(r.status == NA for _, r in results):
            out.append(_result(check, scenario, NA, results[0][1].reason))
        else:
            out.append(_result(check, scenario, PASS, f"every rank: {results[0][1].reason}"))
    captures = [record["capture"] for record in run.ranks]
    out += [
        really_distributed(scenario, captures),
        cover_the_global_batch(scenario, captures),
        weights_identical(scenario, run),
        distinct_streams(scenario, run, model),
        *match_one_process(scenario, run, one),
    ]
    return out


def exercised(scenario: TrainerScenario, run: Launch) -> dict:
    """What the ranks gave the checks (:func:`cbverify.upstream.checks.exercised` summed over ranks) and the
    completion tokens each rank trained on (rows masked for truncation left out): unequal counts are what tell a
    global token normaliser from a per-rank one."""
    per_rank = [checks.exercised(scenario, record["capture"]) for record in run.ranks]
    total = {k: sum(e[k] for e in per_rank) for k in per_rank[0]} if per_rank else {}
    # the rewards are gathered: every rank sees every group, so count the groups once
    for key in ("groups_with_spread", "equal_reward_groups"):
        total[key] = per_rank[0][key] if per_rank else 0
    eos = run.ranks[0]["capture"].trainer_info.get("eos_ids", ()) if run.ranks else ()
    trained = [sum(len(c) for g in record["capture"].generations for c in g.completion_ids or []
                   if not checks.masked_as_truncated(scenario, c, eos)) for record in run.ranks]  # fmt: skip
    return {**total, "trained_tokens_per_rank": trained}


def really_distributed(scenario: TrainerScenario, captures: list[Capture]) -> CheckResult:
    nproc = scenario.nproc
    seen = [(c.trainer_info.get("num_processes"), c.trainer_info.get("distributed_type")) for c in captures]
    bad = [
        f"rank {i}: {n} process(es), {kind}" for i, (n, kind) in enumerate(seen) if n != nproc or kind.endswith("NO")
    ]
    if bad:
        return _result("ranks_really_distributed", scenario, FAIL, f"{nproc} launched, but {'; '.join(bad)}")
    return _result("ranks_really_distributed", scenario, PASS, f"{nproc} ranks, each saw {seen[0][0]} under "
                   f"{seen[0][1]}")  # fmt: skip


def cover_the_global_batch(scenario: TrainerScenario, captures: list[Capture]) -> CheckResult:
    nproc = scenario.nproc
    check, n = "ranks_cover_the_global_batch", scenario.num_generations
    counts = {len(c.generations) for c in captures}
    if len(counts) != 1:
        return _result(check, scenario, FAIL, f"ranks generated different numbers of batches: {sorted(counts)}")
    for k in range(counts.pop()):
        shares = [c.generations[k].prompts for c in captures]
        if len({len(s) for s in shares}) != 1:
            return _result(check, scenario, FAIL, f"generation {k}: unequal shares {[len(s) for s in shares]}")
        tally = Counter(json.dumps(p, sort_keys=True, default=str) for share in shares for p in share)
        off = {p: c for p, c in tally.items() if c != n}
        if off:
            p, c = next(iter(off.items()))
            return _result(check, scenario, FAIL, f"generation {k}: prompt {p[:60]} generated {c} times across ranks "
                           f"(num_generations={n}); {len(off)} prompt(s) off")  # fmt: skip
        completions = [c.generations[k].completion_ids for c in captures]
        if any(cs is None or len(cs) != len(s) for cs, s in zip(completions, shares, strict=True)):
            return _result(check, scenario, FAIL, f"generation {k}: a rank's completions do not pair with its "
                           "prompts (counts differ)")  # fmt: skip
    rewards = [c.rewards for c in captures]
    for k in range(min(len(r) for r in rewards)):
        if any(not torch.equal(rewards[0][k].nan_to_num(), r[k].nan_to_num()) for r in rewards[1:]):
            return _result(check, scenario, FAIL, f"scored batch {k}: the ranks' gathered rewards differ")
    total = sum(len(c.generations[0].prompts) for c in captures) if captures[0].generations else 0
    return _result(check, scenario, PASS, f"{len(captures[0].generations)} generation(s): {total} rows over {nproc} "
                   f"ranks, every prompt {n} times, gathered rewards identical")  # fmt: skip


def weights_identical(scenario: TrainerScenario, run: Launch) -> CheckResult:
    check = "ranks_weights_identical"
    digests = [record["digests"] for record in run.ranks]
    if not digests[0]:
        return _result(check, scenario, NA, "no optimizer step was taken")
    for k, step in enumerate(zip(*digests, strict=False)):
        if len(set(step)) != 1:
            return _result(check, scenario, FAIL, f"after step {k} the ranks' parameters differ")
    steps = len(digests[0])
    return _result(check, scenario, PASS, f"bit-identical on every rank after each of {steps} step(s)")


def distinct_streams(scenario: TrainerScenario, run: Launch, model) -> CheckResult:
    """Two ranks must not sample from one stream: their torch RNG states at each generation differ (paths that sample
    with it), and same-prompt rows at the same local position on two ranks are not all identical.

    The second part is statistical. Under independent streams, row ``b`` equals row ``a`` with probability ``p(a)``,
    the processed probability of ``a``'s completion (the scenario's temperature and cuts, from ``model``), so all
    pairs agree by chance with probability ``prod p(a)``: the false alarm of calling that a shared stream. Where it
    exceeds :data:`~cbverify.tolerances.STREAM_ALPHA` (a peaked model: groups that sample one completion anyway) the
    check cannot tell and says NOT-APPLICABLE with the number; a shared stream draws the same tokens (power 1)."""
    check = "ranks_sample_distinct_streams"
    if scenario.greedy:
        return _result(check, scenario, NA, "greedy: nothing is drawn")
    states = [record["rng_at_generation"] for record in run.ranks]
    for k, at_k in enumerate(zip(*states, strict=False)):
        uses_global_rng = scenario.path in ("generate", "cb")
        if uses_global_rng and any(torch.equal(at_k[0], s) for s in at_k[1:]):
            return _result(check, scenario, FAIL, f"generation {k}: two ranks start sampling from the same torch RNG "
                           "state")  # fmt: skip
    captures = [record["capture"] for record in run.ranks]
    pairs: list[tuple[list[int], list[int], list[int]]] = []  # (prompt ids, row a, row b)
    for k in range(min(len(c.generations) for c in captures)):
        rows = [(r, i, json.dumps(p, default=str), c.generations[k].prompt_ids[i], c.generations[k].completion_ids[i])
                for r, c in enumerate(captures) for i, p in enumerate(c.generations[k].prompts)]  # fmt: skip
        pairs += [(a[3], a[4], b[4]) for a in rows for b in rows if a[0] < b[0] and a[1] == b[1] and a[2] == b[2]]
    if not pairs:
        return _result(check, scenario, NA, "no same-prompt rows at the same position on two ranks")
    identical = sum(a == b for _, a, b in pairs)
    chance = math.exp(sum(_log_chance(model, scenario, prompt, a) for prompt, a, _ in pairs))
    said = f"{identical}/{len(pairs)} same-prompt row pairs across ranks identical"
    if chance > STREAM_ALPHA:
        return _result(check, scenario, NA, f"{said}; underpowered: independent streams draw all {len(pairs)} pairs "
                       f"alike with probability {chance:.2g} > {STREAM_ALPHA:g} (a peaked model)")  # fmt: skip
    if identical == len(pairs):
        return _result(check, scenario, FAIL, f"all {len(pairs)} same-prompt row pairs at the same position on "
                       f"different ranks drew identical completions (chance under independent streams {chance:.2g}):"
                       " the ranks share a sampling stream")  # fmt: skip
    return _result(check, scenario, PASS, f"{said} (all alike by chance: {chance:.2g})")


def _log_chance(model, scenario: TrainerScenario, prompt: list[int], completion: list[int]) -> float:
    """log P(an independent draw equals ``completion``) under the scenario's sampling, from the model's float32
    logits: per token p_T(token) / p_T(kept set). Equal to the processed probability where the token is kept, and
    still defined where a low-precision sampler kept a token the float32 cut drops."""
    from reference.generate import process_logits
    from reference.logprobs import completion_logits

    sampling = SamplingParams(temperature=scenario.temperature, top_k=scenario.top_k, top_p=scenario.top_p,
                              min_p=scenario.min_p, max_new_tokens=scenario.max_completion_length)  # fmt: skip
    total = 0.0
    for token, row in zip(completion, completion_logits(model, prompt, completion), strict=True):
        full = torch.log_softmax(row.double() / scenario.temperature, -1)
        kept = torch.isfinite(process_logits(row, sampling))
        total += float(full[token] - torch.logsumexp(full[kept], -1))
    return total


def match_one_process(scenario: TrainerScenario, run: Launch, one: Launch | None) -> list[CheckResult]:
    """``ranks_match_one_process`` and ``ranks_log_what_one_process_logs``."""
    names = ("ranks_match_one_process", "ranks_log_what_one_process_logs")
    if one is None:
        return [_result(n, scenario, NA, "no single-process run of the global batch was made") for n in names]
    if (why := one.error()) is not None:
        return [_result(n, scenario, FAIL, f"the single-process run failed: {why}") for n in names]
    single = one.ranks[0]["capture"]
    ranks = [record["capture"] for record in run.ranks]
    if not single.generations or not all(c.generations for c in ranks):
        return [_result(n, scenario, FAIL, "a run generated nothing (see run_completes)") for n in names]
    prompts = [json.dumps(p, default=str) for c in ranks for p in c.generations[0].prompts]
    if prompts != [json.dumps(p, default=str) for p in single.generations[0].prompts]:
        why = "the ranks' prompts, in rank order, are not the single process's global batch"
        return [_result(n, scenario, FAIL, why) for n in names]
    if [row for c in ranks for row in c.generations[0].completion_ids] != single.generations[0].completion_ids:
        why = "the completions differ from the single process's (sampling depends on the process layout)"
        return [_result(n, scenario, NA, why) for n in names]
    return [_same_gradients(scenario, run, one), _same_logs(scenario, run, one)]


def _same_gradients(scenario: TrainerScenario, run: Launch, one: Launch) -> CheckResult:
    check, worst = "ranks_match_one_process", 0.0
    for k, (g_many, g_one) in enumerate(zip(run.ranks[0]["grads"], one.ranks[0]["grads"], strict=False)):
        num = sum(float((g_many[n].double() - g_one[n].double()).norm() ** 2) for n in g_one) ** 0.5
        size = max(sum(float(g.double().norm() ** 2) for g in g_one.values()) ** 0.5, 1e-30)
        worst = max(worst, num / size)
        if num > TRAINER_FP32_PARAM_GRAD * size:
            return _result(check, scenario, FAIL, f"step {k}: the {run.nproc}-process gradient is off the single "
                           f"process's by {num / size:.3g} of its norm")  # fmt: skip
    steps = min(len(run.ranks[0]["grads"]), len(one.ranks[0]["grads"]))
    sizes = [sum(float(g.double().norm() ** 2) for g in grads.values()) ** 0.5 for grads in one.ranks[0]["grads"]]
    if not any(sizes):
        return _result(check, scenario, NA, "every step's gradient is zero: nothing to compare")
    return _result(check, scenario, PASS, f"same completions; {steps} step gradient(s) (norm {max(sizes):.3g}) "
                   f"within {worst:.1e} of the single process's norm")  # fmt: skip


def _same_logs(scenario: TrainerScenario, run: Launch, one: Launch) -> CheckResult:
    """Every number logged per step equals the single process's: a global token- or sample-weighted value, not an
    average of per-process averages (``TRAINER_METRIC``)."""
    check, compared = "ranks_log_what_one_process_logs", 0
    for k, (mine, theirs) in enumerate(zip(run.ranks[0]["logs"], one.ranks[0]["logs"], strict=False)):
        for key, want in theirs.items():
            if any(word in key for word in NOT_COMPARED) or not isinstance(want, int | float):
                continue
            got = mine.get(key)
            if got is None:
                return _result(check, scenario, FAIL, f"log {k}: {key} logged by one process, not by {run.nproc}")
            compared += 1
            if abs(got - want) > TRAINER_METRIC.atol + TRAINER_METRIC.rtol * abs(want):
                seen = [("logged", (got,)), ("single_process", (want,)), *_rank_token_means(run, k, key)]
                return _result(check, scenario, FAIL, f"log {k}: {key} = {got:.6g} on {run.nproc} processes, "
                               f"{want:.6g} on one", seen)  # fmt: skip
    return _result(check, scenario, PASS, f"{compared} logged numbers equal the single process's")


def _rank_token_means(run: Launch, step: int, key: str) -> list[tuple[str, tuple[float, ...]]]:
    """For a logged token mean (``entropy``): each rank's own token mean at ``step`` (its training loss call's
    per-token values over its completion mask) and its token count, for a finding's model of how the ranks' means
    were combined; nothing where the rank's trainer did not give the values or ran more than one call per step."""
    if key != "entropy":
        return []
    means, counts = [], []
    for record in run.ranks:
        calls = [c for c in record["capture"].losses if c.mode == "train"]
        if len(calls) != sum(key in log for log in record["logs"]) or calls[step].entropies is None:
            return []
        mask = calls[step].inputs["completion_mask"].double()
        counts.append(float(mask.sum()))
        means.append(float((calls[step].entropies.double() * mask).sum()) / max(counts[-1], 1.0))
    return [("rank_means", tuple(means)), ("rank_tokens", tuple(counts))]
