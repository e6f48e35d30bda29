"""Options in pairs for the transformers CB fuzz (:mod:`cbverify.pairs`): the options of each entry point grouped by
the quantity they act on, and what each case really did, read as labels.

- **the sampler** (the processed distribution a token is drawn from): temperature, top-k, top-p, min-p, the
  repetition penalty, and the EOS mask of a minimum length; for ``generate_batch`` also the n-gram ban. A value that
  only means something while sampling is counted only where the call samples, a top-k only where it cuts (below the
  vocabulary), ``min_length`` only where it reaches beyond a prompt and ``min_new_tokens`` does not override it.
- **the batch layout** (how a call's sequences are laid out in the manager's steps): several samples of one prompt
  (the manager: a GRPO group; ``generate_batch``: ``num_return_sequences`` > 1 and an input repeated, as TRL does),
  several prompts in a call, a step budget below a prompt (chunked prefill), ``max_requests_per_batch`` below the
  call's sequences. Processes are no option of a CB manager (``outside``).
- **where the caller's plain forwards run** (a single, in no pair: :func:`plain_forward_option`): after a call whose
  manager is gone, beside a persistent manager between calls, inside its ``pause()`` (releases with one); and the
  attention implementation the caller set (``caller_attention``: the checkpoint's as loaded, or eager).

A unit is what options act on together: for the manager's sampler a request (each carries its own temperature /
top-k / top-p) with its call's layout; for ``generate_batch`` a call (one resolved ``GenerationConfig`` for all its
inputs: :func:`cbverify.fuzz.batch_judge.intent`). A value in a unit is what the call resolved to, not what the drawing
asked for: a keyword the release swallows still counts (``intent`` reads the documented precedence; the engine's
failure to honour it is a finding, not a gap in coverage).
"""

from __future__ import annotations

from cbverify.engines import transformers_compat as compat
from cbverify.pairs import MIN_SHARE, Group, Option, PairSpace
from reference import tasks

SAMPLING = (("do_sample", "true"),)
PER_REQUEST = (("do_sample", "true"), ("per_request_processors", "true"))
__all__ = ["MIN_SHARE", "batch_space", "batch_units", "entry_space", "manager_space", "manager_units",
           "plain_forward_labels", "plain_forward_option"]  # fmt: skip
OUTSIDE = (("processes", "a continuous-batching manager serves one process; no option of its entry points"),)


def plain_forward_option(persistent: str | None) -> Option:
    """Where the caller's plain forwards run beside CB (:class:`cbverify.fuzz.drivers.PlainForwards`): after a call
    whose manager is gone (``no-manager-left``), beside a persistent manager between calls (``beside-a-manager``:
    the manager's running idle loop, or ``generate_batch``'s cached one), inside its ``pause()`` during a training step
    or weight update between calls (``inside-pause``, releases with ``pause()``). ``persistent``: the option that
    makes a manager persistent in this space (``None``: the strategy forces it itself)."""
    values = ("no-manager-left", "beside-a-manager") + (("inside-pause",) if compat.CAN_PAUSE else ())
    if persistent is None:
        return Option("plain_forward", values)
    needs = {"no-manager-left": "false", "beside-a-manager": "true", "inside-pause": "true"}
    return Option("plain_forward", values, (), tuple((v, ((persistent, needs[v]),)) for v in values))


CALLER_ATTENTION = Option("caller_attention", ("as-loaded", "eager"))  # the attention implementation the caller set


def plain_forward_labels(case, ran: int | None = None) -> list[set[str]]:
    """Per call that ran, where the plain forwards made with it ran (after the call, and in the step before it), and
    the attention implementation the caller set."""
    attn = f"caller_attention={'eager' if case.caller_attn == 'eager' else 'as-loaded'}"
    labels, step_label = [], None
    persistent = case.persistent
    calls = 0
    for s in case.steps:
        if ran is not None and calls >= ran:
            break
        if s.kind != "call":
            paused = persistent and compat.CAN_PAUSE and (case.entry == "manager" or s.paused)
            step_label = "inside-pause" if paused else "beside-a-manager" if persistent else "no-manager-left"
            continue
        calls += 1
        here = {f"plain_forward={'beside-a-manager' if persistent else 'no-manager-left'}"}
        labels.append(here | {attn} | ({f"plain_forward={step_label}"} if step_label else set()))
        step_label = None
    return labels


def _limits() -> tuple[str, ...]:
    return ("unlimited", "binding", "loose") if compat.has("max_requests_per_batch") else ("unlimited",)


