"""Test-only faulty engines: each carries one realistic bug, so the meta-tests can show the suite catches it.

Every class follows the Engine protocol and claims the reference's capabilities (the lie is the point). Bugs:

- :class:`ShiftedLogprobs` — returned log-probs shifted by one position (an off-by-one in the log-prob gather).
- :class:`SharedRNG` — one noise stream for the whole batch: every request is sampled with the first one's seed.
- :class:`DroppedLastToken` — the last generated token (and its log-prob) is lost when completing a request.
- :class:`TopKAfterTopP` — processors in the wrong order: top-p, then top-k (spec: top-k, then top-p).
- :class:`CompletionOrder` — results returned in the order requests finished (shortest completion first, ties LIFO).
- :class:`IgnoresTopK` — an own-RNG sampler that silently drops the per-request top-k (what transformers CB does
  to a per-request kwarg whose processor was not built at init, if the kwarg check is bypassed).

Faults that only one dimension of ``cbverify verify``'s workload exposes (each is invisible to the others):

- :class:`IgnoresTemperature` — samples at T=1 whatever the request asks (invisible at T=1).
- :class:`IgnoresMinP` — drops min-p (invisible where min-p is 0).
- :class:`GroupSharesSeed` — every member of a GRPO group (same prompt, consecutive) gets the first member's seed.
- :class:`OnlyFirstEos` — stops on the first EOS id only (invisible with one EOS id).
- :class:`OverrunsLimit` — a request that reaches ``max_new_tokens`` gets one token more (invisible when every
  completion stops on EOS first).
- :class:`PreemptionKeepsComputed` — cb_impl whose preemption forgets to reset the computed-token count, so the
  recomputation skips the KV it freed (invisible unless the cache is too small and requests are preempted).
- :class:`PrefillOnlyStepCrashes` — cb_impl that crashes on a step of partial prefills only (nothing to sample), as
  cb_impl once did on tiny-qwen3-chat (its sampler called with zero rows; invisible unless a prompt is longer than
  the per-step token budget).

Faults inside cb_impl that only a workload reaching the mechanism exposes (``verify``'s probes,
:mod:`cbverify.mechanisms`; invisible on a trained model whose group members draw the same tokens, or with one EOS
id that every rollout stops on first):

- :class:`CbOnlyFirstEos` — cb_impl whose sequences stop on the first of the request's EOS ids only.
- :class:`CowSkippedAtTwoSharers` — cb_impl whose block manager skips the copy on write when exactly two sequences
  share the block (``> 2`` for ``> 1``): the last two writers of a group's prompt block write into one block.
- :class:`FollowerParentSeed` — cb_impl whose group followers sample their first token, the one drawn from the
  parent's logits when they are forked, with their parent's seed (their own sampling parameters, their own seed
  from then on).

:class:`OwnRNG` is the control: the reference with fresh random seeds, a *correct* own-RNG engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from cbverify.engines import Capabilities
from cbverify.engines.reference_engine import ReferenceEngine
from reference import generate as ref_gen
from reference.spec import Rollout, RolloutRequest, SamplingParams, gumbel_noise


class _Faulty:
    capabilities: Capabilities = ReferenceEngine.capabilities

    def __init__(self, model, **_engine_options) -> None:  # options of the engine it stands in for are ignored
        self.model = model
        self.name = f"faulty:{type(self).__name__}"

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        return ref_gen.generate(self.model, list(requests))


class ShiftedLogprobs(_Faulty):
    def generate(self, requests):
        out = super().generate(requests)
        return [replace(r, logprobs=(*r.logprobs[1:], r.logprobs[-1])) for r in out]


class SharedRNG(_Faulty):
    def generate(self, requests):
        shared = requests[0].seed
        out = super().generate([replace(r, seed=shared) for r in requests])
        return out


class DroppedLastToken(_Faulty):
    def generate(self, requests):
        out = super().generate(requests)
        return [
            replace(r, completion_ids=r.completion_ids[:-1], logprobs=r.logprobs[:-1]) if len(r.completion_ids) > 1
            else r
            for r in out
        ]  # fmt: skip


class CompletionOrder(_Faulty):
    def generate(self, requests):
        out = super().generate(requests)
        # shortest first; among equal lengths the last admitted finishes first (a LIFO decode queue)
        order = sorted(range(len(out)), key=lambda i: (len(out[i].completion_ids), -i))
        return [out[i] for i in order]


def _top_k_after_top_p(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """``reference.generate.process_logits`` with the top-k and top-p steps swapped (the bug)."""
    if sampling.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    scores = ref_gen.apply_temperature(logits.float(), sampling.temperature)
    scores = ref_gen.apply_top_p(scores, sampling.top_p)
    scores = ref_gen.apply_top_k(scores, sampling.top_k)
    scores = ref_gen.apply_min_p(scores, sampling.min_p)
    return torch.log_softmax(scores, dim=-1)


class OwnProcessing(_Faulty):
    """The oracle's loop with another processing: greedy argmax, else Gumbel-max with the spec's noise over
    ``process(logits, sampling)``, whose log-probs it returns."""

    process = staticmethod(ref_gen.process_logits)

    def generate(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request: RolloutRequest) -> Rollout:
        prefix, completion, logprobs, reason = list(request.prompt_ids), [], [], "length"
        for position in range(request.sampling.max_new_tokens):
            logits = ref_gen.next_token_logits(self.model, prefix)  # (V,)
            processed = self.process(logits, request.sampling)  # (V,)
            if request.sampling.greedy:
                token = int(torch.argmax(logits))
            else:
                noise = gumbel_noise(torch.tensor([request.seed]), torch.tensor([position]), logits.numel())[0]
                token = int(torch.argmax(processed.double() + noise))
            prefix.append(token)
            completion.append(token)
            logprobs.append(float(processed[token]))
            if token in request.eos_token_ids:
                reason = "stop"
                break
        return Rollout(request.request_id, request.prompt_ids, tuple(completion), tuple(logprobs), reason)


class TopKAfterTopP(OwnProcessing):
    process = staticmethod(_top_k_after_top_p)


class OwnRNG(_Faulty):
    """Correct own-RNG engine (the control): the reference, each request given a fresh seed from a torch generator."""

    capabilities = replace(ReferenceEngine.capabilities, spec_sampling=False, claims_batch_invariance=False)

    def __init__(self, model, seed: int = 0) -> None:
        super().__init__(model)
        self.name = "own-rng-reference"
        self.rng = torch.Generator().manual_seed(seed)

    def _reseed(self, requests):
        seeds = torch.randint(0, 2**62, (len(requests),), generator=self.rng).tolist()
        return [replace(r, seed=int(s)) for r, s in zip(requests, seeds, strict=True)]

    def generate(self, requests):
        return super().generate(self._reseed(requests))


class IgnoresTopK(OwnRNG):
    def generate(self, requests):
        return super().generate([replace(r, sampling=replace(r.sampling, top_k=0)) for r in requests])


class IgnoresTemperature(_Faulty):
    def generate(self, requests):
        fix = [replace(r, sampling=replace(r.sampling, temperature=1.0)) if not r.sampling.greedy else r
               for r in requests]  # fmt: skip
        return [replace(out, request_id=r.request_id) for r, out in zip(requests, super().generate(fix), strict=True)]


class IgnoresMinP(_Faulty):
    def generate(self, requests):
        return super().generate([replace(r, sampling=replace(r.sampling, min_p=0.0)) for r in requests])


class GroupSharesSeed(_Faulty):
    def generate(self, requests):
        seeds, out = {}, []
        for r in requests:
            key = (r.prompt_ids, r.sampling)
            seeds.setdefault(key, r.seed)
            out.append(replace(r, seed=seeds[key]))
        return super().generate(out)


class OnlyFirstEos(_Faulty):
    def generate(self, requests):
        return super().generate([replace(r, eos_token_ids=r.eos_token_ids[:1]) for r in requests])


class OverrunsLimit(_Faulty):
    def generate(self, requests):
        longer = [replace(r, sampling=replace(r.sampling, max_new_tokens=r.sampling.max_new_tokens + 1))
                  for r in requests]  # fmt: skip
        return super().generate(longer)


class PreemptionKeepsComputed:
    """cb_impl with one bug in the scheduler's recompute preemption (see the module docstring)."""

    def __new__(cls, model, **options):
        from cbverify.engines.cb_impl_engine import CbImplEngine

        engine = CbImplEngine(model, **options)
        scheduler = engine.engine.scheduler
        preempt = scheduler.preempt

        def buggy_preempt(seq) -> None:
            computed = seq.num_computed_tokens
            preempt(seq)
            seq.num_computed_tokens = computed  # the bug: the freed KV is never recomputed

        scheduler.preempt = buggy_preempt
        return engine


