"""A complete cbverify engine in ~40 lines: transformers ``generate()``, one request at a time (so it can honestly
claim batch invariance), returning each sampled token's processed log-prob. ``make_broken_engine`` is the same engine
with one fault (it drops each completion's last token), to see what a failing conformance report looks like."""

import torch
from transformers import GenerationConfig

from cbverify.engines import Capabilities
from reference.spec import Rollout


class ExampleEngine:
    name = "example-generate"
    capabilities = Capabilities(
        spec_sampling=False,
        per_request_max_new_tokens=True,
        per_request_sampling=True,
        per_request_eos=True,
        logprob_semantics="processed",
        claims_batch_invariance=True,
        follows_weight_updates=True,
    )

    def __init__(self, model, *, seed: int = 0, keep: int | None = None):
        self.model, self.seed, self.keep = model, seed, keep  # keep=-1: the broken copy's off-by-one

    def generate(self, requests):
        return [self._one(r) for r in requests]

    @torch.no_grad()
    def _one(self, request):
        s = request.sampling
        sample = s.temperature > 0
        config = GenerationConfig(
            do_sample=sample, temperature=s.temperature if sample else 1.0, top_p=s.top_p, min_p=s.min_p or None,
            top_k=s.top_k if sample else 0, max_new_tokens=s.max_new_tokens,
            eos_token_id=list(request.eos_token_ids) or None, pad_token_id=0, output_scores=True,
            return_dict_in_generate=True, repetition_penalty=1.0, min_length=0)  # fmt: skip
        ids = torch.tensor([request.prompt_ids], device=self.model.device)
        with torch.random.fork_rng(devices=[]):  # a seeded draw that leaves the caller's RNG alone
            torch.manual_seed(self.seed if request.seed is None else request.seed)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        tokens = out.sequences[0, ids.shape[1] :].tolist()[: self.keep]
        scores = out.scores[: len(tokens)]
        logprobs = [float(torch.log_softmax(x[0].float(), -1)[t]) for x, t in zip(scores, tokens, strict=True)]
        stop = bool(tokens) and tokens[-1] in request.eos_token_ids
        return Rollout(
            request.request_id, request.prompt_ids, tuple(tokens), tuple(logprobs), "stop" if stop else "length"
        )


def make_engine(model, **options):
    return ExampleEngine(model, **options)


def make_broken_engine(model, **options):
    return ExampleEngine(model, keep=-1, **options)