def _layout(samples: str) -> Group:
    limits = _limits()
    return Group("batch layout", (
        Option(samples, ("one", "several"), ("several",)),
        Option("distinct_prompts", ("one", "several"), ("several",)),
        Option("max_batch_tokens", ("above-prompts", "below-a-prompt"), ("below-a-prompt",)),
        Option("max_requests_per_batch", limits, ("binding",) if "binding" in limits else ()),
    ))  # fmt: skip


def manager_space() -> PairSpace:
    """The manager entry (``fuzz_cases`` for transformers CB): per-request temperature / top-k / top-p exist only with
    ``per_request_processors`` (else every request samples at 1.0 uncut), min-p and the penalty are manager-wide."""
    return PairSpace(
        "transformers-cb manager",
        (
            Group("sampler", (
                Option("temperature", ("1.0", "other"), ("other",),
                       (("1.0", SAMPLING), ("other", PER_REQUEST))),
                Option("top_k", ("unset", "0", "cut"), ("cut",),
                       (("unset", SAMPLING), ("0", PER_REQUEST), ("cut", PER_REQUEST))),
                Option("top_p", ("unset-or-1", "below-1"), ("below-1",),
                       (("unset-or-1", SAMPLING), ("below-1", PER_REQUEST))),
                Option("min_p", ("unset", "above-0"), ("above-0",), (("unset", SAMPLING), ("above-0", SAMPLING))),
                Option("repetition_penalty", ("off", "on"), ("on",)),
                Option("min_new_tokens", ("off", "on"), ("on",)),
            )),
            _layout("samples_per_prompt"),
        ),
        singles=(Option("do_sample", ("true", "false")), Option("per_request_processors", ("true", "false")),
                 plain_forward_option(None), CALLER_ATTENTION),
        outside=OUTSIDE,
    )  # fmt: skip


def batch_space() -> PairSpace:
    """The ``generate_batch`` entry (``batch_cases``): every generation option in one ``GenerationConfig`` per call;
    single values also for how it was passed (``do_sample`` unset, ``top_k`` unset / 0 / beyond the vocabulary, the
    EOS forms)."""
    singles = [Option("do_sample", ("true", "false", "unset")),
               Option("eos_token_id", ("unset", "int", "list", "none")), CALLER_ATTENTION]  # fmt: skip
    if "persistent_manager" in compat.BATCH_PARAMETERS:
        singles += [Option("persistent_manager", ("true", "false")), plain_forward_option("persistent_manager")]
    else:  # one manager per call: the plain forwards run after it is gone
        singles.append(Option("plain_forward", ("no-manager-left",)))
    return PairSpace(
        "transformers-cb generate_batch",
        (
            Group("sampler", (
                Option("temperature", ("1.0", "other"), ("other",), (("1.0", SAMPLING), ("other", SAMPLING))),
                Option("top_k", ("unset", "0", "cut", "beyond-vocab"), ("cut",),
                       tuple((v, SAMPLING) for v in ("unset", "0", "cut", "beyond-vocab"))),
                Option("top_p", ("unset-or-1", "below-1"), ("below-1",),
                       (("unset-or-1", SAMPLING), ("below-1", SAMPLING))),
                Option("min_p", ("unset", "above-0"), ("above-0",), (("unset", SAMPLING), ("above-0", SAMPLING))),
                Option("repetition_penalty", ("off", "on"), ("on",)),
                Option("no_repeat_ngram_size", ("off", "on"), ("on",)),
                Option("minimum_length", ("off", "min_new_tokens", "min_length"), ("min_new_tokens", "min_length")),
            )),
            Group(_layout("num_return_sequences").quantity, (
                Option("num_return_sequences", ("1", "2", "3"), ("2", "3"), (("2", SAMPLING), ("3", SAMPLING))),
                Option("repeated_input", ("no", "yes"), ("yes",)),
                *_layout("num_return_sequences").options[1:],
            )),
        ),
        singles=tuple(singles),
        outside=OUTSIDE,
    )  # fmt: skip


def _call_layout(case, prompts: list[tuple[int, ...]], sequences: int) -> set[str]:
    c = case.config
    budget, limit = c.get("max_batch_tokens"), c.get("max_requests_per_batch")
    out = {f"distinct_prompts={'several' if len(set(prompts)) > 1 else 'one'}"}
    chunked = budget and any(len(p) > budget for p in prompts)
    out.add(f"max_batch_tokens={'below-a-prompt' if chunked else 'above-prompts'}")
    if "max_requests_per_batch" in c or compat.has("max_requests_per_batch"):
        kind = "unlimited" if not limit else "binding" if limit < sequences else "loose"
        out.add(f"max_requests_per_batch={kind}")
    return out


