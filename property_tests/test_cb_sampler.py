"""cb_impl's vectorised sampler against the definition (``reference.generate``), and its pruned Gumbel race against
full-vocabulary noise. No model: logits are drawn directly, tie-heavy on purpose."""

from __future__ import annotations

import math

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from cb_impl.noise import (
    RACE_CHUNK,
    RACE_MIN_VOCAB,
    gumbel_race,
    gumbel_upper_bound,
    minus_gumbel,
    mix32_,
    seed_key,
    step_keys,
)
from cb_impl.sampler import SAMPLE_BUDGET, SamplingBatch, build_sampling_batch, process_logits, sample, sampling_row
from cbverify.tolerances import FP32, SAME_LOGITS_ATOL
from property_tests.strategies import logits_batches, positions, sampling_params, seeds
from reference.generate import choose_token
from reference.generate import process_logits as reference_process_logits
from reference.spec import SamplingParams, bits_to_gumbel, gumbel_noise, noise_bits, noise_keys


def _rows(draw, n: int, *, greedy: bool | None = None) -> tuple[list[SamplingParams], list[int], list[int]]:
    params = [draw(sampling_params(greedy=greedy)) for _ in range(n)]
    row_seeds = [draw(seeds()) for _ in range(n)]
    row_positions = [draw(st.integers(0, 200)) for _ in range(n)]
    return params, row_seeds, row_positions


def _batch(params: list[SamplingParams], row_seeds: list[int]) -> SamplingBatch:
    rows = [sampling_row(p, seed) for p, seed in zip(params, row_seeds, strict=True)]
    return build_sampling_batch(rows, torch.device("cpu"))


def _sample(logits: torch.Tensor, params: list[SamplingParams], row_seeds: list[int], row_positions: list[int],
            budget: int | None = SAMPLE_BUDGET, race_min_vocab: int | None = RACE_MIN_VOCAB):  # fmt: skip
    return sample(logits, _batch(params, row_seeds), torch.tensor(row_positions), budget, race_min_vocab)


def _int32(bits: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (int64) -> int32 tensors with the same bits, the form cb_impl's noise works on."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def _race(processed: torch.Tensor, b: SamplingBatch, row_positions: list[int]) -> torch.Tensor:
    """The race's token, pruned and unpruned (small vocabularies skip the pruning), after checking the two agree."""
    keys = step_keys(b.seed_keys, torch.tensor(row_positions))
    pruned, unpruned = gumbel_race(processed, keys, min_vocab=0), gumbel_race(processed, keys, min_vocab=2**31)
    assert torch.equal(pruned, unpruned), (pruned, unpruned)
    return pruned


@given(logits=logits_batches(), data=st.data())
@example(logits=torch.tensor([[1.0, 1.0, 1.0, 0.0]]), data=None)
def test_cb_gumbel_race_gives_bit_identical_tokens_to_full_vocabulary_noise(logits, data):
    rows = logits.shape[0]
    if data is None:  # pinned: a 3-way tie at the top-2 boundary
        params, seeds, positions = [SamplingParams(temperature=1.0, top_k=2)], [5], [0]
    else:
        params, seeds, positions = _rows(data.draw, rows, greedy=False)
    b = _batch(params, seeds)
    processed = process_logits(logits, b)
    fast = _race(processed, b, positions)
    noise = gumbel_noise(torch.tensor(seeds), torch.tensor(positions), logits.shape[1])  # (R, V) the definition
    full = (processed.double() + noise).argmax(dim=-1)
    assert torch.equal(fast, full), (fast, full)


def _decision_gap(logits: torch.Tensor, p: SamplingParams, seed: int, position: int) -> float:
    """Reference top-2 gap of the decision score for one row (inf when only one token is possible)."""
    if p.greedy:
        scores = logits.double()
    else:
        noise = gumbel_noise(torch.tensor([seed]), torch.tensor([position]), logits.numel())[0]
        scores = reference_process_logits(logits, p).double() + noise
    top = torch.topk(scores, 2).values
    return float(top[0] - top[1])


@given(logits=logits_batches(), data=st.data())
def test_cb_sampler_matches_the_reference_rule_row_by_row(logits, data):
    """Same tokens (or a near-tie of the reference's decision score) and log-probs within ``SAME_LOGITS_ATOL``, per
    row, whatever the mix of greedy and sampled rows and parameters in the batch."""
    params, seeds, positions = _rows(data.draw, logits.shape[0])
    budget = data.draw(st.sampled_from([SAMPLE_BUDGET, 1, 2 * logits.shape[1], None]), label="budget")  # 1: by row
    race = data.draw(st.sampled_from([RACE_MIN_VOCAB, 0, None]), label="race")  # None: exact noise everywhere
    tokens, logprobs = _sample(logits, params, seeds, positions, budget, race)
    for r, (p, seed, pos) in enumerate(zip(params, seeds, positions, strict=True)):
        ref_token, ref_logprob = choose_token(logits[r], p, seed, pos)
        if int(tokens[r]) != ref_token:
            gap = _decision_gap(logits[r], p, seed, pos)
            assert gap <= FP32.near_tie_gap, (r, p, int(tokens[r]), ref_token, gap)
            continue
        assert abs(float(logprobs[r]) - ref_logprob) <= SAME_LOGITS_ATOL, (r, p, float(logprobs[r]), ref_logprob)


@given(logits=logits_batches(), data=st.data())
def test_cb_sampling_rows_in_slices_gives_the_same_bits_as_all_rows_at_once(logits, data):
    """Rows are independent: sampling them a slice at a time (``budget`` logits per slice) changes no bit."""
    params, seeds, positions = _rows(data.draw, logits.shape[0])
    budget = data.draw(st.integers(1, logits.numel()), label="budget")
    whole = _sample(logits, params, seeds, positions, budget=logits.numel())
    sliced = _sample(logits, params, seeds, positions, budget)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced, strict=True)), (whole, sliced)


