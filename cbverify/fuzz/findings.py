"""Registered failures the fuzzer finds on the pinned stack: each a failure class (the checks it fails), the engine,
the condition on the case (``applies``), measured evidence, and the smallest case that shows it (``repro``; the test
suite runs it as a strict expected failure, so an upstream fix turns the suite red until the entry is updated).
Conditions read every ``GenerationConfig`` a case passes (``FuzzCase.generations``): the manager's, or each
``generate_batch`` call's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz.case import FuzzCase, FuzzRequest, Step, pages_needed
from cbverify.upstream.findings import transformers_in
from reference import tasks

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


FUZZ_FINDINGS: tuple[FuzzFinding, ...] = (
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
        applies=lambda case: compat.has("seed") or _asks(case, "do_sample"),
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
        checks=("min-new-tokens", "tokens", "logprobs", "conventions", "support"),
        when="GenerationConfig(min_new_tokens > 0)",
        applies=lambda case: _asks(case, "min_new_tokens"),
        evidence="greedy, min_new_tokens=6, EOS=2: CB returns (20, 17, 5, 5, 5, 2) (EOS at position 5) where the "
        "oracle, as generate() does, holds EOS back and continues (20, 17, 5, 5, 5, 3, 2): "
        "MinNewTokensLengthLogitsProcessor is marked supports_continuous_batching=False and dropped (logged only)",
        repro=_one_call(FuzzRequest("r", ARITH, 4, (10,)), generation={"do_sample": False, "min_new_tokens": 2}),
    ),
    FuzzFinding(
        id="cb-drops-repetition-penalty",
        engine="transformers-cb",
        checks=("logprobs", "tokens", "min-new-tokens", "conventions", "support"),
        when="GenerationConfig(repetition_penalty != 1)",
        applies=lambda case: _asks(case, "repetition_penalty", lambda v: v not in (None, 1.0)),
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


# ------------------------------------------------------------------------------------------------ generate_batch
BATCH_CONTENT = ("tokens", "support", "logprobs", "conventions", "min-new-tokens", "no-repeat-ngram")


def _batch(*steps: Step, generation: dict, persistent: bool = False, **config) -> FuzzCase:
    steps = tuple(s if isinstance(s, Step) else Step("call", s) for s in steps)
    return FuzzCase("transformers-cb", "tiny-llama-arith", persistent, {**_CB, **config}, generation, steps,
                    entry="generate_batch")  # fmt: skip


def _inputs(call: int, *prompts, max_new_tokens: int) -> tuple[FuzzRequest, ...]:
    return tuple(FuzzRequest(f"c{call}-i{j}", p, max_new_tokens, ()) for j, p in enumerate(prompts))


def _batch_calls(case: FuzzCase) -> list[tuple[Step, dict]]:
    return [(s, case.generation_of(s)) for s in case.calls] if case.entry == "generate_batch" else []


def _eos_unset(case: FuzzCase) -> bool:
    return any(g.get("eos_token_id") is None for _, g in _batch_calls(case))


def _swallowed_kwargs(case: FuzzCase) -> bool:
    return any(set(s.options) - {"max_new_tokens"} for s, _ in _batch_calls(case))


def _later_config_differs(case: FuzzCase) -> bool:
    """A persistent manager, and a later call's config differs from the first call's beyond ``max_new_tokens``."""
    calls = _batch_calls(case)
    strip = lambda g: {k: v for k, v in g.items() if k != "max_new_tokens"}  # noqa: E731
    return case.persistent and any(strip(g) != strip(calls[0][1]) for _, g in calls[1:])


def _prefix_cached(case: FuzzCase, whole: bool = False) -> bool:
    """A persistent manager sharing blocks, and a later call's prompt starting with a whole page of an earlier call's
    (``whole``: the same prompt again, its length a multiple of the page size)."""
    if case.entry != "generate_batch" or not case.persistent or case.config.get("allow_block_sharing") is False:
        return False
    page, seen = case.config.get("page_size") or compat.DEFAULT_PAGE_SIZE, []
    for s in case.calls:
        prompts = [r.prompt_ids for r in s.requests]
        for p in prompts:
            if whole and len(p) % page == 0 and p in seen:
                return True
            if not whole and len(p) >= page and any(q[:page] == p[:page] for q in seen if len(q) >= page):
                return True
        seen += prompts
    return False


def _prefix_cached_before_a_change(case: FuzzCase) -> bool:
    """A persistent manager sharing blocks, and a call after a training step or weight update whose prompt starts
    with a whole page of a prompt some call before that change had."""
    if case.entry != "generate_batch" or not case.persistent or case.config.get("allow_block_sharing") is False:
        return False
    page, before, changed = case.config.get("page_size") or compat.DEFAULT_PAGE_SIZE, [], False
    for s in case.steps:
        if s.kind != "call":
            changed = changed or bool(before)
            continue
        prompts = [r.prompt_ids for r in s.requests]
        if changed and any(len(p) >= page and p[:page] == q[:page] for p in prompts for q in before if len(q) >= page):
            return True
        if not changed:
            before += prompts
    return False


BATCH_FINDINGS: tuple[FuzzFinding, ...] = (
    FuzzFinding(
        id="cb-no-repeat-ngram-sees-one-token-per-row",
        engine="transformers-cb",
        checks=("engine-crash", "request-failed", "result-count", *BATCH_CONTENT),
        when="GenerationConfig(no_repeat_ngram_size > 0)",
        applies=lambda case: _asks(case, "no_repeat_ngram_size"),
        affected="transformers 5.8.1, 5.9.0, 5.16.1, 5.17.0, 5.18.0, 5.20.2, 5.23.0, 5.24.0 (the repro in each venv; "
        "the releases between them not run)",
        evidence="NoRepeatNGramLogitsProcessor is kept (supports_continuous_batching unset: 'might not be supported', "
        "a log line) and called with input_ids = batch['input_ids'][0, logits_indices], one last token per row "
        "(1-D): with fewer rows than n it bans nothing (cur_len is the row count), otherwise "
        "input_ids[:, ...] raises IndexError('too many indices for tensor of dimension 1'), the generation "
        "thread dies and every request comes back failed (generate_batch logs it and returns them)",
        repro=_batch(
            _inputs(0, PROMPT, ARITH, max_new_tokens=4),
            generation={"do_sample": False, "eos_token_id": 2, "no_repeat_ngram_size": 2},
        ),  # fmt: skip
    ),
    FuzzFinding(
        id="cb-drops-min-length",
        engine="transformers-cb",
        checks=("min-new-tokens", "tokens", "logprobs", "support", "conventions"),
        when="GenerationConfig(min_length > 0) (the whole sequence's minimum, prompt included)",
        applies=lambda case: _asks(case, "min_length"),
        affected="transformers 5.8.1, 5.9.0, 5.16.1, 5.17.0, 5.18.0, 5.20.2, 5.23.0, 5.24.0 (the repro in each venv; "
        "the releases between them not run)",
        evidence="greedy, min_length=14 for a 7-token prompt, EOS=2: generate_batch returns (22, 20, 17, 7, 5, 3, 2) "
        "(EOS at 6, 13 tokens in all) where the oracle, as generate() does, holds EOS back to the 14th token: "
        "MinLengthLogitsProcessor is marked supports_continuous_batching=False and dropped (a log line)",
        repro=_batch(
            _inputs(0, PROMPT, max_new_tokens=8), generation={"do_sample": False, "eos_token_id": 2, "min_length": 14}
        ),  # fmt: skip
    ),
    FuzzFinding(
        id="cb-unset-eos-disables-eos",
        engine="transformers-cb",
        checks=("tokens", "conventions", "min-new-tokens", "support", "logprobs", "no-repeat-ngram"),
        when="generate_batch with a GenerationConfig that leaves eos_token_id unset",
        applies=_eos_unset,
        affected="transformers 5.8.1, 5.9.0, 5.16.1, 5.17.0, 5.18.0, 5.20.2, 5.23.0, 5.24.0 (the repro in each venv; "
        "the releases between them not run)",
        evidence="GenerationConfig(do_sample=False) with model.generation_config.eos_token_id=2: generate() takes "
        "the model's EOS for the unset field and stops at it; init_continuous_batching sets eos_token_id=-1 "
        "('not set in GenerationConfig. Setting to -1 (disabled)', a warning) before add_requests' own fallback "
        "to the model's EOS can run, so the completion goes on past token 2 to max_new_tokens",
        repro=_batch(
            Step("call", _inputs(0, PROMPT, max_new_tokens=8), options={"max_new_tokens": 8}),
            generation={"do_sample": False},
        ),  # fmt: skip
    ),
    FuzzFinding(
        id="cb-writes-eos-into-the-callers-generation-config",
        engine="transformers-cb",
        checks=("state:generation-config",),
        when="generate_batch with a GenerationConfig that leaves eos_token_id unset",
        applies=_eos_unset,
        affected="transformers 5.8.1, 5.9.0, 5.16.1, 5.17.0, 5.18.0, 5.20.2, 5.23.0, 5.24.0 (the repro in each venv; "
        "the releases between them not run)",
        evidence="after generate_batch(inputs, generation_config=GenerationConfig(do_sample=False)) the caller's "
        "config has eos_token_id=-1 (was None): init_continuous_batching assigns it on the object passed in "
        "(with no config passed, on model.generation_config itself), so a later generate() with it warns that "
        "eos_token_id should be positive",
        repro=_batch(
            Step("call", _inputs(0, PROMPT, max_new_tokens=2), options={"max_new_tokens": 2}),
            generation={"do_sample": False},
        ),  # fmt: skip
    ),
    FuzzFinding(
        id="cb-generate-batch-swallows-generation-kwargs",
        engine="transformers-cb",
        checks=("result-count", "results-order", *BATCH_CONTENT),
        when="generate_batch given a generation option as a keyword argument (other than max_new_tokens)",
        applies=_swallowed_kwargs,
        affected="transformers 5.8.1, 5.9.0, 5.16.1, 5.17.0, 5.18.0, 5.20.2, 5.23.0, 5.24.0 (the repro in each venv; "
        "the releases between them not run)",
        evidence="generate_batch(..., num_return_sequences=2) returns one result per input, and eos_token_id=[], "
        "min_new_tokens=8 or do_sample=True given the same way change nothing: generate_batch pops "
        "max_new_tokens from **kwargs ('the only expected kwarg') and silently ignores the rest, where generate() "
        "lets keyword arguments override the config",
        repro=_batch(
            Step(
                "call", _inputs(0, PROMPT, max_new_tokens=4), options={"max_new_tokens": 4, "num_return_sequences": 2}
            ),
            generation={"do_sample": True, "eos_token_id": 2},
        ),  # fmt: skip
    ),
    FuzzFinding(
        id="cb-persistent-manager-keeps-the-first-generation-config",
        engine="transformers-cb",
        checks=("engine-crash", "result-count", "results-order", "request-failed", *BATCH_CONTENT),
        when="generate_batch(persistent_manager=True) called again with a different GenerationConfig",
        applies=_later_config_differs,
        evidence="the second call's GenerationConfig(eos_token_id=[]) is ignored: init_continuous_batching returns "
        "the cached manager (an info-level log) with the first call's config, so the call stops at EOS 2; only "
        "max_new_tokens, which generate_batch reads itself, follows the new config. A later config asking for more "
        "num_return_sequences than the first makes generate_batch wait forever for results the cached manager "
        "never forks (its loop counts inputs x the new n)",
        repro=_batch(
            Step("call", _inputs(0, PROMPT, max_new_tokens=8)),
            Step(
                "call",
                _inputs(1, PROMPT, max_new_tokens=8),
                generation={"do_sample": False, "eos_token_id": [], "max_new_tokens": 8},
            ),
            generation={"do_sample": False, "eos_token_id": 2, "max_new_tokens": 8},
            persistent=True,
        ),  # fmt: skip
        affected="transformers 5.9.0 to 5.24.0; on 5.8 a later call of a persistent manager returns nothing "
        "(cb-persistent-generate-batch-answers-only-its-first-call), which hides it (the repro in each venv)",
        transformers=">=5.9",
    ),
    FuzzFinding(
        id="cb-persistent-manager-reuses-kv-from-old-weights",
        engine="transformers-cb",
        checks=("tokens", "logprobs", "support", "conventions", "min-new-tokens", "no-repeat-ngram"),
        when="generate_batch(persistent_manager=True), block sharing on (the default), the weights changed between "
        "calls, and a later prompt starting with a whole page of an earlier one",
        applies=_prefix_cached_before_a_change,
        evidence="greedy, page_size=4, the same 11-token prompt before and after an in-place weight update: the "
        "second call returns (10, 5, 13, 12, 10, 16, 4, 9) where the oracle at the new weights gives (8, 3, 13, 4, "
        "16, 16, 8, 20) (with allow_block_sharing=False it does): the cached manager keeps the first call's "
        "prompt blocks for prefix sharing and serves the new request their keys and values, computed with the old "
        "weights",
        repro=_batch(
            Step("call", _inputs(0, ARITH, max_new_tokens=8)),
            Step("update_weights", seed=3),
            Step("call", _inputs(1, ARITH, max_new_tokens=8)),
            generation={"do_sample": False, "eos_token_id": 2, "max_new_tokens": 8},
            persistent=True,
            allow_block_sharing=True,
        ),  # fmt: skip
        affected="transformers 5.9.0 to 5.24.0; on 5.8 a later call of a persistent manager returns nothing "
        "(cb-persistent-generate-batch-answers-only-its-first-call), which hides it (the repro in each venv)",
        transformers=">=5.9",
    ),
)
BATCH_FINDINGS += (
    FuzzFinding(
        id="cb-per-request-top-k-beyond-vocab-crashes",
        engine="transformers-cb",
        checks=("engine-crash", "request-failed", "result-count"),
        when="per_request_processors=True and a sampled GenerationConfig(top_k > the vocabulary size)",
        applies=lambda case: (
            bool(case.config.get("per_request_processors"))
            and any(g.get("do_sample") and (g.get("top_k") or 0) > tasks.VOCAB_SIZE for g in case.generations())
        ),
        evidence="top_k=39 on the 32-token vocabulary: ContinuousBatchingTopKLogitsWarper gathers the sorted scores "
        "at top_k - 1 without clamping it to the vocabulary, the generation thread dies with RuntimeError('index "
        "38 is out of bounds for dimension 1 with size 32') and every request comes back failed (top_k equal to "
        "the vocabulary size works; 5.24 clamps)",
        repro=_batch(
            _inputs(0, PROMPT, max_new_tokens=2),
            generation={"do_sample": True, "top_k": tasks.VOCAB_SIZE + 7, "eos_token_id": 2},
            per_request_processors=True,
        ),
        affected="transformers 5.8.1, 5.9.0, 5.16.1, 5.17.0, 5.18.0, 5.20.2, 5.23.0; not 5.24.0 (the repro in each "
        "venv)",
        transformers="<5.24",
    ),
    FuzzFinding(
        id="cb-generate-batch-drops-forked-sequences",
        engine="transformers-cb",
        checks=("result-count",),
        when="generate_batch with GenerationConfig(num_return_sequences > 1)",
        applies=lambda case: _asks(case, "num_return_sequences", lambda v: (v or 1) > 1),
        evidence="do_sample=True, num_return_sequences=2, one input: one result comes back; the manager forks the "
        "children (req_0__child#0) but generate_batch returns only the keys req_0 .. req_<len(inputs)-1>",
        repro=_batch(
            _inputs(0, PROMPT, max_new_tokens=2),
            generation={"do_sample": True, "num_return_sequences": 2, "eos_token_id": 2},
        ),
        affected="transformers 5.8.1, 5.9.0, 5.16.1, 5.17.0; not 5.18.0 to 5.24.0 (the repro in each venv)",
        transformers="<5.18",
    ),
    FuzzFinding(
        id="cb-persistent-generate-batch-answers-only-its-first-call",
        engine="transformers-cb",
        checks=("result-count",),
        when="generate_batch(persistent_manager=True) called more than once",
        applies=lambda case: case.entry == "generate_batch" and case.persistent and len(case.calls) > 1,
        evidence="the second call of a persistent manager with one input returns {}: the cached manager numbers "
        "requests on from its counter (req_1) while generate_batch looks its results up as req_0 .. "
        "req_<len(inputs)-1>, so a later call gets back only the results whose number happens to be below its "
        "input count",
        repro=_batch(
            Step("call", _inputs(0, PROMPT, max_new_tokens=2)),
            Step("call", _inputs(1, PROMPT, max_new_tokens=2)),
            generation={"do_sample": False, "eos_token_id": 2, "max_new_tokens": 2},
            persistent=True,
        ),
        affected="transformers 5.8.1; not 5.9.0 to 5.24.0 (the repro in each venv)",
        transformers="<5.9",
    ),
    FuzzFinding(
        id="cb-persistent-fork-of-a-cached-whole-page-prompt-crashes",
        engine="transformers-cb",
        checks=("engine-crash", "request-failed", "result-count"),
        when="generate_batch(persistent_manager=True), block sharing on, num_return_sequences > 1, and a later call "
        "asking again for a prompt whose length is a multiple of page_size",
        applies=lambda case: (
            _prefix_cached(case, whole=True) and _asks(case, "num_return_sequences", lambda v: (v or 1) > 1)
        ),
        evidence="page_size=4, an 8-token prompt, do_sample=True, num_return_sequences=2, asked in two calls of a "
        "persistent manager: the second call's generation thread dies with RuntimeError('cannot reshape tensor "
        "of 0 elements into shape [1, 0, -1, 32] ...'): every page of the prompt is found cached, and the forked "
        "request is scheduled with no token to compute",
        repro=_batch(
            Step("call", _inputs(0, ARITH[:8], max_new_tokens=2)),
            Step("call", _inputs(1, ARITH[:8], max_new_tokens=2)),
            generation={"do_sample": True, "num_return_sequences": 2, "eos_token_id": 2, "max_new_tokens": 2},
            persistent=True,
        ),
        affected="transformers 5.8.1, 5.9.0, 5.16.1, 5.17.0; not 5.18.0 to 5.24.0 (the repro in each venv)",
        transformers="<5.18",
    ),
    FuzzFinding(
        id="cb-fork-without-room-kills-the-loop",
        engine="transformers-cb",
        checks=("engine-crash", "request-failed", "result-count"),
        when="num_return_sequences > 1 and a cache too small for every forked copy at once",
        applies=lambda case: (
            _asks(case, "num_return_sequences", lambda v: (v or 1) > 1)
            and case.config.get("num_blocks") is not None
            and case.config["num_blocks"]
            < max(g.get("num_return_sequences") or 1 for g in case.generations())
            * pages_needed(case.requests, case.config.get("page_size") or compat.DEFAULT_PAGE_SIZE)
        ),
        evidence="page_size=4, num_blocks=4, an 8-token prompt, 4 new tokens, do_sample=True, num_return_sequences=3: "
        "the generation thread dies with ValueError('Failed to fork blocks for request req_0') and the request "
        "comes back failed; the release that fixes it forks what fits and queues the other copies as new requests",
        repro=_batch(
            Step("call", _inputs(0, ARITH[:8], max_new_tokens=4), options={"max_new_tokens": 4}),
            generation={"do_sample": True, "num_return_sequences": 3, "eos_token_id": []},
            num_blocks=4,
        ),
        affected="transformers 5.8.1, 5.9.0; not 5.16.1 to 5.24.0; 5.10 to 5.15 not run (the repro in each venv)",
        transformers="<5.16",
    ),
)
FUZZ_FINDINGS = FUZZ_FINDINGS + BATCH_FINDINGS


def covering(engine_name: str, check: str, case: FuzzCase) -> FuzzFinding | None:
    """The registered finding that explains ``check`` failing on ``case`` (``None``: an unregistered failure)."""
    if case.engine != engine_name:
        return None
    return next((f for f in FUZZ_FINDINGS if f.covers(check, case)), None)
