"""Hypothesis strategies: plural-noun ``@st.composite`` functions with keyword-only bounds.

Every model-backed property draws its scenario from here, so a failing example prints as a complete repro. The one
exception is the fuzzer's: ``cbverify fuzz`` draws from them itself, so they live in ``cbverify.fuzz.strategies``.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from reference import tasks
from reference.spec import MAX_SEED, RolloutRequest, SamplingParams


@st.composite
def sampling_params(
    draw,
    *,
    greedy: bool | None = None,
    max_new_tokens: tuple[int, int] = (1, 24),
    processors: bool = True,
) -> SamplingParams:
    """Greedy or sampled parameters; with ``processors`` also top-k / top-p / min-p in their valid ranges."""
    is_greedy = draw(st.booleans()) if greedy is None else greedy
    temperature = 0.0 if is_greedy else draw(st.sampled_from([0.3, 0.7, 1.0, 1.5]))
    top_k = draw(st.sampled_from([0, 0, 1, 3, 10])) if processors else 0
    top_p = draw(st.sampled_from([1.0, 1.0, 0.95, 0.8, 0.5])) if processors else 1.0
    min_p = draw(st.sampled_from([0.0, 0.0, 0.05, 0.2])) if processors else 0.0
    return SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        max_new_tokens=draw(st.integers(*max_new_tokens)),
    )  # fmt: skip


@st.composite
def prompt_ids_lists(draw, *, min_len: int = 1, max_len: int = 40, arith: bool | None = None) -> list[int]:
    """A prompt: either an arithmetic question (BOS + text) or arbitrary in-vocabulary character ids."""
    use_arith = draw(st.booleans()) if arith is None else arith
    if use_arith:
        problem = tasks.make_problems(1, seed=draw(st.integers(0, 10**6)))[0]
        ids = tasks.prompt_ids(problem)
        return ids[:max_len] if len(ids) > max_len else ids
    body = draw(st.lists(st.integers(3, len(tasks.VOCAB) - 1), min_size=max(0, min_len - 1), max_size=max_len - 1))
    return [tasks.BOS_ID, *body]


@st.composite
def rollout_requests(
    draw,
    *,
    min_requests: int = 1,
    max_requests: int = 6,
    max_prompt_len: int = 40,
    max_new_tokens: tuple[int, int] = (1, 24),
    greedy: bool | None = None,
    processors: bool = True,
    group_size: tuple[int, int] = (1, 1),
) -> list[RolloutRequest]:
    """A batch of requests with unique ids; each prompt is repeated ``group_size`` times (a GRPO group) with
    distinct seeds. Per-request sampling parameters, seeds and EOS sets vary."""
    num_prompts = draw(st.integers(min_requests, max_requests))
    requests: list[RolloutRequest] = []
    for p in range(num_prompts):
        prompt = draw(prompt_ids_lists(max_len=max_prompt_len))
        for g in range(draw(st.integers(*group_size))):
            eos = draw(st.sampled_from([(tasks.EOS_ID,), (tasks.EOS_ID,), (tasks.EOS_ID, tasks.VOCAB["\n"]), ()]))
            requests.append(
                RolloutRequest(
                    request_id=f"p{p}-g{g}",
                    prompt_ids=tuple(prompt),
                    sampling=draw(
                        sampling_params(greedy=greedy, max_new_tokens=max_new_tokens, processors=processors)
                    ),
                    seed=draw(st.integers(0, MAX_SEED)),
                    eos_token_ids=eos,
                )
            )
    return requests


@st.composite
def grpo_batches(
    draw,
    *,
    max_prompts: int = 3,
    max_generations: int = 4,
    max_len: int = 6,
    nan_rewards: bool = True,
    unscored_tokens: bool = True,
    empty_rows: bool = True,
    max_log_ratio: float = 6.0,
) -> dict:
    """A padded GRPO micro-batch as TRL's loss sees it, drawn in float64.

    Keys: ``num_generations``; ``rewards`` (B,) with NaN for unscorable completions when ``nan_rewards``;
    ``completion_mask`` (B, T) int64 (right padding, rows may be empty when ``empty_rows``, at least one token
    overall);
    ``per_token_logps``, ``old_per_token_logps``, ``ref_per_token_logps`` (B, T) float64, log-ratios up to
    ``max_log_ratio`` in size; ``sampling_per_token_logps`` (B, T), every value float32-representable (engines report
    float32) and, when ``unscored_tokens``, NaN at a few real tokens (tokens the engine could not score). Padded
    positions hold junk values.
    """
    import torch

    num_generations = draw(st.integers(1, max_generations))
    batch = num_generations * draw(st.integers(1, max_prompts))
    lengths = draw(
        st.lists(st.integers(0 if empty_rows else 1, max_len), min_size=batch, max_size=batch).filter(
            lambda xs: max(xs) > 0
        )
    )
    width = max(lengths)
    shape = (batch, width)
    mask = torch.tensor([[1 if t < n else 0 for t in range(width)] for n in lengths], dtype=torch.int64)

    def floats(lo: float, hi: float) -> torch.Tensor:
        values = draw(st.lists(st.floats(lo, hi, width=32), min_size=batch * width, max_size=batch * width))
        return torch.tensor(values, dtype=torch.float64).reshape(shape)

    per = floats(-8.0, 0.0)
    old = per + floats(-max_log_ratio, max_log_ratio) * draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    ref = per + floats(-max_log_ratio, max_log_ratio) * draw(st.sampled_from([0.0, 0.1, 1.0]))
    sampling = old + floats(-max_log_ratio, max_log_ratio) * draw(st.sampled_from([0.0, 0.02, 0.3, 1.0]))
    sampling = sampling.to(torch.float32).to(torch.float64)  # what an engine's float32 log-probs look like
    if unscored_tokens and draw(st.booleans()):
        unscored = torch.tensor(draw(st.lists(st.booleans(), min_size=batch * width, max_size=batch * width)))
        sampling = sampling.masked_fill(unscored.reshape(shape) & (mask == 1), float("nan"))
    reward_values = st.sampled_from([0.0, 1.0, 1.0, 0.5]) | st.floats(-3.0, 3.0, width=32)
    if nan_rewards:
        reward_values = reward_values | st.just(float("nan"))
    rewards = torch.tensor(draw(st.lists(reward_values, min_size=batch, max_size=batch)), dtype=torch.float64)
    return {
        "num_generations": num_generations, "rewards": rewards, "completion_mask": mask, "per_token_logps": per,
        "old_per_token_logps": old, "ref_per_token_logps": ref, "sampling_per_token_logps": sampling,
    }  # fmt: skip


@st.composite
def loss_configs(
    draw, *, loss_types: tuple[str, ...] | None = None, is_correction: bool | None = None, is_clip_min: bool = True
):
    """A ``reference.loss.LossConfig`` covering every loss type, IS level, IS correction mode and clip bound (a lower
    IS bound only when ``is_clip_min``)."""
    from reference.loss import IS_MODES, LOSS_TYPES, LossConfig

    loss_type = draw(st.sampled_from(loss_types or LOSS_TYPES))
    epsilon_low = draw(st.sampled_from([0.1, 0.2, 0.3]))
    if loss_type == "cispo":
        epsilon_high = draw(st.sampled_from([0.8, 1.5, 5.0]))  # cispo: an upper bound on the ratio itself
    else:
        epsilon_high = draw(st.sampled_from([None, 0.28, 0.5]))
    use_is = draw(st.booleans()) if is_correction is None else is_correction
    mode = draw(st.sampled_from(IS_MODES)) if use_is else None
    clip_min = draw(st.sampled_from([None, 0.0, 0.2, 0.5] if is_clip_min else [None]))
    clip_max = draw(st.sampled_from([None, 2.0, 3.0] if clip_min is not None else [2.0, 3.0, 10.0]))
    return LossConfig(
        loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
        delta=draw(st.sampled_from([None, None, 1.5, 3.0])), beta=draw(st.sampled_from([0.0, 0.0, 0.04, 0.5])),
        importance_sampling_level=draw(st.sampled_from(["token", "sequence"])),
        use_bias_correction_kl=draw(st.booleans()), is_correction=mode, is_clip_min=clip_min, is_clip_max=clip_max,
        max_completion_length=draw(st.integers(6, 16)) if loss_type == "dr_grpo" else None,
    )  # fmt: skip


@st.composite
def engine_configurations(draw, *, engine: str, max_sequence_len: int = 64) -> dict:
    """Constructor options for ``cbverify.engines.get_engine(engine, model, **options)``, small enough for CPU.

    ``cb_impl``: any block size, a cache that holds at least one ``max_sequence_len`` sequence (so tight caches force
    preemption instead of failing), batch-token budgets down to 8 (chunked prefill), 1-256 running sequences, prefix
    sharing on/off. ``transformers-cb``: page size and batch-token budget. ``hf-generate``: batch size and RNG seed.
    """
    if engine == "cb_impl":
        block_size = draw(st.sampled_from([1, 2, 4, 16]))
        min_blocks = -(-max_sequence_len // block_size) + 1
        return dict(
            block_size=block_size, num_blocks=min_blocks + draw(st.integers(0, 3 * min_blocks)),
            max_batch_tokens=draw(st.sampled_from([8, 16, 64, 512])), max_num_seqs=draw(st.sampled_from([1, 2, 256])),
            enable_prefix_sharing=draw(st.booleans()),
        )  # fmt: skip
    if engine == "transformers-cb":
        return dict(
            page_size=draw(st.sampled_from([8, 16, 32])), max_batch_tokens=draw(st.sampled_from([32, 64, 256])),
            seed=draw(st.integers(0, 2**31 - 1)),
        )  # fmt: skip
    if engine == "hf-generate":
        return dict(max_batch_size=draw(st.sampled_from([None, 1, 2])), seed=draw(st.integers(0, 2**31 - 1)))
    if engine == "reference":
        return {}
    raise ValueError(f"no configurations for engine {engine!r}")


@st.composite
def length_dists(draw, *, max_hi: int = 256):
    """A clipped-lognormal length distribution for ``cbverify.bench.workloads`` (1 <= lo <= median <= hi <= max_hi)."""
    from cbverify.bench.workloads import LengthDist

    lo = draw(st.integers(1, max_hi))
    median = draw(st.integers(lo, max_hi))
    hi = draw(st.integers(median, max_hi))
    return LengthDist(median, draw(st.sampled_from([0.0, 0.1, 0.55, 1.5])), lo, hi)


@st.composite
def bench_workloads(draw, *, max_generations: int = 8, max_prompts: int = 3, max_len: int = 24):
    """A small random-prompt bench ``Workload`` (gsm8k-like or uniform shape) with drawn sizes and seed."""
    from cbverify.bench.workloads import Workload

    completion = draw(length_dists(max_hi=max_len))
    return Workload(
        name=draw(st.sampled_from(["gsm8k-like", "uniform"])), num_prompts=draw(st.integers(1, max_prompts)),
        num_generations=draw(st.integers(1, max_generations)), prompt_len=draw(length_dists(max_hi=max_len)),
        completion_len=completion, max_new_tokens=draw(st.integers(completion.hi, max_len)),
        temperature=draw(st.sampled_from([0.0, 1.0])), seed=draw(st.integers(0, 2**31)),
    )  # fmt: skip


@st.composite
def cb_arrival_plans(
    draw, *, requests: list[RolloutRequest], max_arrival_step: int = 6, tight_memory: bool | None = None
) -> tuple[dict, list[int], list[int]]:
    """How ``cb_impl`` meets ``requests``: ``(EngineConfig kwargs, arrival order, arrival step of each arrival)``.

    Block sizes 1-16, batch-token budgets down to 2 (chunked prefill), 1-256 seats, prefix sharing on/off, and a
    memory budget from exactly one longest sequence (forces preemption) to plenty. Arrivals are a permutation of
    the requests, each added at a non-decreasing engine step (0 = before the first step).
    """
    block_size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    need = max(-(-(len(r.prompt_ids) + r.sampling.max_new_tokens - 1) // block_size) for r in requests)
    tight = draw(st.booleans()) if tight_memory is None else tight_memory
    slack = draw(st.integers(0, 2)) if tight else draw(st.integers(need, 4 * need))
    config = dict(
        block_size=block_size, num_blocks=need + slack,
        max_batch_tokens=draw(st.sampled_from([2, 5, 16, 512])), max_num_seqs=draw(st.sampled_from([1, 2, 3, 256])),
        enable_prefix_sharing=draw(st.booleans()),
    )  # fmt: skip
    order = draw(st.permutations(range(len(requests))))
    steps = sorted(draw(st.lists(st.integers(0, max_arrival_step), min_size=len(requests), max_size=len(requests))))
    return config, list(order), steps


@st.composite
def trainer_scenarios(
    draw,
    *,
    paths: tuple[str, ...] = ("generate", "cb", "rollout_func"),
    bf16: bool | None = False,
    greedy: bool | None = None,
    max_completion_length: tuple[int, int] = (1, 8),
    max_steps: tuple[int, int] = (1, 1),
):
    """A ``cbverify.upstream.scenario.TrainerScenario``: a small TRL trainer run on one generation path with drawn
    group size, lengths, sampling options, loss type, IS level/correction and gradient accumulation.

    RLOO is drawn only for the paths it offers (not ``rollout_func``); the rollout_func backend is ``cb_impl``'s
    adapter or the reference generator; loss types are the reference's that the installed TRL has."""
    from cbverify.upstream import trl_compat
    from cbverify.upstream.scenario import TrainerScenario
    from reference.loss import LOSS_TYPES

    path = draw(st.sampled_from(paths))
    is_greedy = draw(st.booleans()) if greedy is None else greedy
    trainer = "grpo" if path == "rollout_func" else draw(st.sampled_from(["grpo", "grpo", "rloo"]))
    return TrainerScenario(
        path=path, trainer=trainer, num_generations=draw(st.integers(2, 3)), num_prompts=draw(st.integers(1, 2)),
        max_completion_length=draw(st.integers(*max_completion_length)),
        temperature=draw(st.sampled_from([0.7, 1.0, 1.3])), top_k=draw(st.sampled_from([0, 0, 3])),
        top_p=draw(st.sampled_from([1.0, 1.0, 0.8])), min_p=draw(st.sampled_from([0.0, 0.0, 0.2])), greedy=is_greedy,
        bf16=draw(st.booleans()) if bf16 is None else bf16,
        gradient_accumulation_steps=draw(st.integers(1, 2)),
        loss_type=draw(st.sampled_from([t for t in LOSS_TYPES if t in trl_compat.loss_types()])),
        importance_sampling_level=draw(st.sampled_from(["token", "sequence"])),
        is_correction=draw(st.booleans()), is_mode=draw(st.sampled_from(["sequence_mask", "token_truncate"])),
        max_steps=draw(st.integers(*max_steps)), seed=draw(st.integers(0, 2**16)),
        rollout_backend=draw(st.sampled_from(["reference", "cb_impl"])),
    )  # fmt: skip