def test_sampling_in_slices_covers_every_row_when_rows_outnumber_the_vocabulary():
    """Slices step over rows, not tokens: six rows of a three-token vocabulary, one row per slice."""
    logits = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    params, row_seeds, row_positions = [SamplingParams(temperature=1.0)] * 6, list(range(6)), [0] * 6
    whole = _sample(logits, params, row_seeds, row_positions, budget=logits.numel())
    sliced = _sample(logits, params, row_seeds, row_positions, budget=1)
    assert sliced[0].shape == (6,) and all(torch.equal(a, b) for a, b in zip(whole, sliced, strict=True))


@given(logits=logits_batches(max_rows=4), data=st.data())
def test_cb_sampled_rows_follow_the_processed_distribution_support(logits, data):
    """A sampled token always has a finite processed log-prob (it was kept by every processor) and greedy rows pick
    the lowest-id maximum."""
    params, seeds, positions = _rows(data.draw, logits.shape[0])
    tokens, logprobs = _sample(logits, params, seeds, positions)
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all(), logprobs
    for r, p in enumerate(params):
        if p.greedy:
            row = logits[r]
            assert int(tokens[r]) == int((row == row.max()).nonzero()[0, 0])


@given(
    keys=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8),
    token_ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8),
)
@example(keys=[0, 2**32 - 1, 2**16 - 1], token_ids=[2**32 - 1, 0, 2**16])
def test_cb_int32_hash_has_the_same_bits_as_the_reference_noise_over_the_whole_32_bit_range(keys, token_ids):
    k = torch.tensor(keys, dtype=torch.int64)[:, None]  # (B, 1)
    t = torch.tensor(token_ids, dtype=torch.int64)[None, :]  # (1, M)
    assert torch.equal(mix32_(_int32(k) ^ _int32(t)).to(torch.int64) & 0xFFFFFFFF, noise_bits(k, t))
    assert torch.equal(-minus_gumbel(_int32(noise_bits(k, t))), bits_to_gumbel(noise_bits(k, t)))


