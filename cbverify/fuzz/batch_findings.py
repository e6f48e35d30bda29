"""Registered failures of ``model.generate_batch`` (``cbverify fuzz --entry generate_batch``), built with the
definitions of :mod:`cbverify.fuzz.findings`; read them from there (``BATCH_FINDINGS``, and ``FUZZ_FINDINGS`` with
the manager's). Ranges from the repro run in the venvs of ``cbverify.upstream.matrix``.
"""

from __future__ import annotations

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz.case import FuzzCase, FuzzRequest, Step, pages_needed
from cbverify.fuzz.findings import (
    _CB,
    ARITH,
    EOS_BEFORE_MINIMUM,
    EOS_HELD_BACK,
    EOS_RUNS_ON,
    LOGPROB,
    PROMPT,
    RESULTS,
    TOKENS,
    FuzzFinding,
    _asks,
    crash,
    differs_at_the_divergence,
    failed,
    fewer_results,
    mass_removed,
    runs_past_the_end,
)
from cbverify.upstream.predictions import Prediction
from reference import tasks


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


def _forked_prompt_one_past_cached_pages(case: FuzzCase) -> bool:
    """generate_batch with block sharing on and num_return_sequences > 1 in a config, and a prompt one token past a
    whole number of pages (at least one) whose pages another prompt of the same manager starts with: the same input
    twice in a call (TRL's group), or asked again by a later call of a persistent manager."""
    if case.entry != "generate_batch" or case.config.get("allow_block_sharing") is False:
        return False
    if not _asks(case, "num_return_sequences", lambda v: (v or 1) > 1):
        return False
    page = case.config.get("page_size") or compat.DEFAULT_PAGE_SIZE
    calls = [case.calls] if case.persistent else [[s] for s in case.calls]  # the calls each manager serves
    for served in calls:
        prompts = [r.prompt_ids for s in served for r in s.requests]
        for i, p in enumerate(prompts):
            head = len(p) - 1
            if head >= page and head % page == 0:
                if any(j != i and len(q) >= len(p) and q[:head] == p[:head] for j, q in enumerate(prompts)):
                    return True
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


NGRAM_BREAKS = (  # the exception the processor raises on the 1-D input_ids: 5.16 and on, and 5.8 / 5.9
    crash("IndexError", "too many indices for tensor of dimension 1")
    + "|"
    + crash("TypeError", "'int' object is not subscriptable")
)
SAMPLED_OUTSIDE = r"is outside the processed support \(do_sample=True, "
LENGTH_WITHOUT_EOS = r"^request '[^']+': finish_reason 'length' with \d+/\d+ tokens, EOS=False$"
NGRAM_REPEATED = r"^'[^']+': token \d+ at \d+ repeats a \d+-gram: "
OUT_OF_VOCAB = r"index \d+ is out of bounds for dimension 1 with size \d+"
RESHAPE_NOTHING = r"cannot reshape tensor of 0 elements into shape "
EMPTY_BATCH = RESHAPE_NOTHING + r"\[1, 0, -1, \d+\]"  # the attention's view of a batch of 0 query tokens
NO_ROOM_TO_FORK = r"Failed to fork blocks for request \S+"


def an_input_lost(case: FuzzCase, seen: dict) -> str | None:
    """Result count: fewer results than inputs (a whole input's request never came back; a release that drops forked
    sequences still returns one per input)."""
    got, inputs = int(seen["got"]), int(seen["inputs"])
    return None if got < inputs else f"{got} results, not fewer than the {inputs} inputs"


def as_configured(case: FuzzCase, seen: dict) -> str | None:
    """Result count: what the configs passed ask for (their num_return_sequences; one per input where the release
    drops forked sequences), whatever a keyword argument asked."""
    got, inputs = int(seen["got"]), int(seen["inputs"])
    configured = {inputs * (g.get("num_return_sequences") or 1) for g in case.generations()} | {inputs}
    return (
        None if got in configured else f"{got} results, none of what the configs passed ask for {sorted(configured)}"
    )


