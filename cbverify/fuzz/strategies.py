"""Hypothesis strategies of the fuzzer. The suite's other strategies are in ``property_tests/strategies.py``; these
live here because ``cbverify fuzz`` draws from them and ``cbverify`` may not import the tests.

Everything is drawn small enough for a CPU: prompts up to 40 tokens (longer than a page and than the smallest token
budgets), completions up to 10 tokens, 1-3 calls of 1-3 GRPO groups of 1-3 samples.
"""

from __future__ import annotations

from hypothesis import strategies as st

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz.case import FuzzCase, FuzzRequest, Step, pages_needed
from reference import tasks


def _pick(draw, force: dict, option: str, values: dict, free):
    """``option``'s forced value (``values``: label -> strategy), else a free draw of ``free``."""
    if option in force:
        if force[option] not in values:
            raise ValueError(f"cannot force {option}={force[option]!r}: one of {sorted(values)}")
        return draw(values[force[option]])
    return draw(free)


# older transformers lack the field (cbverify.engines.transformers_compat): its default only
_BATCH_LIMITS = [None, 1, 2, 4] if compat.has("max_requests_per_batch") else [None]
EOS_SETS = ((tasks.EOS_ID,), (tasks.EOS_ID,), (tasks.EOS_ID, tasks.VOCAB["\n"]), ())


@st.composite
def fuzz_request_groups(
    draw,
    *,
    call: int,
    sampled: bool,
    per_request: bool,
    max_prompt_len: int = 40,
    top_ps=(None, 0.8, 1.0),
    force: dict | None = None,
):
    """1-3 GRPO groups (one prompt, 1-3 samples each, distinct seeds); ids unique across calls (``c<call>-...``).
    ``force``: values of ``cbverify.fuzz.coverage.manager_space`` (per-request sampling, the call's layout)."""
    force = force or {}
    out = []
    prompts = _pick(draw, force, "distinct_prompts", {"one": st.just(1), "several": st.integers(2, 3)},
                    st.integers(1, 3))  # fmt: skip
    for p in range(prompts):
        n = draw(st.integers(1, max_prompt_len - 1))
        prompt = (tasks.BOS_ID, *draw(st.lists(st.integers(3, tasks.VOCAB_SIZE - 1), min_size=n, max_size=n)))
        samples = {"one": st.just(1), "several": st.integers(2, 3) if p == 0 else st.integers(1, 3)}
        for g in range(_pick(draw, force, "samples_per_prompt", samples, st.integers(1, 3))):
            kw = {}
            if sampled and per_request:
                kw = dict(
                    temperature=_pick(draw, force, "temperature", {"1.0": st.just(1.0), "other": st.sampled_from(
                        [0.7, 1.5])}, st.sampled_from([0.7, 1.0, 1.5])),
                    top_k=_pick(draw, force, "top_k", {"unset": st.none(), "0": st.just(0), "cut": st.sampled_from(
                        [1, 3])}, st.sampled_from([None, 0, 1, 3])),
                    top_p=_pick(draw, force, "top_p", {"unset-or-1": st.sampled_from([x for x in top_ps if x in (
                        None, 1.0)]), "below-1": st.sampled_from([x for x in top_ps if x is not None and x < 1] or [
                        None])}, st.sampled_from(top_ps)),
                )  # fmt: skip
            elif sampled:
                kw = dict(temperature=1.0)
            out.append(
                FuzzRequest(
                    f"c{call}-p{p}-g{g}",
                    prompt,
                    draw(st.integers(1, 10)),
                    draw(st.sampled_from(EOS_SETS)),
                    seed=draw(st.integers(0, 2**31 - 1)),
                    **kw,
                )  # fmt: skip
            )
    return out


