"""The reference generator's contract (``reference.spec``) on the bundled models, and its processors against
transformers'.

Independent paths: teacher forcing (``reference.logprobs``) for the log-probs, transformers' own logits warpers and
``generate(do_sample=False)`` for processing and greedy decoding, a chi-square test for the sampling distribution.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from scipy import stats
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from cbverify.tolerances import FP32, SAME_LOGITS_ATOL, SELF_TEST_PVALUE, logprob_scale
from property_tests.strategies import rollout_requests, sampling_params
from reference import tasks
from reference.generate import choose_token, generate, next_token_logits, process_logits
from reference.logprobs import per_token_entropies, processed_per_token_logps, top_logprobs
from reference.spec import RolloutRequest, SamplingParams, gumbel_noise

NEAR_TIE = FP32.near_tie_gap  # a greedy divergence is accepted only where the top-2 logit gap is this small
# Full-prefix recompute and one teacher-forced forward run different shapes, so float32 rounding differs (measured in
# FP32's reason: up to 1.2e-5 at T = 1, growing as 1/T); the fp32 tier's max, divided by min(1, T), bounds it.
LOGPROB_ATOL_AT_T1 = FP32.logprob_max_abs


@given(requests=rollout_requests(max_requests=2, max_prompt_len=16, max_new_tokens=(1, 6)))
def test_rollouts_keep_the_eos_and_length_contract_and_their_logprobs_equal_teacher_forcing(llama, requests):
    model, _ = llama
    rollouts = generate(model, requests)
    assert [r.request_id for r in rollouts] == [q.request_id for q in requests]
    for request, rollout in zip(requests, rollouts, strict=True):
        ids, eos = rollout.completion_ids, set(request.eos_token_ids)
        assert rollout.prompt_ids == request.prompt_ids
        assert 0 < len(ids) <= request.sampling.max_new_tokens
        assert not eos.intersection(ids[:-1])  # nothing after the first EOS
        if ids[-1] in eos:
            assert rollout.finish_reason == "stop"
        else:
            assert rollout.finish_reason == "length" and len(ids) == request.sampling.max_new_tokens
        (teacher,) = processed_per_token_logps(model, [request.prompt_ids], [ids], [request.sampling])
        scale = logprob_scale(request.sampling)
        torch.testing.assert_close(torch.tensor(rollout.logprobs), teacher, rtol=0.0, atol=LOGPROB_ATOL_AT_T1 / scale)
        assert all(lp <= 0.0 for lp in rollout.logprobs)


SAMPLING_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.5, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.9, min_p=0.05),
]


def test_sampled_tokens_follow_the_processed_distribution_by_chi_square(llama):
    """20 000 Gumbel-max draws per case against ``exp(process_logits)``; false alarm ``SELF_TEST_PVALUE`` per case."""
    model, _ = llama
    prompt = tasks.prompt_ids(tasks.make_problems(1, seed=7)[0])
    logits = next_token_logits(model, prompt)  # (V,)
    num_draws = 20_000
    seeds = torch.arange(num_draws, dtype=torch.int64) * 7919 + 11
    for sampling in SAMPLING_CASES:
        logprobs = process_logits(logits, sampling)  # (V,)
        noise = gumbel_noise(seeds, torch.zeros_like(seeds), logits.numel())  # (N, V)
        tokens = torch.argmax(logprobs.double()[None, :] + noise, dim=-1)  # (N,)
        for k in range(0, num_draws, 2000):  # the generator's own per-step path picks the same tokens
            assert choose_token(logits, sampling, int(seeds[k]), 0)[0] == int(tokens[k])
        kept = torch.isfinite(logprobs)
        assert kept[tokens].all(), "a token outside the processed support was sampled"
        observed = torch.bincount(tokens, minlength=logits.numel())[kept].double().numpy()
        expected = logprobs[kept].double().exp().numpy() * num_draws
        small = expected < 5  # pool rare tokens into one bin so the chi-square approximation holds
        if small.any():
            observed = np.append(observed[~small], observed[small].sum())
            expected = np.append(expected[~small], expected[small].sum())
        expected *= observed.sum() / expected.sum()  # remove float32 rounding of the total
        if len(observed) > 1:
            assert stats.chisquare(observed, expected).pvalue > SELF_TEST_PVALUE, sampling


def test_first_generated_tokens_are_the_gumbel_max_of_the_processed_logprobs(llama):
    model, _ = llama
    prompt = tuple(tasks.prompt_ids(tasks.make_problems(1, seed=3)[0]))
    sampling = SamplingParams(temperature=1.0, top_k=10, max_new_tokens=1)
    requests = [RolloutRequest(f"r{s}", prompt, sampling, seed=s * 104729) for s in range(24)]
    logprobs = process_logits(next_token_logits(model, prompt), sampling)  # (V,)
    seeds = torch.tensor([r.seed for r in requests])
    expected = torch.argmax(logprobs.double() + gumbel_noise(seeds, torch.zeros_like(seeds), logprobs.numel()), -1)
    assert [r.completion_ids[0] for r in generate(model, requests)] == expected.tolist()


def test_greedy_equals_transformers_generate_without_sampling(bundled_model):
    name, model, _ = bundled_model
    for problem in tasks.make_problems(3, seed=11, max_terms=4):  # short chains: the EOS is inside the 40 tokens
        prompt = tasks.prompt_ids(problem)
        request = RolloutRequest("greedy", prompt, SamplingParams(temperature=0.0, max_new_tokens=40), 0,
                                 (tasks.EOS_ID,))  # fmt: skip
        ours = generate(model, [request])[0].completion_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=40, eos_token_id=tasks.EOS_ID,
                                 pad_token_id=tasks.PAD_ID)  # fmt: skip
        theirs = out[0, len(prompt) :].tolist()
        theirs = theirs[: theirs.index(tasks.EOS_ID) + 1] if tasks.EOS_ID in theirs else theirs
        for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
            if a != b:  # accepted only at a near-tie of the reference's own logits, and reported
                top2 = torch.topk(next_token_logits(model, list(prompt) + list(ours[:i])), 2).values
                assert float(top2[0] - top2[1]) <= NEAR_TIE, (name, problem, i, a, b)
                return
        assert list(ours) == theirs, (name, problem)


@given(
    values=st.lists(st.integers(-400, 400), min_size=2, max_size=48, unique=True),
    sampling=sampling_params(greedy=False),
)
@example(values=[-32, -42, -92, -93], sampling=SamplingParams(temperature=1.0, top_k=3, top_p=0.85))  # order matters
@example(values=[-32, 7, -92], sampling=SamplingParams(temperature=1.5, min_p=1.0))  # min-p's edge: the top token only
def test_process_logits_keeps_the_same_tokens_and_probabilities_as_transformers_warpers(values, sampling):
    logits = torch.tensor(values, dtype=torch.float32) / 40.0  # distinct logits: no ties at a top-p boundary
    scores = logits[None, :] / sampling.temperature
    if sampling.top_k:
        scores = TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    if sampling.min_p > 0.0:
        scores = MinPLogitsWarper(sampling.min_p)(None, scores)
    theirs = torch.log_softmax(scores[0], dim=-1)
    ours = process_logits(logits, sampling)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    kept = torch.isfinite(ours)
    torch.testing.assert_close(ours[kept], theirs[kept], rtol=0.0, atol=SAME_LOGITS_ATOL)


def test_top_k_keeps_every_token_tied_with_the_kth_score_as_transformers_does():
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.5])
    ours = process_logits(logits, SamplingParams(top_k=2))
    theirs = TopKLogitsWarper(2)(None, logits[None, :])[0]
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    assert int(torch.isfinite(ours).sum()) == 4


@given(
    prompt=st.lists(st.integers(3, 25), min_size=1, max_size=6),
    completion=st.lists(st.integers(0, 25), min_size=0, max_size=6),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    k=st.integers(1, 6),
    sampling=st.one_of(st.none(), sampling_params()),
)
def test_entropies_and_top_logprobs_follow_their_definitions(llama, prompt, completion, temperature, k, sampling):
    """From the model's own forward over prompt + completion: the entropy of softmax(logits / T) (scipy's) at each
    completion position, and the k largest (processed) log-probs with their token ids, descending."""
    with torch.no_grad():
        logits = llama.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()  # (L, V)
    (entropy,) = per_token_entropies(llama.model, [prompt], [completion], temperature)
    want = [stats.entropy(torch.softmax(row / temperature, -1).numpy()) for row in logits]
    np.testing.assert_allclose(entropy.double().numpy(), np.array(want).reshape(-1), rtol=1e-5, atol=1e-6)
    values, ids = top_logprobs(llama.model, prompt, completion, k, sampling)
    assert values.shape == ids.shape == (len(completion), k)
    for row, got_values, got_ids in zip(logits, values, ids, strict=True):
        scores = process_logits(row.float(), sampling) if sampling is not None else torch.log_softmax(row, -1)
        order = np.argsort(-scores.double().numpy(), kind="stable")[:k]
        np.testing.assert_allclose(got_values.double().numpy(), scores.double().numpy()[order], rtol=1e-5, atol=1e-6)
        finite = np.isfinite(got_values.numpy())
        # ties may list equal scores in either order: compare the scores the ids point at
        np.testing.assert_allclose(
            scores.double().numpy()[got_ids.numpy()][finite], got_values.double().numpy()[finite], rtol=1e-5, atol=1e-6
        )


def test_top_logprobs_takes_five_by_default_accepts_k_up_to_the_vocabulary_and_shapes_an_empty_completion(llama):
    vocab = llama.model.config.vocab_size
    values, ids = top_logprobs(llama.model, [1, 6], [5, 16])
    assert values.shape == ids.shape == (2, 5)  # the documented default k
    values, ids = top_logprobs(llama.model, [1, 6], [5, 16], k=vocab)  # every token, in order
    assert sorted(ids[0].tolist()) == list(range(vocab)) and bool((values[:, :-1] >= values[:, 1:]).all())
    for k in (0, vocab + 1):
        with pytest.raises(ValueError, match="k must be"):
            top_logprobs(llama.model, [1, 6], [5, 16], k=k)
    sampling = SamplingParams(temperature=0.5, top_k=3)  # processed: three finite values, then the removed tokens
    values, ids = top_logprobs(llama.model, [1, 6], [5, 16], k=5, sampling=sampling)
    with torch.no_grad():
        logits = llama.model(torch.tensor([[1, 6, 5, 16]])).logits[0, 1:3]
    for row, got in zip(logits, values, strict=True):
        want = torch.sort(process_logits(row, sampling), descending=True).values[:5]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(got).tolist() == [True, True, True, False, False]
    values, ids = top_logprobs(llama.model, [1, 6], [], k=3)
    assert (values.shape, values.dtype, ids.shape, ids.dtype) == ((0, 3), torch.float32, (0, 3), torch.long)


def test_processed_log_probs_of_an_empty_completion_are_an_empty_float32_vector(llama):
    (empty, one) = processed_per_token_logps(llama.model, [[1, 6], [1, 6]], [[], [5]], [SamplingParams()] * 2)
    assert (empty.shape, empty.dtype, one.shape) == ((0,), torch.float32, (1,))


def test_entropies_default_to_temperature_one_and_refuse_a_temperature_of_zero(llama):
    (default,) = per_token_entropies(llama.model, [[1, 6]], [[5, 16]])
    (one,) = per_token_entropies(llama.model, [[1, 6]], [[5, 16]], 1.0)
    assert torch.equal(default, one)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        per_token_entropies(llama.model, [[1, 6]], [[5, 16]], 0.0)


def test_generate_refuses_a_request_id_used_twice_in_one_call_and_keeps_request_order(llama):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=2)
    a, b = RolloutRequest("a", (1, 5), sampling), RolloutRequest("b", (1, 6), sampling)
    with pytest.raises(ValueError, match="request_ids must be unique"):
        generate(llama.model, [a, b, RolloutRequest("a", (1, 7), sampling)])
    assert [r.request_id for r in generate(llama.model, [b, a])] == ["b", "a"]


def test_trainer_log_probs_default_to_temperature_one_and_refuse_zero_and_unpaired_lists(llama):
    from reference.logprobs import per_token_logps

    prompts, completions = [(1, 5, 6)], [(7, 8)]
    logits = llama.model(torch.tensor([[1, 5, 6, 7]])).logits[0, 2:4].float()  # (2, V): the rows predicting 7, 8
    want = torch.log_softmax(logits, dim=-1)[torch.arange(2), torch.tensor([7, 8])]
    torch.testing.assert_close(per_token_logps(llama.model, prompts, completions)[0], want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="temperature must be > 0 for trainer log-probs"):
        per_token_logps(llama.model, prompts, completions, temperature=0.0)
    with pytest.raises(ValueError):
        per_token_logps(llama.model, prompts * 2, completions)