BATCH_FINDINGS: tuple[FuzzFinding, ...] = (
    FuzzFinding(
        id="cb-no-repeat-ngram-sees-one-token-per-row",
        engine="transformers-cb",
        checks=("engine-crash", "request-failed", "result-count", "tokens", "support", "logprobs", "no-repeat-ngram"),
        when="GenerationConfig(no_repeat_ngram_size > 0)",
        applies=lambda case: _asks(case, "no_repeat_ngram_size"),
        affected="transformers 5.8.1, 5.9.0, 5.16.1, 5.17.0, 5.18.0, 5.20.2, 5.23.0, 5.24.0 (the repro in each venv; "
        "the releases between them not run)",
        evidence="NoRepeatNGramLogitsProcessor is kept (supports_continuous_batching unset: 'might not be supported', "
        "a log line) and called with input_ids = batch['input_ids'][0, logits_indices], one last token per row "
        "(1-D): with fewer rows than n it bans nothing (cur_len is the row count), otherwise "
        "input_ids[:, ...] raises IndexError('too many indices for tensor of dimension 1'), the generation "
        "thread dies and every request comes back failed (generate_batch logs it and returns them); on 5.8.1 and "
        "5.9.0 the thread dies with TypeError(\"'int' object is not subscriptable\")",
        repro=_batch(
            _inputs(0, PROMPT, ARITH, max_new_tokens=4),
            generation={"do_sample": False, "eos_token_id": 2, "no_repeat_ngram_size": 2},
        ),  # fmt: skip
        predicts={  # the loop dies, or nothing is banned: a banned token comes through where both go on
            "engine-crash": NGRAM_BREAKS,
            "request-failed": failed("too many indices for tensor of dimension 1"),
            "result-count": Prediction(RESULTS, fewer_results),
            "tokens": Prediction(TOKENS, differs_at_the_divergence),
            "support": SAMPLED_OUTSIDE + r".*no_repeat_ngram_size=[1-9]",
            "logprobs": Prediction(LOGPROB, mass_removed),
            "no-repeat-ngram": NGRAM_REPEATED,
        },
    ),
    FuzzFinding(
        id="cb-drops-min-length",
        engine="transformers-cb",
        checks=("min-new-tokens", "tokens", "logprobs", "support"),
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
        predicts=EOS_HELD_BACK,
    ),
    FuzzFinding(
        id="cb-unset-eos-disables-eos",
        engine="transformers-cb",
        checks=("tokens", "conventions"),
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
        predicts={"tokens": Prediction(TOKENS, runs_past_the_end), "conventions": EOS_RUNS_ON},
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
        predicts={
            "state:generation-config": r"^the GenerationConfig passed in changed: \{'eos_token_id': \(None, -1\)\}$"
            r"|^model\.generation_config changed$"
        },  # fmt: skip
    ),
    FuzzFinding(
        id="cb-generate-batch-swallows-generation-kwargs",
        engine="transformers-cb",
        checks=("engine-crash", "result-count", "tokens", "support", "logprobs", "conventions", "min-new-tokens"),
        when="generate_batch given a generation option as a keyword argument (other than max_new_tokens)",
        applies=_swallowed_kwargs,
        affected="transformers 5.8.1, 5.9.0, 5.16.1, 5.17.0, 5.18.0, 5.20.2, 5.23.0, 5.24.0 (the repro in each venv; "
        "the releases between them not run)",
        evidence="generate_batch(..., num_return_sequences=2) returns one result per input, and eos_token_id=[], "
        "min_new_tokens=8 or do_sample=True given the same way change nothing: generate_batch pops "
        "max_new_tokens from **kwargs ('the only expected kwarg') and silently ignores the rest, where generate() "
        "lets keyword arguments override the config; do_sample=True so given beside num_return_sequences > 1 is "
        "refused before any work (ValueError: Greedy methods ... do not support `num_return_sequences` different "
        "than 1)",
        repro=_batch(
            Step(
                "call", _inputs(0, PROMPT, max_new_tokens=4), options={"max_new_tokens": 4, "num_return_sequences": 2}
            ),
            generation={"do_sample": True, "eos_token_id": 2},
        ),  # fmt: skip
        predicts={  # the call as if the keywords were not passed
            "engine-crash": crash(
                "ValueError",
                r"Greedy methods \(do_sample != True\) without beam search do not "
                r"support `num_return_sequences` different than 1",
            ),
            "result-count": Prediction(RESULTS, as_configured),
            "tokens": TOKENS,
            "support": SAMPLED_OUTSIDE,
            "logprobs": LOGPROB,
            "conventions": f"{EOS_RUNS_ON}|{LENGTH_WITHOUT_EOS}",
            "min-new-tokens": EOS_BEFORE_MINIMUM,
        },  # fmt: skip
    ),
    FuzzFinding(
        id="cb-persistent-manager-keeps-the-first-generation-config",
        engine="transformers-cb",
        checks=(
            "engine-crash",
            "result-count",
            "results-order",
            "tokens",
            "support",
            "logprobs",
            "conventions",
            "min-new-tokens",
            "no-repeat-ngram",
        ),
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
        predicts={  # a later call served with the first call's config: what that config gives, in any check's words
            "engine-crash": r"^generate_batch did not return within \d+s \(hung\); its manager stopped$",
            "result-count": RESULTS,
            "results-order": r"^result \d+ \('[^']+'\) answers prompt \[|^'[^']+' answers a prompt no input had$",
            "tokens": TOKENS,
            "support": SAMPLED_OUTSIDE,
            "logprobs": LOGPROB,
            "conventions": f"{EOS_RUNS_ON}|{LENGTH_WITHOUT_EOS}",
            "min-new-tokens": EOS_BEFORE_MINIMUM,
            "no-repeat-ngram": NGRAM_REPEATED,
        },
        affected="transformers 5.9.0 to 5.24.0; on 5.8 a later call of a persistent manager returns nothing "
        "(cb-persistent-generate-batch-answers-only-its-first-call), which hides it (the repro in each venv)",
        transformers=">=5.9",
    ),
    FuzzFinding(
        id="cb-persistent-manager-reuses-kv-from-old-weights",
        engine="transformers-cb",
        checks=("tokens", "logprobs", "support"),
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
        predicts={"tokens": TOKENS, "logprobs": LOGPROB, "support": SAMPLED_OUTSIDE},  # the old weights' numbers
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
        predicts={
            "engine-crash": crash("RuntimeError", OUT_OF_VOCAB),
            "request-failed": failed(OUT_OF_VOCAB),
            "result-count": Prediction(RESULTS, fewer_results),
        },
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
        predicts={"result-count": r"^(\d+) results for \1 inputs x (?:[2-9]|\d{2,}): "},  # one per input
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
        predicts={"result-count": Prediction(RESULTS, fewer_results)},
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
        predicts={
            "engine-crash": crash("RuntimeError", RESHAPE_NOTHING),
            "request-failed": failed(RESHAPE_NOTHING),
            "result-count": Prediction(RESULTS, fewer_results),
        },
        affected="transformers 5.8.1, 5.9.0, 5.16.1, 5.17.0; not 5.18.0 to 5.24.0 (the repro in each venv)",
        transformers="<5.18",
    ),
    FuzzFinding(
        id="cb-fork-of-a-prompt-one-past-cached-pages-crashes",
        engine="transformers-cb",
        checks=("engine-crash", "request-failed", "result-count"),
        when="generate_batch, block sharing on, num_return_sequences > 1, and a prompt one token past whole pages "
        "whose pages another prompt of the same manager starts with (the same input twice in a call, as TRL's group)",
        applies=_forked_prompt_one_past_cached_pages,
        evidence="page_size=4, the same 5-token prompt as two inputs of one call, do_sample=True, "
        "num_return_sequences=2, max_batch_tokens=2: the generation thread dies with RuntimeError('cannot reshape "
        "tensor of 0 elements into shape [1, 0, -1, 32] ...') and the second input comes back failed or not at all. "
        "Scheduler._infer_request_tokens (continuous_batching/scheduler.py) gives the second copy the first's cached "
        "whole pages (PagedAttentionCache.search_prefix_match leaves the one token after them), then "
        "Scheduler._schedule_request, as the request still has children to fork, holds that last token back for the "
        "fork (token_budget = len(request_tokens) - 1 = 0) and schedules it with no token to process; alone in its "
        "batch (max_batch_tokens=2 keeps it waiting until the first input's two sequences are done) the batch has 0 "
        "query tokens and the attention's view raises (traced on 5.24.0: req_1 PREFILLING, 1 token left at offset "
        "4, 1 child, 0 scheduled). Not with allow_block_sharing=False, one input, n=1, or a prompt of whole pages; "
        "the fuzz's shrunk case had a 33-token prompt and page_size=16",
        repro=_batch(
            _inputs(0, ARITH[:5], ARITH[:5], max_new_tokens=2),
            generation={"do_sample": True, "num_return_sequences": 2, "eos_token_id": 2, "max_new_tokens": 2},
            max_batch_tokens=2,
            allow_block_sharing=True,
        ),
        predicts={
            "engine-crash": crash("RuntimeError", EMPTY_BATCH),
            "request-failed": failed(EMPTY_BATCH),
            "result-count": Prediction(RESULTS, an_input_lost),  # 5.8.0: the death unread, the input never back
        },
        affected="transformers 5.8.0, 5.10.1, 5.10.4, 5.11.0, 5.12.0, 5.15.1, 5.18.0, 5.24.0: every release run (the "
        "standalone repro in each venv exits 1; 5.10.1 to 5.15.1: the thread dies with the RuntimeError and the "
        "second input never comes back; 5.18.0 and 5.24.0: it also comes back failed with it; 5.8.0: the same "
        "RuntimeError in transformers' log, the thread's death not readable, 1 result for 2 inputs x 2 where "
        "sharing off gives 2); with allow_block_sharing=False no release raises it",
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
        predicts={
            "engine-crash": crash("ValueError", NO_ROOM_TO_FORK),
            "request-failed": failed(NO_ROOM_TO_FORK),
            "result-count": Prediction(RESULTS, fewer_results),
        },
        affected="transformers 5.8.0 to 5.10.4; not 5.11.0 to 5.24.0 (cbverify bisect over the 30 releases from 5.8.0 "
        "to 5.24.0, the repro in each probed release's venv: cbverify/upstream/bisections.json)",
        transformers="<5.11",
    ),
)
