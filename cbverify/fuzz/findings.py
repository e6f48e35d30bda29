"""Registered failures the fuzzer finds on the pinned stack: each a failure class (the checks it fails), the engine,
the condition on the case (``applies``), measured evidence, and the smallest case that shows it (``repro``; the test
suite runs it as a strict expected failure, so an upstream fix turns the suite red until the entry is updated).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz.case import FuzzCase, FuzzRequest, Step, pages_needed
from cbverify.upstream.findings import transformers_in

SEEN = "transformers 5.24.0 (torch 2.13.0, CPU, float32, tiny-llama-arith)"
PROMPT = (1, 6, 5, 16, 7, 5, 3)
ARITH = (1, 19, 17, 10, 5, 13, 12, 10, 13, 11, 22)  # greedy: (10, 5, 13, 12, 10, 16, 4, 10); penalty 1.3: ... 9
_CB = dict(page_size=4, num_blocks=16, max_batch_tokens=16, return_logprobs=True) | (
    {"seed": 0} if compat.has("seed") else {}  # the field exists from 5.9 (cbverify.engines.transformers_compat)
)


@dataclass(frozen=True, slots=True)
class FuzzFinding:
    id: str
    engine: str
    checks: tuple[str, ...]
    when: str
    applies: Callable[[FuzzCase], bool]
    evidence: str
    repro: FuzzCase
    affected: str = SEEN
    transformers: str = ""  # PEP 440 specifier ("" = every version seen)

    def covers(self, check: str, case: FuzzCase) -> bool:
        hit = case.engine == self.engine and check in self.checks and self.applies(case)
        return hit and transformers_in(self.transformers)


def _one_call(*requests: FuzzRequest, generation=None, caller_training=False, **config) -> FuzzCase:
    gen = generation or {"do_sample": False}
    steps = (Step("call", requests),)
    return FuzzCase("transformers-cb", "tiny-llama-arith", False, {**_CB, **config}, gen, steps, caller_training)


def _top_k_zero(case: FuzzCase) -> bool:
    sampled = case.generation.get("do_sample") and case.config.get("per_request_processors")
    return bool(sampled) and any(r.top_k == 0 for r in case.requests)


def _cache_fits_exactly(case: FuzzCase) -> bool:
    """``num_blocks`` no larger than the longest request's pages: ceil((prompt + max_new_tokens) / page)."""
    page = case.config.get("page_size") or case.config.get("block_size")
    return case.config.get("num_blocks") is not None and case.config["num_blocks"] <= pages_needed(case.requests, page)


FUZZ_FINDINGS: tuple[FuzzFinding, ...] = (
    FuzzFinding(
        id="cb-training-forward-fails-while-paused",
        engine="transformers-cb",
        checks=("engine-crash",),
        when="a persistent manager and a training step between calls (inside manager.pause())",
        applies=lambda case: compat.CAN_PAUSE and case.persistent and any(s.kind == "train" for s in case.steps),
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
        affected="transformers 5.8.1 to 5.17.0; not 5.18.0 to 5.24.0 (the repro in every venv of cbverify matrix "
        "--all-minors 5.8; the fuzzer found it on 5.8.1)",
        transformers="<5.18",
    ),
    FuzzFinding(
        id="cb-reseeds-global-rng",
        engine="transformers-cb",
        checks=("state:global-rng",),
        when="from 5.9 (ContinuousBatchingConfig.seed) every call; before, sampled calls",
        applies=lambda case: compat.has("seed") or bool(case.generation.get("do_sample")),
        evidence="torch.get_rng_state() differs after one greedy call of a manager built with seed=0: the batch "
        "processor calls torch.manual_seed(seed) on the global generator (set_tp_seed) and samples with "
        "torch.multinomial on it; the caller's random stream is replaced (5.8.1, with no seed field: a greedy "
        "call leaves it alone, a sampled one consumes it)",
        repro=_one_call(FuzzRequest("r", PROMPT, 4, (2,), 1.0, 0), generation={"do_sample": not compat.has("seed")}),
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
    ),
    FuzzFinding(
        id="cb-drops-min-new-tokens",
        engine="transformers-cb",
        checks=("min-new-tokens", "tokens", "logprobs", "conventions"),
        when="GenerationConfig(min_new_tokens > 0)",
        applies=lambda case: bool(case.generation.get("min_new_tokens")),
        evidence="greedy, min_new_tokens=6, EOS=2: CB returns (20, 17, 5, 5, 5, 2) (EOS at position 5) where the "
        "oracle, as generate() does, holds EOS back and continues (20, 17, 5, 5, 5, 3, 2): "
        "MinNewTokensLengthLogitsProcessor is marked supports_continuous_batching=False and dropped (logged only)",
        repro=_one_call(FuzzRequest("r", ARITH, 4, (10,)), generation={"do_sample": False, "min_new_tokens": 2}),
    ),
    FuzzFinding(
        id="cb-drops-repetition-penalty",
        engine="transformers-cb",
        checks=("logprobs", "tokens", "min-new-tokens", "conventions"),
        when="GenerationConfig(repetition_penalty != 1)",
        applies=lambda case: case.generation.get("repetition_penalty") not in (None, 1.0),
        evidence="greedy, repetition_penalty=1.3: CB's tokens are those of no penalty (oracle (13, 6, 3, 16, 6) vs "
        "CB (13, 8, 16, 4, 3) on a fuzzed prompt); RepetitionPenaltyLogitsProcessor is marked unsupported and "
        "dropped with a log line, so the option is silently ignored",
        repro=_one_call(
            FuzzRequest("r", (1, 6, 6, 6, 6, 6, 6), 6, ()), generation={"do_sample": False, "repetition_penalty": 1.3}
        ),  # fmt: skip
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
    ),
)


def covering(engine_name: str, check: str, case: FuzzCase) -> FuzzFinding | None:
    """The registered finding that explains ``check`` failing on ``case`` (``None``: an unregistered failure)."""
    if case.engine != engine_name:
        return None
    return next((f for f in FUZZ_FINDINGS if f.covers(check, case)), None)
