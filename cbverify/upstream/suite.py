"""Run every upstream invariant on one scenario (:func:`check_scenario`), and the fixed default suite
(:data:`DEFAULT_SCENARIOS`, :func:`run_suite`) that ``cbverify upstream --run`` and ``cbverify matrix`` execute.

Each result is judged against the findings registry (:func:`judge`): PASS and NOT-APPLICABLE are fine, a FAIL is
fine only when a registered finding covers it ("xfail"), and a covered check that no longer fails is reported as
"FIXED?" so the registry entry gets revisited.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from cbverify.upstream import checks, numerics, sampler_checks
from cbverify.upstream.capture import Capture
from cbverify.upstream.findings import FAIL, NA, PASS, CheckResult, by_id, expected_status, explaining
from cbverify.upstream.run import not_applicable, run_scenario
from cbverify.upstream.scenario import TrainerScenario
from reference.loss import IS_MODES

CHECKS = (
    "run_completes", "no_silent_request_failure", "completions_aligned", "generation_keeps_attn_and_config",
    "generation_keeps_params", "generation_keeps_mode", "generation_keeps_rng", "generation_keeps_forward",
    "sampler_logprobs_reach_trainer", "is_correction_applied", "mixed_precision_completes",
    "trainer_precision_follows_its_config",
    "trainer_logprobs_match_reference", "advantages_match_reference", "zero_variance_groups_get_zero_advantage",
    "loss_matches_reference",
    "sampled_tokens_within_processed_support", "sampler_logprob_semantics", "is_weights_match_reference",
)  # fmt: skip


# The checks whose mechanism only some generation paths have, with the scenario that reaches it on each and how many
# of those paths must run: sampler log-probs come from continuous batching asked for them, a rollout_func or vLLM;
# greedy agreement compares two paths. Every other check judges on every path.
_REACHES = {
    "generate": TrainerScenario(path="generate"),
    "cb": TrainerScenario(path="cb", cb_return_logprobs=True),
    "rollout_func": TrainerScenario(path="rollout_func", rollout_backend="reference"),
    "vllm": TrainerScenario(path="vllm"),
}
PATHS_NEEDED: dict[str, tuple[tuple[str, ...], int]] = {
    "sampler_logprobs_reach_trainer": (("cb", "rollout_func", "vllm"), 1),
    "sampler_logprob_semantics": (("cb", "rollout_func", "vllm"), 1),
    "greedy_paths_agree": (("generate", "cb", "rollout_func", "vllm"), 2),
}


def release_lacks(check: str) -> str | None:
    """Why the installed release cannot reach ``check`` at all (fewer of the paths that have its mechanism run here
    than it needs), naming what each missing path lacks; ``None`` where it can. A check that judged no scenario on a
    release that lacks its mechanism is N/A for that release, by name; anywhere else it is VACUOUS, a failure."""
    if check not in PATHS_NEEDED:
        return None
    paths, needed = PATHS_NEEDED[check]
    missing = {path: why for path in paths if (why := not_applicable(_REACHES[path]))}
    if len(paths) - len(missing) >= needed:
        return None
    return f"needs {needed} of {', '.join(paths)}; " + "; ".join(f"{path}: {why}" for path, why in missing.items())


def check_scenario(scenario: TrainerScenario, model, tokenizer) -> list[CheckResult]:
    """All checks of :data:`CHECKS` on one scenario (NOT-APPLICABLE for all when the stack cannot run it)."""
    reason = not_applicable(scenario)
    if reason:
        return [CheckResult(name, scenario.path, NA, reason, scenario.describe()) for name in CHECKS]
    return check_capture(scenario, run_scenario(scenario, model, tokenizer), model)


def check_capture(scenario: TrainerScenario, capture: Capture, model) -> list[CheckResult]:
    """All checks of :data:`CHECKS` on what one trainer run (or one rank of it) captured; ``model`` is the caller's
    untouched model (the weights of the first generation)."""
    info = capture.trainer_info
    results = [
        *checks.run_completes(scenario, capture),
        *checks.no_silent_request_failure(scenario, capture),
        *checks.completions_aligned(scenario, capture, info.get("eos_ids", ())),
        *checks.generation_leaves_no_trace(scenario, capture),
        *checks.sampler_logprobs_reach_trainer(scenario, capture),
        *checks.is_correction_applied(scenario, capture),
        *checks.mixed_precision_completes(scenario, capture),
        *checks.trainer_precision_follows_its_config(scenario, capture),
    ]
    # a run that crashed is judged on what it reached: advantages come from scoring, before any loss
    ran = capture.run_error is None
    reached_scoring, reached_loss = ran or bool(capture.scored), ran or bool(capture.losses)
    advantage_checks = ("advantages_match_reference", "zero_variance_groups_get_zero_advantage")
    results += [
        *(numerics.trainer_logprobs_match_reference(scenario, capture) if reached_loss
          else _not_reached(scenario, "trainer_logprobs_match_reference")),
        *(numerics.advantages_match_reference(scenario, capture, info.get("scale_rewards", "group")) if reached_scoring
          else _not_reached(scenario, *advantage_checks)),
        *(numerics.loss_matches_reference(scenario, capture, info) if reached_loss
          else _not_reached(scenario, "loss_matches_reference")),
    ]  # fmt: skip
    sampler = capture.sampler_model if capture.sampler_model is not None else model  # the weights it sampled with
    results += sampler_checks.sampled_tokens_within_processed_support(scenario, capture, sampler)
    results += sampler_checks.sampler_logprob_semantics(scenario, capture, sampler)
    results += (sampler_checks.is_weights_match_reference(scenario, capture, model, info) if reached_scoring
                else _not_reached(scenario, "is_weights_match_reference"))  # fmt: skip
    if capture.rollout_backend:
        results = [replace(r, reason=f"[{capture.rollout_backend}] {r.reason}") for r in results]
    return results


def _not_reached(scenario: TrainerScenario, *names: str) -> list[CheckResult]:
    reason = "the run crashed before reaching this (see run_completes)"
    return [CheckResult(name, scenario.path, NA, reason, scenario.describe()) for name in names]


def judge(result: CheckResult, scenario: TrainerScenario, model_type: str) -> tuple[bool, str]:
    """``(ok, label)``: label is PASS / NOT-APPLICABLE / XFAIL(<finding>) / FAIL / FIXED?(<finding>). A FAIL is
    XFAIL only when a covering finding predicts it (:class:`~cbverify.upstream.predictions.Prediction`); a FAIL that a
    finding covers but does not predict is ``FAIL(not <finding>: <how it differs>)``, a failure of the run.

    ``model_type`` is the model's ``config.model_type`` (some findings affect one architecture only)."""
    finding = expected_status(result, scenario, model_type)
    if result.status == FAIL:
        explained, why = explaining(result, scenario, model_type)
        if explained:
            return True, f"XFAIL({explained})"
        return False, f"FAIL({why})" if why else "FAIL"
    if finding and result.status != NA and not by_id(finding).data_dependent:
        return False, f"FIXED?({finding})"
    return True, result.status