class PrefillOnlyStepCrashes:
    """cb_impl with the crash it once had (see the module docstring): a step whose batch samples nothing raises what
    the Gumbel race's chunk view raised on zero rows."""

    def __new__(cls, model, **options):
        from cbverify.engines.cb_impl_engine import CbImplEngine

        options.setdefault("num_blocks", 256)  # a small cache on CPU (cb_impl's default sizes it from free memory)
        engine = CbImplEngine(model, **options)
        runner = engine.engine.runner
        run = runner.run

        def crashing_run(batch):
            if not batch.samples:  # partial prefills only
                raise RuntimeError("cannot reshape tensor of 0 elements into shape [0, -1, 64]")
            return run(batch)

        runner.run = crashing_run
        return engine


# Faulty sessions around transformers CB for the fuzzer (``cbverify.fuzz.drivers.Session``): each breaks one thing.
def _fuzz_session(mutate):
    from cbverify.fuzz.drivers import Session

    class FaultySession(Session):
        def call(self, step):
            return mutate(self, super().call(step))

    return FaultySession


def _drop_last(session, result):
    result.raw = result.raw[:-1]
    result.ordered = result.ordered[:-1] + [None]
    return result


def _reuse_id(session, result, _seen: dict = {}):  # noqa: B006 - the ids each session has already answered
    from dataclasses import replace as dc_replace

    previous = _seen.setdefault(id(session), [])
    if previous and result.raw:  # answer the call's first request under an id from an earlier call
        result.raw = [dc_replace(result.raw[0], request_id=previous[0]), *result.raw[1:]]
        result.ordered = _order_like(result)
    previous += [o.request_id for o in result.raw]
    return result


