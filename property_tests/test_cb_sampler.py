"""cb_impl's vectorised sampler against the definition (``reference.generate``), and its top-k noise shortcut
against full-vocabulary noise. No model: logits are drawn directly, tie-heavy on purpose."""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from cb_impl.noise import fast_bits_to_gumbel, fast_gumbel_noise, fast_noise_bits
from cb_impl.sampler import build_sampling_batch, choose_tokens, process_logits, sample
from cbverify.tolerances import FP32, SAME_LOGITS_ATOL
from property_tests.strategies import logits_batches, sampling_params, seeds
from reference.generate import choose_token
from reference.generate import process_logits as reference_process_logits
from reference.spec import MAX_SEED, SamplingParams, bits_to_gumbel, gumbel_noise, noise_bits


def _rows(draw, n: int, *, greedy: bool | None = None) -> tuple[list[SamplingParams], list[int], list[int]]:
    params = [draw(sampling_params(greedy=greedy)) for _ in range(n)]
    row_seeds = [draw(seeds()) for _ in range(n)]
    row_positions = [draw(st.integers(0, 200)) for _ in range(n)]
    return params, row_seeds, row_positions


@given(logits=logits_batches(), data=st.data())
@example(logits=torch.tensor([[1.0, 1.0, 1.0, 0.0]]), data=None)
def test_cb_topk_noise_shortcut_gives_bit_identical_tokens_to_full_vocabulary_noise(logits, data):
    rows = logits.shape[0]
    if data is None:  # pinned: a 3-way tie at the top-2 boundary must fall back to full noise
        params, seeds, positions = [SamplingParams(temperature=1.0, top_k=2)], [5], [0]
    else:
        params, seeds, positions = _rows(data.draw, rows, greedy=False)
    b = build_sampling_batch(params, seeds, positions, logits.device)
    processed, candidates, shortcut = process_logits(logits, b)
    fast = choose_tokens(processed, candidates, shortcut, b)
    noise = gumbel_noise(torch.tensor(seeds), torch.tensor(positions), logits.shape[1])  # (R, V) the definition
    full = (processed.double() + noise).argmax(dim=-1)
    assert torch.equal(fast, full), (fast, full, shortcut)


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
    tokens, logprobs = sample(logits, build_sampling_batch(params, seeds, positions, logits.device))
    for r, (p, seed, pos) in enumerate(zip(params, seeds, positions, strict=True)):
        ref_token, ref_logprob = choose_token(logits[r], p, seed, pos)
        if int(tokens[r]) != ref_token:
            gap = _decision_gap(logits[r], p, seed, pos)
            assert gap <= FP32.near_tie_gap, (r, p, int(tokens[r]), ref_token, gap)
            continue
        assert abs(float(logprobs[r]) - ref_logprob) <= SAME_LOGITS_ATOL, (r, p, float(logprobs[r]), ref_logprob)


@given(logits=logits_batches(max_rows=4), data=st.data())
def test_cb_sampled_rows_follow_the_processed_distribution_support(logits, data):
    """A sampled token always has a finite processed log-prob (it was kept by every processor) and greedy rows pick
    the lowest-id maximum."""
    params, seeds, positions = _rows(data.draw, logits.shape[0])
    tokens, logprobs = sample(logits, build_sampling_batch(params, seeds, positions, logits.device))
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all(), logprobs
    for r, p in enumerate(params):
        if p.greedy:
            row = logits[r]
            assert int(tokens[r]) == int((row == row.max()).nonzero()[0, 0])


@given(
    keys=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8),
    token_ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8),
    seed=seeds(),
    position=st.integers(0, 2**31),
    vocab=st.integers(1, 300),
)
@example(keys=[0, 2**32 - 1, 2**16 - 1], token_ids=[2**32 - 1, 0, 2**16], seed=MAX_SEED, position=2**31, vocab=1)
def test_cb_fast_noise_has_the_same_bits_as_the_reference_noise_over_the_whole_32_bit_range(
    keys, token_ids, seed, position, vocab
):
    k = torch.tensor(keys, dtype=torch.int64)[:, None]  # (B, 1)
    t = torch.tensor(token_ids, dtype=torch.int64)[None, :]  # (1, M)
    assert torch.equal(fast_noise_bits(k, t), noise_bits(k, t))
    assert torch.equal(fast_bits_to_gumbel(noise_bits(k, t)), bits_to_gumbel(noise_bits(k, t)))
    s, p = torch.tensor([seed, 0]), torch.tensor([position, 3])
    assert torch.equal(fast_gumbel_noise(s, p, vocab), gumbel_noise(s, p, vocab))


def test_the_top_k_shortcut_is_taken_only_where_it_cannot_change_the_token():
    """Rows with a tie at the k-th score, top-k off beside a top-k row, several rows at once: over many seeds the
    candidate shortcut picks what the full-vocabulary Gumbel race picks (a shortcut taken at a tie, or for a row whose
    top-k is off, would drop a token that wins for some seed)."""
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0, -1.0], [2.0, 0.5, 0.4, 0.3, 0.2], [0.3, 0.2, 0.1, 0.0, -0.1]])
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_k=0),
              SamplingParams(temperature=1.0, top_k=3)]  # fmt: skip
    for seed in range(60):
        seeds, positions = [seed, seed + 1, seed + 2], [0, 3, 7]
        b = build_sampling_batch(params, seeds, positions, logits.device)
        processed, candidates, shortcut = process_logits(logits, b)
        assert shortcut.tolist() == [False, False, True], "shortcut only for the untied top-k row"
        fast = choose_tokens(processed, candidates, shortcut, b)
        full = (processed.double() + gumbel_noise(torch.tensor(seeds), torch.tensor(positions), 5)).argmax(dim=-1)
        assert torch.equal(fast, full), (seed, fast, full)