_BASE = dict(num_generations=2, num_prompts=2, max_completion_length=6, max_steps=1)
DEFAULT_SCENARIOS: tuple[TrainerScenario, ...] = tuple(
    TrainerScenario(**{**_BASE, **kw})
    for kw in (
        dict(path="generate", top_k=3, is_correction=True),
        dict(path="cb", top_k=3, is_correction=True, cb_return_logprobs=True),
        dict(path="rollout_func", top_k=3, is_correction=True, rollout_backend="reference"),
        dict(path="rollout_func", top_k=3, is_correction=True, rollout_backend="cb_impl"),
        dict(path="rollout_func", bf16=True, greedy=True, rollout_backend="cb_impl"),
        dict(path="generate", greedy=True, loss_type="grpo", gradient_accumulation_steps=2),
        dict(path="generate", num_generations=3, reward="constant"),
        dict(path="generate", num_generations=3, reward="unscorable"),
        dict(path="cb", greedy=True, loss_type="grpo", gradient_accumulation_steps=2),
        dict(path="cb", greedy=True, repetition_penalty=1.5),
        dict(path="generate", greedy=True, repetition_penalty=1.5),
        dict(path="generate", bf16=True, loss_type="bnpo"),
        dict(path="generate", loss_type="luspo", max_completion_length=32),  # rows of unequal length (padding)
        dict(path="cb", bf16=True),
        dict(path="cb", evaluate=True),
        dict(path="generate", evaluate=True, loss_type="bnpo"),  # a loss normalised per token of the batch
        dict(path="cb", trainer="rloo", top_p=0.8),
        dict(path="generate", trainer="rloo", top_p=0.8),
        dict(path="generate", greedy=True, after_bf16_trainer=True),
    )
)
# TRL's colocated vLLM path (run in the vllm environment: `cbverify upstream --run --path vllm`): one scenario per
# importance-sampling mode with vLLM held to the policy's float32 and a sampler off-policy enough that the bounds bite
# (about 1 token in 9 and half the sequences cut), then vLLM as TRL builds it (dtype "auto")
_VLLM = dict(_BASE, path="vllm", top_k=3, is_correction=True, sampler_noise=0.03, is_clip_min=0.5, is_clip_max=2.0,
             num_prompts=4, max_completion_length=8)  # fmt: skip