@given(row_seeds=st.lists(seeds(), min_size=1, max_size=8), data=st.data())
@example(row_seeds=[0, 2**31, 2**32 - 1, 2**32, 2**63 - 1], data=None)
def test_cb_noise_keys_split_per_request_and_per_step_equal_the_reference_keys(row_seeds, data):
    """A request's seed key is computed once (Python ints) and a step mixes in the position (int32 tensors): the
    32 bits equal ``reference.spec.noise_keys`` for any seed of the spec's range and any position."""
    if data is None:
        row_positions = [0, 1, 2**31 - 1, 7, 2**16]
    else:
        row_positions = data.draw(st.lists(positions(), min_size=len(row_seeds), max_size=len(row_seeds)))
    fast = step_keys(torch.tensor([seed_key(s) for s in row_seeds]), torch.tensor(row_positions))
    expected = noise_keys(torch.tensor(row_seeds), torch.tensor(row_positions))
    assert fast.dtype == torch.int32  # the race's hash works on int32 bits
    assert torch.equal(fast.to(torch.int64) & 0xFFFFFFFF, expected), (fast, expected)


def test_the_gumbel_bound_holds_over_the_whole_32_bit_range_and_is_within_0_064_of_minus_log_1_minus_u():
    """The race prunes a token whose score bound is below another token's exact score, so the bound must hold for
    every 32-bit value: all powers of two of ``c = 2**32 - 1 - bits`` and their neighbours (where float32 ``c`` rounds
    up, and where the fast log2 of ``c`` is exact), both ends, and a million random values. A bound that reads
    ``log2 c`` a hair too high fails at ``c = 2**k``; one as loose as ``floor(log2 c)`` fails the tightness check."""
    c = torch.tensor([0, 1, 2, 3] + [v for k in range(2, 32) for v in (2**k - 1, 2**k, 2**k + 1)] + [2**32 - 1])
    c = torch.cat([c, torch.randint(0, 2**32, (1_000_000,))])
    bits = 2**32 - 1 - c  # int64 in [0, 2**32)
    exact = bits_to_gumbel(bits)
    bound = gumbel_upper_bound(_int32(bits)).double()
    assert (bound >= exact).all(), bits[bound < exact][:5]
    # -log(1 - u) = 32 ln 2 - ln(c + 0.5) bounds the noise; the fast log2 reads log2 c at most 0.0861 low, so for
    # c >= 256 (below, the bound stays above any noise) the bound is within 0.0861 ln 2 + ln(1 + 1/512) + margin of it
    minus_log_1_minus_u = 32 * math.log(2) - (c.double() + 0.5).log()
    top = c >= 256
    assert (bound[top] - minus_log_1_minus_u[top]).max() <= 0.0861 * math.log(2) + math.log(1 + 1 / 512) + 1.1e-3
    assert (bound - exact).min() < 2e-3, "the bound touches the noise (+ its margin) where c is a power of two"


@given(data=st.data())
def test_the_race_searches_every_chunk_that_can_hold_the_winner(data):
    """Vocabularies of several race chunks (most not a multiple of the chunk: the last one padded) with four tokens
    boosted to nearly equal log-probs: the winner is often not the token with the largest bound (the bound is looser
    where the noise is low), nor in its chunk. The pruned race picks what the full-vocabulary race picks."""
    rows, vocab = data.draw(st.integers(1, 8)), data.draw(st.integers(RACE_CHUNK + 1, 8 * RACE_CHUNK))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    logits = torch.randn(rows, vocab, generator=gen)
    logits.scatter_(1, torch.randint(0, vocab, (rows, 4), generator=gen), 8 + torch.rand(rows, 4, generator=gen))
    row_seeds, row_positions = data.draw(st.lists(seeds(), min_size=rows, max_size=rows)), list(range(rows))
    b = _batch([SamplingParams(temperature=1.0)] * rows, row_seeds)
    processed = process_logits(logits, b)
    noise = gumbel_noise(torch.tensor(row_seeds), torch.tensor(row_positions), vocab)  # (R, V) the definition
    assert torch.equal(_race(processed, b, row_positions), (processed.double() + noise).argmax(dim=-1))