@st.composite
def fuzz_cases(draw, *, engine: str, model: str = "tiny-llama-arith", force: dict | None = None) -> FuzzCase:
    """An engine configuration, manager-wide generation options and a program of calls, trainings and updates.
    ``force``: values of ``cbverify.fuzz.coverage.manager_space`` options drawn as given (transformers CB)."""
    force = force or {}
    if force and engine != "transformers-cb":
        raise ValueError(f"forced option values are transformers CB's (cbverify.fuzz.coverage), not {engine!r}'s")
    sampled = _pick(draw, force, "do_sample", {"true": st.just(True), "false": st.just(False)}, st.booleans())
    per_request = engine != "transformers-cb" or _pick(
        draw, force, "per_request_processors", {"true": st.just(True), "false": st.just(False)}, st.booleans()
    )
    generation: dict = {"do_sample": sampled}
    if engine == "transformers-cb":
        generation["min_new_tokens"] = _pick(draw, force, "min_new_tokens", {"off": st.none(), "on": st.sampled_from(
            [2, 6])}, st.sampled_from([None, None, 2, 6]))  # fmt: skip
        generation["repetition_penalty"] = _pick(draw, force, "repetition_penalty", {"off": st.none(), "on": st.just(
            1.3)}, st.sampled_from([None, None, 1.3]))  # fmt: skip
    if sampled:
        generation["min_p"] = _pick(draw, force, "min_p", {"unset": st.none(), "above-0": st.just(0.1)},
                                    st.sampled_from([None, None, 0.1]))  # fmt: skip
    # one vLLM per case (its start-up is seconds), weights fixed (the adapter has no weight sync), one call at a time
    persistent = engine == "vllm" or (engine != "hf-generate" and draw(st.booleans()))
    where = force.get("plain_forward")  # where the caller's plain forwards run (cbverify.fuzz.coverage)
    if where is not None:
        persistent = where != "no-manager-left"
    # vLLM applies min-p before top-p: the registered vllm-min-p-before-top-p (its script holds that domain)
    top_ps = (None, 1.0) if engine == "vllm" and generation.get("min_p") else (None, 0.8, 1.0)
    steps = []
    for call in range(draw(st.integers(2, 3) if where == "inside-pause" else st.integers(1, 3))):
        # a live manager must be paused while the model changes: before 5.18 it cannot be (no pause())
        can_change = engine != "vllm" and (not (persistent and engine == "transformers-cb") or compat.CAN_PAUSE)
        if call and can_change:
            changes = ["train", "update_weights"]
            between = draw(
                st.sampled_from(changes if where == "inside-pause" and call == 1 else ["none", "none", *changes])
            )
            if between != "none":
                steps.append(Step(between, seed=draw(st.integers(0, 2**16))))
        reqs = draw(fuzz_request_groups(call=call, sampled=sampled, per_request=per_request, top_ps=top_ps,
                                        force=force))  # fmt: skip
        staggered = persistent and engine != "vllm" and len(reqs) > 1 and draw(st.booleans())
        steps.append(Step("call", tuple(reqs), staggered=staggered))
    requests = [r for s in steps for r in s.requests]
    if engine == "transformers-cb":
        page = draw(st.sampled_from([4, 8, 16]))
        need = pages_needed(requests, page)
        config = dict(
            page_size=page, num_blocks=need + draw(st.sampled_from([0, 1, 2, 4, 3 * need])),
            max_batch_tokens=_batch_tokens(draw, force),
            scheduler_type=draw(st.sampled_from(["fifo", "prefill_first"])), allow_block_sharing=draw(st.booleans()),
            max_requests_per_batch=_batch_limit(draw, force), return_logprobs=draw(st.booleans()),
            per_request_processors=per_request,
        )  # fmt: skip
        if compat.has("seed"):
            config["seed"] = draw(st.integers(0, 2**31 - 1))
    elif engine == "cb_impl":
        block = draw(st.sampled_from([1, 2, 4, 16]))
        need = pages_needed(requests, block)
        config = dict(
            block_size=block, num_blocks=need + draw(st.sampled_from([0, 1, 2, 3 * need])),
            max_batch_tokens=draw(st.sampled_from([2, 5, 16, 512])), max_num_seqs=draw(st.sampled_from([1, 2, 256])),
            enable_prefix_sharing=draw(st.booleans()),
        )  # fmt: skip
    elif engine == "vllm":
        config = vllm_config(draw, requests)
    elif engine == "hf-generate":
        config = dict(max_batch_size=draw(st.sampled_from([None, 1, 2])), seed=draw(st.integers(0, 2**31 - 1)))
    else:
        raise ValueError(f"no fuzz cases for engine {engine!r}")
    attn = _caller_attn(draw, force) if engine == "transformers-cb" else None
    return FuzzCase(engine, model, persistent, config, generation, tuple(steps), caller_training=draw(st.booleans()),
                    caller_attn=attn)  # fmt: skip


