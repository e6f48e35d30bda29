"""Registered failures the fuzzer finds on the pinned stack: each a failure class (the checks it fails), the engine,
the condition on the case (``applies``), what it makes each check report (``predicts``), measured evidence, and the
smallest case that shows it (``repro``; the test suite runs it as a strict expected failure, so an upstream fix turns
the suite red until the entry is updated). Conditions read every ``GenerationConfig`` a case passes
(``FuzzCase.generations``): the manager's, or each ``generate_batch`` call's.

A finding excuses a failure only when the failure is *its* failure: :func:`explaining` asks every finding whose
checks, condition and versions cover the failure (:meth:`FuzzFinding.covers`) whether the check's detail is the one
it predicts (:meth:`FuzzFinding.mismatch`); a covered failure no finding predicts is reported as
``FAIL(not <id>: <how it differs>)``. The manager entry's findings are here; ``generate_batch``'s are in
:mod:`cbverify.fuzz.batch_findings`; import both from this module (``FUZZ_FINDINGS``, ``BATCH_FINDINGS``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz.case import FuzzCase, FuzzRequest, Step, pages_needed
from cbverify.upstream.findings import transformers_in
from cbverify.upstream.predictions import Prediction

SEEN = "transformers 5.24.0 (torch 2.13.0, CPU, float32, tiny-llama-arith)"
PROMPT = (1, 6, 5, 16, 7, 5, 3)
ARITH = (1, 19, 17, 10, 5, 13, 12, 10, 13, 11, 22)  # greedy: (10, 5, 13, 12, 10, 16, 4, 10); penalty 1.3: ... 9
_CB = dict(page_size=4, num_blocks=16, max_batch_tokens=16, return_logprobs=True) | (
    {"seed": 0} if compat.has("seed") else {}  # the field exists from 5.9 (cbverify.engines.transformers_compat)
)
# strings no prediction may match: a pattern that does matches (nearly) anything, and would excuse any failure
TOO_BROAD = ("", "\x00", "an unrelated failure: 0")


@dataclass(frozen=True, slots=True)
class FuzzFinding:
    id: str
    engine: str
    checks: tuple[str, ...]
    when: str
    applies: Callable[[FuzzCase], bool]
    evidence: str
    repro: FuzzCase
    # per check in ``checks``, the failure it excuses: a regular expression the check's detail must contain, or a
    # Prediction whose model(case, the pattern's named groups) says how the detail differs (None: it is this one)
    predicts: dict[str, Prediction | str]
    affected: str = SEEN
    transformers: str = ""  # PEP 440 specifier ("" = every version seen)

    def __post_init__(self) -> None:
        predicts = {c: p if isinstance(p, Prediction) else Prediction(p) for c, p in self.predicts.items()}
        if set(predicts) != set(self.checks):
            raise ValueError(f"finding {self.id}: predicts must give one prediction per check {self.checks}, got "
                             f"{sorted(predicts)}")  # fmt: skip
        for check, prediction in predicts.items():
            if any(re.search(prediction.pattern, s) for s in TOO_BROAD):
                raise ValueError(f"finding {self.id}: the {check} prediction /{prediction.pattern}/ matches anything")
        object.__setattr__(self, "predicts", predicts)

    def missing(self) -> str | None:
        """What the installed transformers lacks that the finding's repro needs (continuous batching itself, a
        ``ContinuousBatchingConfig`` field its case sets), probed on the release, or ``None``: where it is missing the
        finding can neither reproduce nor be fixed there (n/a, never FIXED?)."""
        try:
            compat.config_kwargs(**self.repro.config)
        except compat.MissingFeature as missing:
            return str(missing)
        return None

    def covers(self, check: str, case: FuzzCase) -> bool:
        """The check, the case's configuration and the installed version are the finding's (whatever was observed:
        whether the failure is the predicted one is :meth:`mismatch`'s question)."""
        hit = case.engine == self.engine and check in self.checks and self.applies(case)
        return hit and transformers_in(self.transformers)

    def mismatch(self, check: str, detail: str, case: FuzzCase) -> str | None:
        """``None`` when ``detail`` (``check``'s) is the failure this finding predicts on ``case``, else why not."""
        prediction = self.predicts[check]
        found = re.search(prediction.pattern, detail)
        if found is None:
            shown = prediction.pattern if len(prediction.pattern) <= 120 else prediction.pattern[:117] + "..."
            return f"its {check} detail does not match /{shown}/"
        return None if prediction.model is None else prediction.model(case, found.groupdict())


# ------------------------------------------------------------------------------------------------ predictions
# Pieces of the judge's details (cbverify.fuzz.judge, cbverify.fuzz.batch_judge) that the predictions are written in.
UNSIGNED = r"\d+(?:\.\d+)?(?:e[+-]\d+)?"  # a float as the judge prints it (%.6g), without its sign
NUMBER, FINITE = rf"-?(?:inf|nan|{UNSIGNED})", rf"-?{UNSIGNED}"
TOKEN_LIST = r"[\[(](?:\d+(?:, )?)*,?[\])]"  # a tuple (the manager's judge) or a list (generate_batch's)
TOKENS = (  # and, where the judge prints them (generate_batch), the call's EOS ids
    rf"^'(?P<request>[^']*)' diverges at position (?P<position>\d+): oracle (?P<oracle>{TOKEN_LIST}) vs engine "
    rf"(?P<engine>{TOKEN_LIST})(?: \(do_sample=\w+, eos=\[(?P<eos>[\d, ]*)\])?"
)
LOGPROB = rf"position \d+: got (?P<got>{NUMBER}), oracle (?P<oracle>{NUMBER}) \(\|diff\|"
RESULTS = r"^(?P<got>\d+) results for (?P<inputs>\d+) inputs x (?P<n>\d+): "
EOS_BEFORE_MINIMUM = r"^'[^']+': EOS at \d+ < (?:min_new_tokens \d+$|the minimum \d+ \(prompt \d+ tokens\): )"
# a sampled token outside the support that is one of the call's EOS ids (masked before the minimum length)
EOS_OUTSIDE_SUPPORT = r"token (\d+) at \d+ is outside the processed support \(do_sample=True, eos=\[(?:\d+, )*\1[,\]]"
EOS_RUNS_ON = r"^request '[^']+': EOS at position \d+ but the completion goes on to \d+$"


def crash(exception: str, message: str) -> str:
    """An ``engine-crash`` detail: the generation thread died of ``exception(message)``, or the call (or a step
    between calls) raised it; ``message`` is a regular expression."""
    return rf"^(?:generation thread died: {exception}\(['\"]|(?:refused: )?{exception}: ){message}"


def failed(message: str) -> str:
    """A ``request-failed`` detail: a result came back with the error ``message`` (a regular expression)."""
    return rf"^'[^']+': {message}"


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", text)]


def eos_at_the_divergence(case: FuzzCase, seen: dict) -> str | None:
    """Tokens: the engine's token at the divergence is one of the request's EOS ids (it emitted an EOS the oracle
    holds back), where the oracle's completion goes on. The EOS ids are the detail's (generate_batch), else the
    request's in the case."""
    position, oracle, engine = int(seen["position"]), _ints(seen["oracle"]), _ints(seen["engine"])
    if seen.get("eos") is not None:
        eos = _ints(seen["eos"])
    else:
        eos = next((list(r.eos_token_ids) for r in case.requests if r.request_id == seen["request"]), [])
    if len(oracle) > position < len(engine) and engine[position] in eos:
        return None
    token = engine[position] if position < len(engine) else "nothing"
    return f"the engine's token at the divergence (position {position}) is {token}, not an EOS {eos} held back"


def differs_at_the_divergence(case: FuzzCase, seen: dict) -> str | None:
    """Tokens: both completions have a token at the divergence (the engine picked another one); neither ended
    before it."""
    position, oracle, engine = int(seen["position"]), _ints(seen["oracle"]), _ints(seen["engine"])
    if len(engine) > position and len(oracle) > position:
        return None
    return f"the {'engine' if len(engine) <= position else 'oracle'} had ended before the divergence at {position}"


def runs_past_the_end(case: FuzzCase, seen: dict) -> str | None:
    """Tokens: the oracle's completion ended (on its EOS) and the engine's goes on past it."""
    position, oracle, engine = int(seen["position"]), _ints(seen["oracle"]), _ints(seen["engine"])
    if len(oracle) == position < len(engine):
        return None
    return f"the engine does not go on past the oracle's end ({len(oracle)} oracle, {len(engine)} engine tokens)"


def mass_removed(case: FuzzCase, seen: dict) -> str | None:
    """Log-probs: the oracle removes tokens the engine keeps (an EOS before the minimum, a banned n-gram): the
    engine's token is one of them (oracle -inf), or it is not and its oracle log-prob is the higher one (the removed
    mass goes to the rest)."""
    got, oracle = float(seen["got"]), float(seen["oracle"])
    if oracle == -math.inf or got < oracle:
        return None
    return f"got {got:.6g} is not below the oracle's {oracle:.6g}, as removing tokens from the oracle makes it"


def fewer_results(case: FuzzCase, seen: dict) -> str | None:
    """Result count: results are missing (never more than asked)."""
    got, want = int(seen["got"]), int(seen["inputs"]) * int(seen["n"])
    return None if got < want else f"{got} results, not fewer than the {want} asked for"


# ------------------------------------------------------------------------------------------------ the manager
def _one_call(*requests: FuzzRequest, generation=None, caller_training=False, **config) -> FuzzCase:
    gen = generation or {"do_sample": False}
    steps = (Step("call", requests),)
    return FuzzCase("transformers-cb", "tiny-llama-arith", False, {**_CB, **config}, gen, steps, caller_training)


def _asks(case: FuzzCase, key: str, value=lambda v: v not in (None, 0)) -> bool:
    """Some config the case passes sets ``key`` to a value ``value`` accepts (keyword arguments not included)."""
    return any(value(g.get(key)) for g in case.generations())


def _top_k_zero(case: FuzzCase) -> bool:
    sampled = case.generation.get("do_sample") and case.config.get("per_request_processors")
    return bool(sampled) and any(r.top_k == 0 for r in case.requests)


def _cache_fits_exactly(case: FuzzCase) -> bool:
    """``num_blocks`` no larger than the longest request's pages: ceil((prompt + max_new_tokens) / page)."""
    page = case.config.get("page_size") or case.config.get("block_size")
    return case.config.get("num_blocks") is not None and case.config["num_blocks"] <= pages_needed(case.requests, page)


# a plain-forward detail (cbverify.fuzz.drivers.PlainForwards): where the caller's forward ran, then what differed
PLAIN_WHERE = (
    r"^(?:after call (?P<call>\d+)|training step|weight update) \((?P<where>no manager left|beside the live manager|"
    r"(?:beside )?the cached manager, stopped|inside pause\(\))\): "
)
PAGED_ATTN = r"attn_implementation 'paged\|(?P<kernel>\w+)' where the caller set '(?P=kernel)'"
PLAIN_FORWARDS = r"(?:caller-mode|eval-mode|training-step) forward"
PAGED_FORWARD = rf"(?:{PAGED_ATTN}|{PLAIN_FORWARDS} differs from a model that never had a manager: )"
NO_CACHE = r"was called without a paged attention cache"  # 5.18's paged kernels on a plain forward


def _beside_a_live_manager(case: FuzzCase) -> bool:
    """The caller makes a plain forward while a manager lives: between the calls of a persistent manager of the
    request API (running, idle) or inside ``pause()`` (a step between calls)."""
    persistent_loop = case.entry == "manager" and case.persistent
    return persistent_loop or (compat.CAN_PAUSE and case.persistent and any(s.paused for s in case.steps))


def _eager_beside_a_live_manager(case: FuzzCase) -> bool:
    """:func:`_beside_a_live_manager` with the caller's attention set to eager."""
    return case.caller_attn == "eager" and _beside_a_live_manager(case)


def while_the_manager_lives(case: FuzzCase, seen: dict) -> str | None:
    """Plain forward: it ran while the manager lived (beside its running loop, inside ``pause()``), or after a
    training step inside ``pause()`` that trained on the paged forward (the weights differ from then on)."""
    if seen["where"] in ("beside the live manager", "inside pause()"):
        return None
    call = int(seen["call"]) if seen.get("call") is not None else None
    calls, trained = -1, False
    for step in case.steps:
        calls += step.kind == "call"
        trained |= step.kind == "train" and step.paused and (call is None or calls < call)
    if trained:
        return None
    return f"it ran {seen['where']!r}, with no manager alive and no training step inside pause() before it"


NOT_SCHEDULABLE = r"No requests can be scheduled and no requests? can be offloaded\."  # 5.17 and on: "requests"
EOS_HELD_BACK = {  # a dropped minimum length: EOS comes before it
    "min-new-tokens": EOS_BEFORE_MINIMUM,
    "tokens": Prediction(TOKENS, eos_at_the_divergence),
    "logprobs": Prediction(LOGPROB, mass_removed),
    "support": EOS_OUTSIDE_SUPPORT,
}


MANAGER_FINDINGS: tuple[FuzzFinding, ...] = (
    FuzzFinding(
        id="cb-training-forward-fails-while-paused",
        engine="transformers-cb",
        checks=("engine-crash",),
        when="a persistent manager and a training step between calls (inside manager.pause())",
        applies=lambda case: (
            compat.CAN_PAUSE
            and case.persistent
            and any(s.kind == "train" and (case.entry == "manager" or s.paused) for s in case.steps)
        ),
        evidence="the caller's training forward inside manager.pause() raises ValueError: `paged|sdpa` was called "
        "without a paged attention cache (the paused manager keeps its paged attention installed on the model); "
        "the same program passes on 5.19.0 and later",
        repro=FuzzCase(
            "transformers-cb",
            "tiny-llama-arith",
            True,
            _CB,
            {"do_sample": False},
            (
                Step("call", (FuzzRequest("c0-r", PROMPT, 2, (2,)),)),
                Step("train", seed=1),
                Step("call", (FuzzRequest("c1-r", PROMPT, 2, (2,)),)),
            ),
        ),  # fmt: skip
        predicts={"engine-crash": crash("ValueError", r"`paged\|\w+` was called without a paged attention cache")},
        affected="transformers 5.18.0; not 5.19.0 to 5.24.0; not drawn before 5.18 (no pause()) (cbverify matrix "
        "--all-minors 5.8 --fuzz 100)",
        transformers=">=5.18,<5.19",
    ),
    FuzzFinding(
        id="cb-cache-needs-a-spare-page",
        engine="transformers-cb",
        checks=("engine-crash", "lost-request", "request-failed"),
        when="num_blocks no larger than the longest request's pages",
        applies=_cache_fits_exactly,
        evidence="one greedy request of a 3-token prompt and max_new_tokens=1 (4 tokens) with page_size=4, "
        "num_blocks=1: the generation thread dies with RuntimeError('No requests can be scheduled and no request "
        "can be offloaded.') (prepare_next_batch, a lone active request the scheduler will not fit) and the request "
        "never returns (5.17.0: the request comes back failed with the same message); with one spare page it is "
        "served",
        repro=_one_call(FuzzRequest("r", (1, 6, 19), 1, (2,)), num_blocks=1, max_batch_tokens=4),
        predicts={
            "engine-crash": crash("RuntimeError", NOT_SCHEDULABLE),
            "lost-request": r"^'[^']+' never came back \(\d+/\d+ results\)$",  # the check says no more than that
            "request-failed": failed(NOT_SCHEDULABLE),
        },
        affected="transformers 5.8.1 to 5.17.0; not 5.18.0 to 5.24.0 (the repro in every venv of cbverify matrix "
        "--all-minors 5.8; the fuzzer found it on 5.8.1)",
        transformers="<5.18",
    ),
    FuzzFinding(
        id="cb-reseeds-global-rng",
        engine="transformers-cb",
        checks=("state:global-rng",),
        when="from 5.9 (ContinuousBatchingConfig.seed) every call; before, sampled calls",
        applies=lambda case: compat.has("seed") or _asks(case, "do_sample"),
        evidence="torch.get_rng_state() differs after one greedy call of a manager built with seed=0: the batch "
        "processor calls torch.manual_seed(seed) on the global generator (set_tp_seed) and samples with "
        "torch.multinomial on it; the caller's random stream is replaced (5.8.1, with no seed field: a greedy "
        "call leaves it alone, a sampled one consumes it)",
        repro=_one_call(FuzzRequest("r", PROMPT, 4, (2,), 1.0, 0), generation={"do_sample": not compat.has("seed")}),
        predicts={"state:global-rng": r"^torch's global RNG state changed$"},
    ),
    FuzzFinding(
        id="cb-leaves-paged-attention",
        engine="transformers-cb",
        checks=("state:attn-implementation",),
        when="always",
        applies=lambda case: True,
        evidence="after a manager is stopped the model's attn_implementation is 'paged|sdpa' (was 'sdpa'): every "
        "later forward of the caller, the oracle's included, runs the paged kernels (the trainer-side effect is "
        "the upstream finding cb-leaves-paged-attention-for-training)",
        repro=_one_call(FuzzRequest("r", PROMPT, 2, (2,))),
        predicts={"state:attn-implementation": r"^attn_implementation '(?!paged)[^']+' before, 'paged\|[^']+' after$"},
        affected="transformers 5.8.1; not 5.9.0 to 5.24.0 (cbverify matrix --all-minors 5.8)",
        transformers="<5.9",
    ),
    FuzzFinding(
        id="cb-leaves-model-in-eval-mode",
        engine="transformers-cb",
        checks=("state:training-mode",),
        when="the caller's model is in train mode",
        applies=lambda case: case.caller_training,
        evidence="ContinuousBatchingManager.__init__ runs self.model = model.eval() and stop()/destroy() restore "
        "only the attention implementation: a model handed over in train mode comes back in eval mode",
        repro=_one_call(FuzzRequest("r", PROMPT, 2, (2,)), caller_training=True),
        predicts={"state:training-mode": r"^training True before, False after$"},
    ),
    FuzzFinding(
        id="cb-plain-forward-runs-in-eval-mode",
        engine="transformers-cb",
        checks=("plain-forward",),
        when="the caller's model is in train mode",
        applies=lambda case: case.caller_training,
        evidence="the caller's model in train mode, one call: right after it (and inside every training step or "
        "weight update between calls, beside a persistent manager or inside its pause()) the model's training flag "
        "is False where the caller set True, so the trainer's next plain forward runs in eval mode (the manager's "
        "model.eval(), the same cause as cb-leaves-model-in-eval-mode); on the bundled models, which have no dropout, "
        "its loss and log-probs still equal a model that never had a manager",
        repro=_one_call(FuzzRequest("r", PROMPT, 2, (2,)), caller_training=True),
        predicts={"plain-forward": PLAIN_WHERE + r"training False where the caller set True$"},
    ),
    FuzzFinding(
        id="cb-live-manager-runs-the-callers-forward-paged",
        engine="transformers-cb",
        checks=("plain-forward",),
        when="the caller set eager attention and makes a plain forward while a manager lives: between the calls of a "
        "persistent manager (its loop running idle), or inside pause()",
        applies=_eager_beside_a_live_manager,
        evidence="a model set to eager attention: the manager switches it to 'paged|eager' when it is built and back "
        "only in stop(); between the calls of a persistent manager, and inside its pause(), the caller's own forward "
        "runs the paged kernel with no paged cache and returns other logits without an error (the repro: the "
        "teacher-forced forward of the call's prompt and completion has loss 1.43609 where a model that never had a "
        "manager has 4.29e-06, log-probs max |diff| 7.06); a training step inside pause() trains on them, so the "
        "weights differ from then on (sdpa, the bundled models' own, is left in place)",
        repro=FuzzCase(
            "transformers-cb",
            "tiny-llama-arith",
            True,
            _CB,
            {"do_sample": False},
            (Step("call", (FuzzRequest("c0-r", PROMPT, 2, (2,)),)),),
            caller_attn="eager",
        ),
        predicts={
            "plain-forward": Prediction(
                PLAIN_WHERE + rf"(?:{PAGED_FORWARD}|{PLAIN_FORWARDS} raised ValueError: `paged\|eager` {NO_CACHE})",
                while_the_manager_lives,
            )
        },
    ),
    FuzzFinding(
        id="cb-live-manager-breaks-the-callers-forward",
        engine="transformers-cb",
        checks=("plain-forward",),
        when="a plain forward while a manager lives: between the calls of a persistent manager (its loop running "
        "idle), or inside pause()",
        applies=_beside_a_live_manager,
        evidence="while a manager lives the model's attention implementation is 'paged|sdpa' where the caller set "
        "sdpa: beside the persistent manager between calls (and inside pause() on 5.18) the caller's own forward runs "
        "the paged kernel without its cache: it differs silently from a model that never had a manager (the repro on "
        "5.10.1, 5.12.0 and 5.15.1: loss 1.43609 vs 4.29e-06, log-probs max |diff| 7.06; the manager fuzz: up to 21), "
        "and on 5.18 it raises ValueError: `paged|sdpa` was called without a paged attention cache (the training "
        "step's forward too: cb-training-forward-fails-while-paused); 5.24 leaves sdpa in place",
        repro=FuzzCase(
            "transformers-cb",
            "tiny-llama-arith",
            True,
            _CB,
            {"do_sample": False},
            (Step("call", (FuzzRequest("c0-r", PROMPT, 2, (2,)),)),),
        ),
        predicts={
            "plain-forward": Prediction(
                PLAIN_WHERE + rf"(?:{PAGED_FORWARD}|{PLAIN_FORWARDS} raised ValueError: `paged\|\w+` {NO_CACHE})",
                while_the_manager_lives,
            )
        },
        affected="transformers 5.8.0, 5.10.1, 5.10.4, 5.11.0, 5.12.0, 5.15.1 (a silently different forward), 5.18.0 "
        "(it raises); not 5.24.0 (the fuzz's 40 cases per entry point in each venv); 5.16, 5.17 and 5.19 to 5.23 not "
        "run (cb-training-forward-fails-while-paused, the same held kernel inside pause(), passes on 5.19 to 5.24)",
        transformers="<5.19",
    ),
    FuzzFinding(
        id="cb-stopped-manager-leaves-the-callers-forward-paged",
        engine="transformers-cb",
        checks=("plain-forward",),
        when="always (a plain forward after any call)",
        applies=lambda case: True,
        evidence="after a manager is stopped the model's attention implementation stays 'paged|sdpa' (the caller set "
        "sdpa; 'paged|eager' for eager: cb-leaves-paged-attention): the caller's next forward runs the paged kernel "
        "without its cache and differs silently from a model that never had a manager (the repro: loss 1.43609 vs "
        "4.29e-06, log-probs max |diff| 7.06; the generate_batch fuzz: up to 14.6), and a training step trains on it",
        repro=_one_call(FuzzRequest("r", PROMPT, 2, (2,))),
        predicts={"plain-forward": PLAIN_WHERE + PAGED_FORWARD},
        affected="transformers 5.8.0; not 5.10.1 to 5.24.0 (the fuzz's 40 cases per entry point in the venvs of "
        "5.8.0, 5.10.1, 5.10.4, 5.11.0, 5.12.0, 5.15.1, 5.18.0, 5.24.0); 5.8.1 and 5.9 not run",
        transformers="<5.9",
    ),
    FuzzFinding(
        id="cb-drops-min-new-tokens",
        engine="transformers-cb",
        checks=("min-new-tokens", "tokens", "logprobs", "support"),
        when="GenerationConfig(min_new_tokens > 0)",
        applies=lambda case: _asks(case, "min_new_tokens"),
        evidence="greedy, min_new_tokens=6, EOS=2: CB returns (20, 17, 5, 5, 5, 2) (EOS at position 5) where the "
        "oracle, as generate() does, holds EOS back and continues (20, 17, 5, 5, 5, 3, 2): "
        "MinNewTokensLengthLogitsProcessor is marked supports_continuous_batching=False and dropped (logged only)",
        repro=_one_call(FuzzRequest("r", ARITH, 4, (10,)), generation={"do_sample": False, "min_new_tokens": 2}),
        predicts=EOS_HELD_BACK,
    ),
    FuzzFinding(
        id="cb-drops-repetition-penalty",
        engine="transformers-cb",
        checks=("logprobs", "tokens", "support"),
        when="GenerationConfig(repetition_penalty != 1)",
        applies=lambda case: _asks(case, "repetition_penalty", lambda v: v not in (None, 1.0)),
        evidence="greedy, repetition_penalty=1.3: CB's tokens are those of no penalty (oracle (13, 6, 3, 16, 6) vs "
        "CB (13, 8, 16, 4, 3) on a fuzzed prompt); RepetitionPenaltyLogitsProcessor is marked unsupported and "
        "dropped with a log line, so the option is silently ignored",
        repro=_one_call(
            FuzzRequest("r", (1, 6, 6, 6, 6, 6, 6), 6, ()), generation={"do_sample": False, "repetition_penalty": 1.3}
        ),  # fmt: skip
        predicts={  # unpenalised scores: another token where both go on, a finite log-prob, a sample the penalty cuts
            "logprobs": rf"position \d+: got {FINITE}, oracle {NUMBER} \(\|diff\|",
            "tokens": Prediction(TOKENS, differs_at_the_divergence),
            "support": r"is outside the processed support \(do_sample=True, .*repetition_penalty=(?!1\.0,)",
        },
    ),
    FuzzFinding(
        id="cb-per-request-top-k-zero-is-top-1",
        engine="transformers-cb",
        checks=("logprobs",),
        when="per_request_processors=True and a sampled request passes top_k=0",
        applies=_top_k_zero,
        evidence="per-request top_k=0 (a GenerationConfig's 'no top-k') goes through max(top_k, min_tokens_to_keep) "
        "= 1 in ContinuousBatchingTopKLogitsWarper: the request is sampled from its top-1 token, log-prob 0 where "
        "the oracle's processed log-prob is < 0",
        repro=FuzzCase(
            "transformers-cb",
            "tiny-llama-arith",
            False,
            {**_CB, "per_request_processors": True},
            {"do_sample": True},
            (Step("call", (FuzzRequest("r", PROMPT, 4, (), 1.0, 0),)),),
        ),  # fmt: skip
        predicts={"logprobs": rf"position \d+: got -?0, oracle -{UNSIGNED} \(\|diff\|"},  # all the mass on one token
    ),
)


def __getattr__(name: str):
    """``BATCH_FINDINGS`` (:mod:`cbverify.fuzz.batch_findings`, built from the definitions above, so read on first
    use) and ``FUZZ_FINDINGS``, every registered finding: the manager's, then generate_batch's."""
    if name not in ("BATCH_FINDINGS", "FUZZ_FINDINGS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from cbverify.fuzz.batch_findings import BATCH_FINDINGS

    globals().update(BATCH_FINDINGS=BATCH_FINDINGS, FUZZ_FINDINGS=MANAGER_FINDINGS + BATCH_FINDINGS)
    return globals()[name]


def covering(engine_name: str, check: str, case: FuzzCase) -> FuzzFinding | None:
    """The first registered finding whose checks, condition and versions cover ``check`` on ``case``, whatever the
    check observed (``None``: none does). Whether a failure is that finding's is :func:`explaining`'s question."""
    if case.engine != engine_name:
        return None
    return next((f for f in __getattr__("FUZZ_FINDINGS") if f.covers(check, case)), None)


def explaining(engine_name: str, check: str, detail: str, case: FuzzCase) -> tuple[FuzzFinding | None, str]:
    """For a failure of ``check`` with ``detail`` on ``case``: ``(finding, "")`` for a covering finding that predicts
    it, or ``(None, why)``: ``why`` names every covering finding and how the detail differs from its prediction
    ("not <id>: <how>; ..."; "" when none covers it: an unregistered failure)."""
    if case.engine != engine_name:
        return None, ""
    misses = []
    for finding in __getattr__("FUZZ_FINDINGS"):
        if finding.covers(check, case):
            why = finding.mismatch(check, detail, case)
            if why is None:
                return finding, ""
            misses.append(f"not {finding.id}: {why}")
    return None, "; ".join(misses)