def _order_like(result):
    """The call's answers per request, re-read from ``raw`` by request id (as the session orders them)."""
    wanted = [o.request_id if o is not None else None for o in result.ordered]
    by_id = {o.request_id: o for o in result.raw}
    return [by_id.get(rid) for rid in wanted]


def _leave_eval(session, result):
    session.model.eval()
    return result


def _reorder_after_eviction(session, result):
    if result.evictions:
        result.ordered = list(reversed(result.ordered))
    return result


DropsLastRequest = _fuzz_session(_drop_last)
ReusesRequestId = _fuzz_session(_reuse_id)
LeavesEvalMode = _fuzz_session(_leave_eval)
ReordersAfterEviction = _fuzz_session(_reorder_after_eviction)


def _ignores_min_new_tokens():
    from cbverify.fuzz.drivers import Session

    class IgnoresMinNewTokens(Session):
        def _gen_config(self):
            config = super()._gen_config()
            config.min_new_tokens = None
            return config

    return IgnoresMinNewTokens


IgnoresMinNewTokens = _ignores_min_new_tokens()


def _vllm_raw_logprobs():
    from cbverify.engines.remote import RemoteEngine
    from cbverify.fuzz.drivers import Session

    class VLLMRawLogprobs(Session):
        """The fuzzer's vLLM session on ``faulty_vllm.RawLogprobsDeclaredProcessed`` (raw log-probs, declared
        processed): every sampled call under a temperature other than 1 or a top-k / top-p cut must be caught."""

        def _new_engine(self):
            return RemoteEngine(self.model, engine="property_tests.faulty_vllm:RawLogprobsDeclaredProcessed",
                                env="vllm", name="vllm", **self.engine_options())  # fmt: skip

    return VLLMRawLogprobs


VLLMRawLogprobs = _vllm_raw_logprobs()


def _cb_impl(model, options):
    from cbverify.engines.cb_impl_engine import CbImplEngine

    return CbImplEngine(model, **options)


class CbOnlyFirstEos:
    """cb_impl with the first-EOS-only bug (see the module docstring)."""

    def __new__(cls, model, **options):
        engine = _cb_impl(model, options)
        llm = engine.engine
        enqueue = llm._enqueue

        def buggy_enqueue(request) -> None:
            enqueue(request)
            llm._live[request.request_id].eos_token_ids = frozenset(request.eos_token_ids[:1])

        llm._enqueue = buggy_enqueue
        return engine


class CowSkippedAtTwoSharers:
    """cb_impl with the copy-on-write bug at two sharers (see the module docstring)."""

    def __new__(cls, model, **options):
        engine = _cb_impl(model, options)
        bm = engine.engine.block_manager
        refs = bm.ref_counts
        may_append = bm.may_append

        def buggy_append(seq, num_new_tokens):
            start, table, bs = seq.num_computed_tokens, seq.block_table, bm.block_size
            if not (start % bs and refs[table[start // bs]] == 2):
                return may_append(seq, num_new_tokens)
            seq.count("cow_2")  # the engine reports the copy (a verdict must not rest on the engine's word) ...
            grow = -(-(start + num_new_tokens) // bs) - len(table)  # ... but never makes it: both sequences write
            table.extend(bm._take() for _ in range(max(0, grow)))  # into the shared block
            return []

        bm.may_append = buggy_append
        return engine


class FollowerParentSeed:
    """cb_impl with the follower seed bug (see the module docstring)."""

    def __new__(cls, model, **options):
        from cb_impl.sampler import sampling_row

        engine = _cb_impl(model, options)
        llm = engine.engine
        scheduler = llm.scheduler
        admit = scheduler._admit
        requests: dict[str, RolloutRequest] = {}
        enqueue = llm._enqueue

        def remembering_enqueue(request) -> None:
            requests[request.request_id] = request
            enqueue(request)

        wrong: list = []

        def buggy_admit(batch, budget):
            budget = admit(batch, budget)
            for seq in scheduler.running:
                if seq.parent is not None:  # a follower, forked (and sampled) after this step: the parent's seed
                    own, parent = requests[seq.request_id], requests[seq.parent.request_id]
                    seq.sampler_row = sampling_row(own.sampling, parent.seed)
                    wrong.append(seq)
            return budget

        def postprocess(batch, tokens, logprobs):
            finished = scheduler_postprocess(batch, tokens, logprobs)
            for seq in wrong:  # from its second token on, its own seed again
                seq.sampler_row = sampling_row(requests[seq.request_id].sampling, requests[seq.request_id].seed)
            if wrong:
                wrong.clear()
                llm._sampled_seqs = []  # the engine rebuilds its sampling constants from the rows
            return finished

        scheduler_postprocess = scheduler.postprocess
        llm._enqueue, scheduler._admit, scheduler.postprocess = remembering_enqueue, buggy_admit, postprocess
        return engine