def _caller_attn(draw, force: dict) -> str | None:
    """The attention implementation the caller set before handing the model over: the checkpoint's as loaded (sdpa
    for the bundled ones), or eager (which transformers CB swaps for its paged eager kernel while a manager lives)."""
    return _pick(draw, force, "caller_attention", {"as-loaded": st.none(), "eager": st.just("eager")},
                 st.sampled_from([None, None, "eager"]))  # fmt: skip


def _batch_tokens(draw, force: dict) -> int:
    return _pick(draw, force, "max_batch_tokens", {"below-a-prompt": st.sampled_from([4, 7]),
                 "above-prompts": st.sampled_from([64, 256])}, st.sampled_from([4, 7, 16, 64, 256]))  # fmt: skip


def _batch_limit(draw, force: dict):
    return _pick(draw, force, "max_requests_per_batch", {"unlimited": st.none(), "binding": st.just(1),
                 "loose": st.just(16)}, st.sampled_from(_BATCH_LIMITS))  # fmt: skip


VLLM_BLOCK = 32  # vLLM-CPU's attention takes block sizes that are multiples of 32
VLLM_MAX_MODEL_LEN = 64  # every drawn request fits: prompts below 40 tokens, completions up to 10


def vllm_config(draw, requests) -> dict:
    """vLLM's scheduler options: sequence and token budgets (chunked prefill on or off; off needs a budget of a whole
    context), prefix caching, and a KV cache from the one block-aligned context vLLM insists on up to thrice what the
    case needs (``kv_blocks``: the driver turns it into ``kv_cache_memory_bytes``), so requests are preempted."""
    chunked = draw(st.booleans())
    seqs = draw(st.sampled_from([1, 2, 4, 16]))
    budgets = [b for b in (16, 32, 64, 512) if b >= seqs and (chunked or b >= VLLM_MAX_MODEL_LEN)]
    floor = -(-VLLM_MAX_MODEL_LEN // VLLM_BLOCK) + 1  # vLLM refuses a cache that cannot hold one whole context
    need = pages_needed(requests, VLLM_BLOCK)
    return dict(
        block_size=VLLM_BLOCK, max_model_len=VLLM_MAX_MODEL_LEN, max_num_seqs=seqs,
        max_num_batched_tokens=draw(st.sampled_from(budgets)), enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        kv_blocks=max(floor, need // 2) + draw(st.sampled_from([0, 1, 2, 3 * need])),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ generate_batch
# top_k at and beyond the vocabulary (no cut), 0 ("no top-k"), unset (the release's default), and real cuts
BATCH_TOP_KS = (None, None, 0, 1, 3, tasks.VOCAB_SIZE, tasks.VOCAB_SIZE + 7)
BATCH_EOS = ("unset", tasks.EOS_ID, [tasks.EOS_ID], [tasks.EOS_ID, tasks.VOCAB["\n"]], [])
# generate()'s options a user may pass to generate_batch as keyword arguments instead of in the config
BATCH_KWARG_FIELDS = ("do_sample", "eos_token_id", "num_return_sequences", "min_new_tokens", "temperature")


@st.composite
def batch_generation(draw, force: dict | None = None) -> dict:
    """A ``GenerationConfig`` as keyword arguments; a key left out is a field left unset. Greedy never asks for more
    than one sequence per input (``GenerationConfig`` itself refuses that). ``force``: values of
    ``cbverify.fuzz.coverage.batch_space`` options drawn as given."""
    force = force or {}
    g: dict = {}
    sampled = _pick(
        draw,
        force,
        "do_sample",
        {"true": st.just(True), "false": st.just(False), "unset": st.none()},
        st.sampled_from([True, False, None]),
    )  # None: unset (greedy by default)
    if sampled is not None:
        g["do_sample"] = sampled
    eos = _pick(draw, force, "eos_token_id", {"unset": st.just("unset"), "int": st.just(BATCH_EOS[1]),
                "list": st.sampled_from(BATCH_EOS[2:4]), "none": st.just([])}, st.sampled_from(BATCH_EOS))  # fmt: skip
    if eos != "unset":
        g["eos_token_id"] = eos
    if draw(st.booleans()):
        g["max_new_tokens"] = draw(st.integers(1, 10))
    if sampled:
        cuts = [k for k in BATCH_TOP_KS if k and k < tasks.VOCAB_SIZE]
        g.update(
            num_return_sequences=_pick(draw, force, "num_return_sequences", {"1": st.sampled_from([None, 1]),
                "2": st.just(2), "3": st.just(3)}, st.sampled_from([None, 1, 2, 3])),
            temperature=_pick(draw, force, "temperature", {"1.0": st.sampled_from([None, 1.0]),
                "other": st.sampled_from([0.7, 1.5])}, st.sampled_from([None, 0.7, 1.0, 1.5])),
            top_k=_pick(draw, force, "top_k", {"unset": st.none(), "0": st.just(0), "cut": st.sampled_from(cuts),
                "beyond-vocab": st.sampled_from([k for k in BATCH_TOP_KS if k and k >= tasks.VOCAB_SIZE])},
                st.sampled_from(BATCH_TOP_KS)),
            top_p=_pick(draw, force, "top_p", {"unset-or-1": st.sampled_from([None, 1.0]), "below-1": st.just(0.8)},
                        st.sampled_from([None, 0.8, 1.0])),
            min_p=_pick(draw, force, "min_p", {"unset": st.none(), "above-0": st.just(0.1)},
                        st.sampled_from([None, None, 0.1])),
        )  # fmt: skip
    minimum = force.get("minimum_length")
    g.update(
        min_length=draw(st.sampled_from([12, 30])) if minimum == "min_length" else None if minimum == "off" else draw(
            st.sampled_from([None, None, None, 4, 12, 30])),
        min_new_tokens=draw(st.sampled_from([2, 6])) if minimum == "min_new_tokens" else None if minimum else draw(
            st.sampled_from([None, None, None, 2, 6])),
        no_repeat_ngram_size=_pick(draw, force, "no_repeat_ngram_size", {"off": st.none(), "on": st.integers(1, 3)},
                                   st.sampled_from([None] * 6 + [1, 2, 3])),
        repetition_penalty=_pick(draw, force, "repetition_penalty", {"off": st.none(), "on": st.just(1.3)},
                                 st.sampled_from([None, None, None, 1.3])),
    )  # fmt: skip
    return {k: v for k, v in g.items() if v is not None}


def batch_options(draw, generation: dict, moved: str | None) -> dict:
    """``generate_batch``'s keyword arguments: ``max_new_tokens`` (always when the config has none, else sometimes),
    and ``moved``, the generation option passed there instead of in the config (``generation`` loses it)."""
    options = {}
    if "max_new_tokens" not in generation or draw(st.booleans()):
        options["max_new_tokens"] = draw(st.integers(1, 10))
    if moved in generation:
        options[moved] = generation.pop(moved)
    return options


def _batch_prompts(draw, call: int, earlier: list[tuple[int, ...]], max_prompt_len: int = 40,
                   force: dict | None = None) -> list[tuple[int, ...]]:  # fmt: skip
    """1-3 prompts (each repeated 1-2 times, as TRL repeats a GRPO group's prompt); after the first call a prompt
    may be an earlier call's, or an earlier prompt's head (a common system prompt) with a new tail. ``force``: the
    layout's ``distinct_prompts`` and ``repeated_input`` (the first prompt repeated)."""
    force = force or {}
    out = []
    count = _pick(draw, force, "distinct_prompts", {"one": st.just(1), "several": st.integers(2, 3)},
                  st.integers(1, 3))  # fmt: skip
    for i in range(count):
        kind = draw(st.sampled_from(["fresh", "fresh", "again", "head"])) if earlier else "fresh"
        if kind == "again":
            prompt = draw(st.sampled_from(earlier))
        else:
            head = draw(st.sampled_from(earlier))[: draw(st.integers(1, 16))] if kind == "head" else (tasks.BOS_ID,)
            n = draw(st.integers(1, max_prompt_len - len(head)))
            prompt = (*head, *draw(st.lists(st.integers(3, tasks.VOCAB_SIZE - 1), min_size=n, max_size=n)))
        if any(prompt == q for q in out):  # a drawn repeat of an earlier prompt of this call is a repeated input
            prompt = (*prompt, 3)[:max_prompt_len] if len(prompt) < max_prompt_len else prompt[:-1]
        repeats = {"no": st.just(1), "yes": st.just(2) if i == 0 else st.integers(1, 2)}
        out += [prompt] * _pick(draw, force, "repeated_input", repeats, st.integers(1, 2))
    return out


@st.composite
def batch_cases(draw, *, model: str = "tiny-llama-arith", force: dict | None = None) -> FuzzCase:
    """A ``generate_batch`` program: a ``GenerationConfig``, a ``ContinuousBatchingConfig`` and 1-3 calls, with or
    without ``persistent_manager`` (the release has it: ``transformers_compat.BATCH_PARAMETERS``), a training step or
    weight update between calls (beside the idle cached manager, or inside its ``pause()`` where the release has
    one), and on a persistent manager sometimes a different config for a later call. ``force``: values of
    ``cbverify.fuzz.coverage.batch_space`` options drawn as given (the first config's and every call's layout)."""
    force = force or {}
    generation = draw(batch_generation(force))
    moved = draw(st.sampled_from([None] * 5 + list(BATCH_KWARG_FIELDS)))  # passed as a keyword by every call
    persistent = "persistent_manager" in compat.BATCH_PARAMETERS and _pick(
        draw, force, "persistent_manager", {"true": st.just(True), "false": st.just(False)}, st.booleans()
    )
    where = force.get("plain_forward")  # where the caller's plain forwards run (cbverify.fuzz.coverage)
    if where is not None:
        persistent = where != "no-manager-left" and "persistent_manager" in compat.BATCH_PARAMETERS
    in_pause = where == "inside-pause" and persistent and compat.CAN_PAUSE
    steps, earlier, first = [], [], None
    for call in range(draw(st.integers(2, 3) if in_pause else st.integers(1, 3))):
        if call:
            forced = in_pause and call == 1
            between = draw(st.sampled_from(["train", "update_weights"] if forced else ["none", "train",
                                                                                      "update_weights"]))  # fmt: skip
            if between != "none":
                paused = forced or (persistent and compat.CAN_PAUSE and draw(st.booleans()))
                steps.append(Step(between, seed=draw(st.integers(0, 2**16)), paused=paused))
        own = draw(batch_generation()) if call and persistent and draw(st.integers(0, 5)) == 0 else None
        config = dict(generation if own is None else own)
        options = batch_options(draw, config, moved)
        first = config if first is None else first
        prompts = _batch_prompts(draw, call, earlier, force=force)
        earlier += prompts
        max_new = options.get("max_new_tokens", config.get("max_new_tokens"))
        inputs = tuple(FuzzRequest(f"c{call}-i{j}", p, max_new, ()) for j, p in enumerate(prompts))
        steps.append(Step("call", inputs, generation=config if config != first else None, options=options))
    generation = first
    requests = [r for s in steps for r in s.requests]
    page = draw(st.sampled_from([4, 8, 16]))
    need = pages_needed(requests, page)
    config = dict(
        page_size=page, num_blocks=need + draw(st.sampled_from([0, 1, 2, 4, 3 * need])),
        max_batch_tokens=_batch_tokens(draw, force),
        scheduler_type=draw(st.sampled_from(["fifo", "prefill_first"])),
        allow_block_sharing=draw(st.sampled_from([True, False, None])),
        max_requests_per_batch=_batch_limit(draw, force), return_logprobs=draw(st.booleans()),
        per_request_processors=draw(st.booleans()),
    )  # fmt: skip
    if compat.has("seed"):
        config["seed"] = draw(st.integers(0, 2**31 - 1))
    config = {k: v for k, v in config.items() if v is not None}
    return FuzzCase("transformers-cb", model, persistent, config, generation, tuple(steps),
                    caller_training=draw(st.booleans()), entry="generate_batch",
                    caller_attn=_caller_attn(draw, force))  # fmt: skip