def manager_units(case, ran: int | None = None) -> list[set[str]]:
    """One label set per request of a manager case (its own sampling, the manager's options, its call's layout),
    over the first ``ran`` calls (all by default: a crash outside a call ends the program)."""
    g, c = case.generation, case.config
    sampled = bool(g.get("do_sample"))
    per_request = bool(c.get("per_request_processors"))
    common = {f"do_sample={str(sampled).lower()}", f"per_request_processors={str(per_request).lower()}",
              f"repetition_penalty={'on' if g.get('repetition_penalty') not in (None, 1.0) else 'off'}",
              f"min_new_tokens={'on' if g.get('min_new_tokens') else 'off'}"}  # fmt: skip
    if sampled:
        common.add(f"min_p={'above-0' if g.get('min_p') else 'unset'}")
    units = []
    plain = plain_forward_labels(case, ran)
    for k, step in enumerate(case.calls[: len(case.calls) if ran is None else ran]):
        prompts = [r.prompt_ids for r in step.requests]
        layout = _call_layout(case, prompts, len(prompts)) | plain[k]
        layout.add(f"samples_per_prompt={'several' if len(prompts) > len(set(prompts)) else 'one'}")
        for r in step.requests:
            labels = common | layout
            if sampled:
                labels.add(f"temperature={'1.0' if r.temperature == 1.0 else 'other'}")
                labels.add("top_k=" + ("unset" if r.top_k is None else "0" if r.top_k == 0 else "cut"
                                       if r.top_k < tasks.VOCAB_SIZE else "unset"))  # fmt: skip
                labels.add(f"top_p={'below-1' if r.top_p is not None and r.top_p < 1.0 else 'unset-or-1'}")
            units.append(labels)
    return units


def batch_units(case, wants: list, ran: int | None = None) -> list[set[str]]:
    """One label set per ``generate_batch`` call that ran: ``wants`` holds each call's resolved :class:`Intent`
    (``batch_judge.intent``), in call order; ``ran``: how many calls ran (all by default; a crash ends a program)."""
    calls = case.calls[: len(case.calls) if ran is None else ran]
    if len(wants) != len(calls):
        raise ValueError(f"batch_units: {len(wants)} resolved configs for {len(calls)} calls")
    units = []
    plain = plain_forward_labels(case, len(calls))
    for k, (step, want) in enumerate(zip(calls, wants, strict=True)):
        passed = {**case.generation_of(step), **step.options}
        prompts = [r.prompt_ids for r in step.requests]
        labels = _call_layout(case, prompts, len(prompts) * want.num_return_sequences) | plain[k]
        labels.add(f"repeated_input={'yes' if len(prompts) > len(set(prompts)) else 'no'}")
        labels.add(f"num_return_sequences={min(3, want.num_return_sequences)}")
        ds = passed.get("do_sample")
        labels.add(f"do_sample={'unset' if ds is None else str(bool(ds)).lower()}")
        eos = passed.get("eos_token_id", "unset")
        labels.add("eos_token_id=" + ("unset" if eos == "unset" else "none" if eos == [] else "list"
                                      if isinstance(eos, list) else "int"))  # fmt: skip
        if "persistent_manager" in compat.BATCH_PARAMETERS:
            labels.add(f"persistent_manager={str(case.persistent).lower()}")
        labels.add(f"repetition_penalty={'on' if want.repetition_penalty != 1.0 else 'off'}")
        labels.add(f"no_repeat_ngram_size={'on' if want.no_repeat_ngram_size > 0 else 'off'}")
        if want.min_new_tokens:
            labels.add("minimum_length=min_new_tokens")
        elif want.min_new_tokens is None and any(want.min_length > len(p) for p in prompts):
            labels.add("minimum_length=min_length")
        elif not want.min_new_tokens and not passed.get("min_length"):
            labels.add("minimum_length=off")
        if want.do_sample:
            labels.add(f"temperature={'1.0' if want.temperature == 1.0 else 'other'}")
            k = passed.get("top_k")
            cuts = 0 < want.top_k < tasks.VOCAB_SIZE
            labels.add("top_k=" + ("unset" if k is None else "0" if k == 0 else "cut" if cuts else "beyond-vocab"))
            labels.add(f"top_p={'below-1' if want.top_p < 1.0 else 'unset-or-1'}")
            labels.add(f"min_p={'above-0' if want.min_p > 0 else 'unset'}")
        units.append(labels)
    return units


def entry_space(engine: str, entry: str) -> PairSpace | None:
    """The pair space of an engine's entry point (transformers CB only; None for the others)."""
    if engine != "transformers-cb":
        return None
    return batch_space() if entry == "generate_batch" else manager_space()