def trainer_pair_plan(loss_types: tuple[str, ...], *, drop=()):
    """The drawing plan of the GRPO step property (``cbverify.pairs``): its covering rows and the value rows that
    :func:`planned_trainer_configs` turns into explicit examples. ``drop``: pairs left out of every row (to watch the
    coverage report name them)."""
    from cbverify.pairs import Plan, trainer_space

    return Plan.of(trainer_space(loss_types), drop=drop)


def planned_trainer_configs(loss_types: tuple[str, ...], examples: int, *, max_steps: int = 3, drop=()) -> list:
    """The explicit examples of a run of ``examples`` drawn configurations: one per covering row of
    :func:`trainer_pair_plan` (the simplest configuration ``trainer_configs`` draws with that row's values forced:
    Hypothesis' ``find``, deterministic, cheap to train), so every pair of the trainer space is set together in some
    example of every run; then a seeded draw per value row for half of ``examples`` (the other half stays free)."""
    from hypothesis import Phase, find, settings

    from cbverify.pairs import concrete

    plan = trainer_pair_plan(loss_types, drop=drop)
    quiet = settings(database=None, phases=[Phase.generate, Phase.shrink], max_examples=10, derandomize=True)
    cover = [find(trainer_configs(loss_types=loss_types, max_steps=max_steps, force=row), lambda _: True,
                  settings=quiet) for row in plan.cover]  # fmt: skip
    walked = plan.rows(len(plan.cover) + examples)[len(plan.cover) :]
    return cover + [concrete(trainer_configs(loss_types=loss_types, max_steps=max_steps, force=row), k)
                    for k, row in enumerate(walked)]  # fmt: skip