@given(row_seeds=st.lists(seeds(), min_size=1, max_size=4), vocab=st.sampled_from([2, 5, 300]))
def test_the_race_compares_scores_in_float64_below_float32_resolution(row_seeds, vocab):
    """Log-probs equal to minus each token's noise, rounded to float32: every score is a residual below float32's
    resolution, so a race that adds or compares in float32 sees an all-way tie (token 0), the definition does not."""
    row_positions = list(range(len(row_seeds)))
    noise = gumbel_noise(torch.tensor(row_seeds), torch.tensor(row_positions), vocab)  # (R, V) float64
    processed = (-noise).float()  # (R, V)
    want = (processed.double() + noise).argmax(dim=-1)
    b = _batch([SamplingParams(temperature=1.0)] * len(row_seeds), row_seeds)
    assert torch.equal(_race(processed, b, row_positions), want)


def test_the_processors_cut_exactly_at_their_boundaries_as_the_reference_does():
    """Equal logits make the boundaries exact: probabilities of 1/4, cumulative sums of 1/4, 1/2, 3/4 landing on
    ``1 - top_p`` (transformers removes at ``<=``), every token tied with the maximum under ``min_p = 1`` (removed
    only below it), and ties at the k-th score (kept). A drawn batch almost never lands on a boundary. And a token
    whose probability underflows to 0 stays finite when top-p is off (``top_p = 1``: no cut at a cumulative of 0).
    With 32 or 48 tied tokens, which ties the cut keeps is the reference's stable sort's order (lowest ids dropped)."""
    flat, underflow = torch.zeros(1, 4), torch.tensor([[0.0, -200.0, 0.0, 0.0]])
    cases = [(flat, SamplingParams(temperature=1.0, top_p=p)) for p in (0.25, 0.5, 0.75)]
    cases += [(flat, SamplingParams(temperature=1.0, min_p=1.0)), (flat, SamplingParams(temperature=1.0, top_k=2))]
    cases += [(flat, SamplingParams(temperature=0.5, top_k=1, top_p=0.5, min_p=1.0))]
    cases += [(underflow, SamplingParams(temperature=1.0)), (underflow, SamplingParams(temperature=1.0, top_p=0.9))]
    # ties straddling the top-p cut at V > 16: a sort that is not stable reorders them (CPU does, from V = 17)
    cases += [(torch.zeros(1, 32), SamplingParams(temperature=1.0, top_p=0.5))]
    cases += [(torch.zeros(1, 48), SamplingParams(temperature=1.0, top_p=0.25))]
    for logits, p in cases:
        got = process_logits(logits, _batch([p], [0]))[0]
        want = reference_process_logits(logits[0], p)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), (p, got, want)
        torch.testing.assert_close(got, want, rtol=0, atol=SAME_LOGITS_ATOL)


def test_the_gumbel_race_keeps_ties_removed_tokens_and_single_token_rows_exact():
    """Rows with a three-way tie, a top-k-off row beside top-k rows, a row with one token left, and flat rows of a
    large vocabulary (where the pruning keeps least margin), over many seeds: the pruned race picks what the
    full-vocabulary Gumbel race picks."""
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0, -1.0], [2.0, 0.5, 0.4, 0.3, 0.2], [0.3, 0.2, 0.1, 0.0, -0.1],
                           [5.0, -1.0, -1.0, -1.0, -1.0]])  # fmt: skip
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_k=0),
              SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_k=1)]  # fmt: skip
    flat = torch.zeros(3, 4096)
    flat[1, ::2] = 1e-6  # near-ties everywhere
    for seed in range(60):
        for rows, ps in ((logits, params), (flat, [SamplingParams(temperature=1.0)] * 3)):
            seeds, positions = [seed + i for i in range(len(ps))], [3 * i for i in range(len(ps))]
            b = _batch(ps, seeds)
            processed = process_logits(rows, b)
            fast = _race(processed, b, positions)
            noise = gumbel_noise(torch.tensor(seeds), torch.tensor(positions), rows.shape[1])
            assert torch.equal(fast, (processed.double() + noise).argmax(dim=-1)), (seed, fast)