VLLM_SCENARIOS: tuple[TrainerScenario, ...] = (
    *(TrainerScenario(**{**_VLLM, "is_mode": mode, "sampler_dtype": "float32"}) for mode in IS_MODES),
    TrainerScenario(**_VLLM),
)
GREEDY_AGREEMENT = TrainerScenario(**{**_BASE, "greedy": True, "rollout_backend": "reference"})


def greedy_paths_agree(captures: dict[str, Capture], scenario_text: str) -> CheckResult:
    """Same seed, greedy decoding: every path's first-generation completions are identical."""
    firsts = {p: c.generations[0].completion_ids for p, c in captures.items() if c.generations}
    if len(firsts) < 2:
        return CheckResult("greedy_paths_agree", "*", NA, f"only {sorted(firsts)} produced completions", scenario_text)
    base_path, base = next(iter(firsts.items()))
    for path, comps in firsts.items():
        if comps != base:
            rows = [i for i, (a, b) in enumerate(zip(base, comps or [], strict=False)) if a != b]
            return CheckResult(
                "greedy_paths_agree", "*", FAIL, f"{path} differs from {base_path} on rows {rows[:4]}", scenario_text
            )
    return CheckResult("greedy_paths_agree", "*", PASS, f"{' = '.join(firsts)} on {len(base)} rows", scenario_text)


def greedy_agreement(model, tokenizer, base: TrainerScenario = GREEDY_AGREEMENT) -> CheckResult:
    """``base`` (greedy) on every path that runs here, same seed; the completions must be identical."""
    if not base.greedy:
        raise ValueError("greedy_agreement needs a greedy scenario")
    captures = {}
    variants = [("generate", "generate", "cb_impl"), ("cb", "cb", "cb_impl"),  # backend unused off rollout_func
                ("rollout_func[reference]", "rollout_func", "reference"),
                ("rollout_func[cb_impl]", "rollout_func", "cb_impl"), ("vllm", "vllm", "cb_impl")]  # fmt: skip
    for label, path, backend in variants:  # vLLM (where installed) at the policy's own weights and dtype
        dtype = "float32" if path == "vllm" else None
        scenario = replace(base, path=path, rollout_backend=backend, sampler_dtype=dtype)
        if not_applicable(scenario) is None:
            captures[label] = run_scenario(scenario, model, tokenizer)
    return greedy_paths_agree(captures, base.describe())


def run_suite(model, tokenizer, scenarios: Iterable[TrainerScenario] = DEFAULT_SCENARIOS, progress: bool = True):
    """``([(scenario or None, result)], {scenario label: what it exercised})`` for every default scenario and check,
    plus the greedy agreement (:func:`cbverify.upstream.checks.exercised` counts what each run gave the checks)."""
    from tqdm import tqdm

    scenarios = list(scenarios)
    out: list[tuple[TrainerScenario | None, CheckResult]] = []
    facts: dict[str, dict] = {}
    for scenario in tqdm(scenarios, desc="upstream scenarios", disable=not progress, unit="run"):
        if reason := not_applicable(scenario):
            out += [(scenario, CheckResult(n, scenario.path, NA, reason, scenario.describe())) for n in CHECKS]
            facts[scenario.describe()] = {"not run": reason}
            continue
        capture = run_scenario(scenario, model, tokenizer)
        out += [(scenario, r) for r in check_capture(scenario, capture, model)]
        facts[scenario.describe()] = checks.exercised(scenario, capture)
    out.append((None, greedy_agreement(model, tokenizer)))
    return out, facts