@st.composite
def trainer_configs(draw, *, loss_types: tuple[str, ...], max_steps: int = 3, trainer: str = "grpo",
                    force: dict | None = None):  # fmt: skip
    """A ``TrainerScenario`` for the step checks (``cbverify.upstream.steps``): GRPO on the oracle's ``rollout_func``
    with every ``GRPOConfig`` field that changes the math or its bookkeeping drawn: loss type, beta, clipping,
    importance-sampling level, iterations, generation and accumulation steps (equal and different), batch and group
    sizes, completion length with truncation masking (2-operand prompts: some completions end on EOS within the
    drawn length, some are cut), the sampler (temperature, top-k, top-p, min-p), reward scaling, several reward
    functions (some returning ``None`` for some or all rows) with weights, the entropy mask, gradient clipping and
    the IS-correction fields (inert without vLLM). ``trainer="rloo"``: the same for ``RLOOConfig`` (no loss type,
    reward scaling, delta, entropy mask or IS fields; ``normalize_advantages`` and ``reward_clip_range`` instead).

    ``force``: values of ``cbverify.pairs.trainer_space`` options (``{"loss_type": "dapo", "top_k": "cut", ...}``)
    drawn as given."""
    from math import gcd

    from cbverify.upstream.scenario import TrainerScenario

    force = dict(force or {})

    def pick(option: str, values: dict, free):
        """The forced value's strategy (``values``: label -> strategy), else ``free``."""
        if option in force:
            if force[option] not in values:
                raise ValueError(f"trainer_configs: cannot force {option}={force[option]!r}")
            return draw(values[force[option]])
        return draw(free)

    num_generations = pick("num_generations", {"2": st.just(2), "3": st.just(3)}, st.integers(2, 3))
    layout = force.get("per_device_train_batch_size")
    cut = force.get("mask_truncated_completions") == "true+cut"
    if cut and layout is None:  # several prompts per batch, so that some rows end within the length and some are cut
        layout = "several-groups"
    if layout == "splits-a-group":  # a micro-batch that cuts a group needs spg sharing the group size's factor
        spg = num_generations
        splits = [k for k in range(1, 7) if k % num_generations]
        per_device = draw(st.sampled_from(splits[::-1] if cut else splits))  # a cut wants several prompts: big first
    else:
        spg = draw(st.integers(2, 3) if force.get("steps_per_generation") == "above-gas" else st.integers(1, 3))
        unit = num_generations // gcd(num_generations, spg)  # the micro-batch size must make whole groups per batch
        several = [k for k in (2 * num_generations, 6) if k % unit == 0]
        sizes = {"one-group": [num_generations], "several-groups": several}
        per_device = draw(st.sampled_from(sizes[layout])) if layout else unit * draw(st.integers(1, max(1, 6 // unit)))
    gas = pick("steps_per_generation", {"gas": st.just(spg), "above-gas": st.integers(1, spg - 1),
               "below-gas": st.integers(spg + 1, 4)}, st.sampled_from([spg, spg, 1, 2, 3]))  # fmt: skip
    num_iterations = draw(st.sampled_from([1, 1, 2]))
    steps_needed = -(-spg * num_iterations // gas) + 1  # past the first generation batch
    loss_type = pick("loss_type", {t: st.just(t) for t in loss_types}, st.sampled_from(loss_types))
    more = draw(st.lists(st.sampled_from(["digits", "parity", "unscored", "constant"]), max_size=2, unique=True))
    weights = None
    if draw(st.booleans()):
        weights = tuple(draw(st.sampled_from([1.0, 0.5, 2.0, -1.0])) for _ in range(1 + len(more)))
    # a forced cut masks rows at a length the trained Llama's 2-operand answers (14-16 tokens) straddle
    mask = pick("mask_truncated_completions", {"false": st.just(False), "true+cut": st.just(True)}, st.booleans())
    max_completion_length = draw(st.sampled_from([15, 14]) if cut else st.integers(11, 16))
    sampler = dict(
        temperature=pick("temperature", {"1.0": st.just(1.0), "other": st.sampled_from([1.5, 0.7])},
                         st.sampled_from([1.0, 1.5, 0.7])),
        top_k=pick("top_k", {"0": st.just(0), "cut": st.sampled_from([3, 8])}, st.sampled_from([0, 0, 3, 8])),
        top_p=pick("top_p", {"1.0": st.just(1.0), "below-1": st.just(0.8)}, st.sampled_from([1.0, 1.0, 0.8])),
        min_p=pick("min_p", {"0": st.just(0.0), "above-0": st.just(0.1)}, st.sampled_from([0.0, 0.0, 0.1])),
    )  # fmt: skip
    if trainer == "rloo":
        rloo_only = dict(normalize_advantages=draw(st.booleans()),
                         reward_clip_range=draw(st.sampled_from([None, (-1.0, 0.5), (0.0, 2.0)])))  # fmt: skip
        return TrainerScenario(
            path="rollout_func", rollout_backend="reference", trainer="rloo", num_generations=num_generations,
            per_device_train_batch_size=per_device, steps_per_generation=spg, gradient_accumulation_steps=gas,
            num_iterations=num_iterations, max_steps=min(max_steps, steps_needed),
            max_completion_length=max_completion_length, mask_truncated_completions=mask,
            max_terms=2, **sampler, beta=draw(st.sampled_from([0.0, 0.0, 0.04])),
            epsilon=draw(st.sampled_from([0.2, 0.05])), epsilon_high=draw(st.sampled_from([None, 0.28])),
            reward=draw(st.sampled_from(["arithmetic", "length"])), more_rewards=tuple(more), reward_weights=weights,
            max_grad_norm=draw(st.sampled_from([1.0, 0.0, 0.01])), seed=draw(st.integers(0, 2**16)), num_prompts=1,
            **rloo_only,
        )  # fmt: skip
    return TrainerScenario(
        path="rollout_func", rollout_backend="reference", trainer="grpo",
        num_generations=num_generations, per_device_train_batch_size=per_device, steps_per_generation=spg,
        gradient_accumulation_steps=gas, num_iterations=num_iterations, max_steps=min(max_steps, steps_needed),
        max_completion_length=max_completion_length, mask_truncated_completions=mask, max_terms=2,
        **sampler, loss_type=loss_type,
        beta=draw(st.sampled_from([0.0, 0.0, 0.04])), epsilon=draw(st.sampled_from([0.2, 0.05])),
        use_bias_correction_kl=draw(st.sampled_from([None, True, False])),
        epsilon_high=draw(st.sampled_from([None, 0.28, 1.02] if loss_type == "cispo" else [None, 0.28])),
        delta=draw(st.sampled_from([None, None, 1.1])),
        importance_sampling_level=draw(st.sampled_from(["token", "sequence"])),
        scale_rewards=draw(st.sampled_from(["group", "batch", "none"])),
        reward=draw(st.sampled_from(["arithmetic", "length"])), more_rewards=tuple(more), reward_weights=weights,
        top_entropy_quantile=draw(st.sampled_from([1.0, 1.0, 0.5, 0.0])),
        max_grad_norm=draw(st.sampled_from([1.0, 0.0, 0.01])),
        is_correction=draw(st.booleans()), is_mode=draw(st.sampled_from(["sequence_mask", "token_truncate"])),
        is_clip_max=draw(st.sampled_from([3.0, 1.5])), seed=draw(st.integers(0, 2**16)), num_prompts=1,
    )  # fmt: skip


@st.composite
def logits_batches(draw, *, max_rows: int = 6, max_vocab: int = 48) -> torch.Tensor:
    """(R, V) float32 logits; ``integers`` mode makes exact ties (also at the top-k boundary) common."""
    rows, vocab = draw(st.integers(1, max_rows)), draw(st.integers(2, max_vocab))
    if draw(st.booleans()):
        values = draw(st.lists(st.integers(-3, 3), min_size=rows * vocab, max_size=rows * vocab))
        return torch.tensor(values, dtype=torch.float32).reshape(rows, vocab)
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 5.0]))
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def seeds() -> st.SearchStrategy[int]:
    """Any request seed the spec accepts."""
    return st.integers(0, MAX_SEED)


def positions() -> st.SearchStrategy[int]:
    """Any completion position the spec's noise accepts (31 bits)."""
    return st.integers(0, 2**31 - 1)


@st.composite
def grpo_sampling_fields(draw) -> dict:
    """``GRPOConfig`` keyword arguments that shape generation, ``generation_kwargs`` overrides included."""
    group = draw(st.sampled_from([2, 4]))
    kwargs = draw(st.sampled_from([None, {"do_sample": False}, {"top_k": 3}, {"temperature": 0.5, "top_p": 0.8}]))
    return dict(
        num_generations=group, per_device_train_batch_size=group, generation_kwargs=kwargs,
        temperature=draw(st.sampled_from([0.3, 0.7, 1.0, 1.5])), top_p=draw(st.sampled_from([1.0, 0.9])),
        top_k=draw(st.sampled_from([0, 5])), min_p=draw(st.sampled_from([None, 0.05])),
        max_completion_length=draw(st.integers(1, 64)),
    )  # fmt: skip


@st.composite
def ngram_sequences(draw, *, max_len: int = 24, vocab: int = 5) -> tuple[list[int], int]:
    """A token sequence over a small vocabulary (so n-grams repeat) and an n-gram size 1-4."""
    return draw(st.lists(st.integers(0, vocab - 1), max_size=max_len)), draw(st.integers(1, 4))


@st.composite
def generation_layers(draw) -> tuple[dict, dict, dict, dict]:
    """``generate_batch``'s four sources of a generation option, most specific first: its keyword arguments, the
    ``GenerationConfig`` passed, ``model.generation_config`` and the defaults; each field set in some of them."""
    values = {"max_new_tokens": st.integers(1, 9), "top_k": st.integers(0, 60),
              "temperature": st.sampled_from([0.5, 2.0]), "eos_token_id": st.sampled_from([2, [2, 4], []]),
              "min_length": st.integers(0, 9), "num_return_sequences": st.integers(1, 3)}  # fmt: skip
    layers = tuple({} for _ in range(4))
    for name, strategy in values.items():
        for layer in layers:
            if draw(st.booleans()):
                layer[name] = draw(strategy)
    layers[3].setdefault("max_new_tokens", 20)  # every case sets it somewhere (the defaults' max_length aside)
    return layers


@st.composite
def zoo_combinations(draw, *, families: tuple[str, ...] | None = None):
    """A feature-combination candidate of the zoo (``cbverify.zoo.combinations.Candidate``): a family (of
    ``families``, default all) and one value per switch it has; it shrinks towards the first family and every switch
    off. Whether the model applies every switch is ``combinations.verify``'s to say."""
    from cbverify.zoo.combinations import FAMILIES, Candidate, switches

    family = draw(st.sampled_from([f for f in FAMILIES if families is None or f.name in families]))
    return Candidate(family, tuple((s, draw(st.sampled_from(vs))) for s, vs in switches(family).items()))
