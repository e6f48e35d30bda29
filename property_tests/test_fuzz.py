"""``cbverify fuzz``: registered findings still reproduce (strict), a written repro script reproduces its failure in
a subprocess, a small derandomised search finds nothing unregistered, and a faulty session is caught; the same for
the ``generate_batch`` entry point, whose every check is shown to fail on a planted fault."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import transformers
from hypothesis import given

from cbverify.engines import transformers_compat as compat
from cbverify.fuzz import repro
from cbverify.fuzz.batch_driver import BatchSession
from cbverify.fuzz.batch_judge import Intent, banned_by_ngrams, intent, processed
from cbverify.fuzz.case import FuzzCase, FuzzRequest, Step
from cbverify.fuzz.drivers import CallResult, Output, Session
from cbverify.fuzz.findings import FUZZ_FINDINGS, explaining
from cbverify.fuzz.run import Pristine, run_case
from cbverify.fuzz.search import explore
from cbverify.upstream.findings import transformers_in
from property_tests import faulty
from property_tests.helpers import needs_vllm
from property_tests.strategies import generation_layers, ngram_sequences
from reference import tasks
from reference.generate import next_token_logits
from reference.models import BUNDLED

DEFAULT_EXAMPLES = 4  # ~4 s each on one thread: the default suite keeps the fuzz under a minute
CB_IMPL_EXAMPLES = 6  # cb_impl's search, shared by the bundled checkpoints (~1 s each)
VLLM_EXAMPLES = 6  # ~10-15 s each (a vLLM worker per case): make test-vllm


@pytest.mark.parametrize("finding", FUZZ_FINDINGS, ids=lambda f: f.id)
def test_every_registered_fuzz_finding_still_reproduces(llama, finding):
    """Strict both ways (``cbverify matrix`` runs it on every release): inside the finding's ``transformers`` range
    the repro must fail as registered, with the details the finding predicts (the day upstream fixes it, or fails
    it another way, this fails and the entry is updated), outside it the repro must pass (else the range is
    mis-scoped) except where another registered finding explains the failure (e.g. before 5.18 a persistent
    generate_batch's second call returns nothing, which hides what a later call would show)."""
    if missing := finding.missing():  # a release without continuous batching (4.x) cannot have fixed its bug
        pytest.skip(f"n/a({missing})")
    if not finding.applies(finding.repro):  # e.g. a paused manager before transformers had pause()
        pytest.skip(f"{finding.id}: its repro cannot be expressed on transformers {transformers.__version__}")
    pristine = Pristine(llama.model)
    try:
        failures = [f for f in run_case(llama.model, finding.repro).failures if f.check in finding.checks]
    finally:
        pristine.restore()
    seen = [(f.check, f.detail) for f in failures]
    explained = {f: explaining(finding.engine, f.check, f.detail, finding.repro)[0] for f in failures}
    if not transformers_in(finding.transformers):  # a failure another registered finding explains may hide it
        assert all(explained.values()), (
            f"{finding.id} reproduces on transformers {transformers.__version__}, outside its registered range "
            f"{finding.transformers!r}: {seen}"
        )
        return
    assert failures, f"{finding.id} no longer reproduces (FIXED?)"
    assert all(finding.covers(f.check, finding.repro) for f in failures)
    mine = [f for f in failures if finding.mismatch(f.check, f.detail, finding.repro) is None]
    assert mine, f"{finding.id} fails otherwise than it predicts: {seen}"
    assert all(explained.values()), f"{finding.id}: a failure no finding predicts: {seen}"


def test_a_written_repro_script_reproduces_its_failure_standalone(tmp_path):
    finding = next(f for f in FUZZ_FINDINGS if f.id == "cb-drops-min-new-tokens")
    script = repro.write(tmp_path, finding.repro, "min-new-tokens", finding.evidence, finding.id)[-1]
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "min-new-tokens: REPRODUCED" in done.stdout


def test_a_small_fuzz_of_transformers_cb_finds_only_registered_failures(llama):
    """Any class no registered finding predicts fails (FAIL or FAIL(not <id>: ...)). The pair plan's first case (every
    sampler option at once) samples with per_request_processors and requests that leave top_p unset."""
    report = explore(llama.model, "transformers-cb", model_name="tiny-llama-arith", examples=DEFAULT_EXAMPLES)
    assert report.examples == DEFAULT_EXAMPLES
    assert not report.unregistered, [(c.check, c.verdict, c.detail, c.case.dumps()) for c in report.unregistered]


# A sampled request with per_request_processors that passes temperature only: its top_p is the manager config's
# placeholder 0.999 (cbverify.fuzz.case.PER_REQUEST_PLACEHOLDERS), which cuts the last 0.1% of the mass. Shrunk from
# the 40-case manager fuzz (seed 0), where an oracle reading the unset top_p as 1.0 saw the engine's log-probs above
# its own by 2e-4 to 1e-3 (here 8.8e-4 at position 0).
PER_REQUEST_UNSET_TOP_P = FuzzCase(
    "transformers-cb", "tiny-llama-arith", False,
    {"allow_block_sharing": False, "max_batch_tokens": 64, "num_blocks": 6, "page_size": 8,
     "per_request_processors": True, "return_logprobs": True, **({"seed": 1530} if compat.has("seed") else {})},
    {"do_sample": True}, (Step("call", (FuzzRequest("r", (1, 10, 19, 16, 25, 3, 5, 28, 9, 15), 8, (), 1.0, None,
                                                    None, 900),)),),
)  # fmt: skip


class PlaceholderTopP(Session):
    """The manager's GenerationConfig carries another top_p placeholder (0.99) than the one the oracle reads."""

    def _gen_config(self):
        config = super()._gen_config()
        config.top_p = 0.99
        return config


def test_an_unset_per_request_top_p_is_judged_as_the_managers_placeholder(llama):
    """Real transformers CB passes the logprobs check on the case; the same session with a manager config whose
    placeholder the oracle does not read (0.99: up to 1% of the mass cut) fails it, unregistered, with the engine's
    log-prob above the oracle's (the check judges this case's log-probs)."""
    outcomes = {}
    for name, factory in (("real", None), ("other placeholder", PlaceholderTopP)):
        pristine = Pristine(llama.model)
        try:
            outcomes[name] = run_case(llama.model, PER_REQUEST_UNSET_TOP_P, *(() if factory is None else (factory,)))
        finally:
            pristine.restore()
    real = [f.detail for f in outcomes["real"].failures if f.check == "logprobs"]
    assert not real, real
    faulty = [f.detail for f in outcomes["other placeholder"].failures if f.check == "logprobs"]
    assert faulty, outcomes["other placeholder"].failures
    got, oracle = (float(x) for x in re.search(r"got (\S+), oracle (\S+) \(", faulty[0]).groups())
    assert got > oracle, faulty[0]
    assert explaining("transformers-cb", "logprobs", faulty[0], PER_REQUEST_UNSET_TOP_P) == (None, ""), faulty[0]


@pytest.mark.parametrize("model", BUNDLED)
def test_a_small_fuzz_of_cb_impl_on_each_bundled_checkpoint_finds_no_failure(model, tmp_path, capsys):
    """``cbverify fuzz --engine cb_impl`` on every bundled checkpoint, :data:`CB_IMPL_EXAMPLES` shared among them: our
    engine has no registered finding, so any failure class fails the command and this test."""
    from cbverify.cli import main

    examples = max(1, CB_IMPL_EXAMPLES // len(BUNDLED))
    out = tmp_path / "fuzz.json"
    code = main(["fuzz", "--engine", "cb_impl", "--model", model, "--examples", str(examples), "--json", str(out)])
    summary = json.loads(out.read_text())
    assert (code, summary["examples"], summary["classes"]) == (0, examples, []), capsys.readouterr().out[-3000:]


@pytest.mark.vllm
@needs_vllm
def test_a_small_fuzz_of_vllms_scheduler_options_finds_only_registered_failures(llama):
    """vLLM in its environment, one worker per case (~10 s each): sequence and token budgets, chunked prefill on and
    off, prefix caching, KV caches small enough to preempt; greedy tokens and every log-prob against the oracle."""
    report = explore(llama.model, "vllm", model_name="tiny-llama-arith", examples=VLLM_EXAMPLES)
    assert report.examples == VLLM_EXAMPLES
    assert not report.unregistered, [(c.check, c.detail) for c in report.unregistered]


@pytest.mark.vllm
@needs_vllm
def test_a_vllm_session_returning_raw_log_probs_declared_processed_is_caught(llama):
    report = explore(llama.model, "vllm", model_name="tiny-llama-arith", examples=VLLM_EXAMPLES,
                     session_factory=faulty.VLLMRawLogprobs, engine_label="faulty:vllm-raw-logprobs")  # fmt: skip
    assert "logprobs" in {c.check for c in report.unregistered}, report.classes


def test_a_session_that_drops_the_last_request_is_caught(llama):
    report = explore(llama.model, "transformers-cb", model_name="tiny-llama-arith", examples=4,
                     session_factory=faulty.DropsLastRequest, engine_label="faulty:drops-last")  # fmt: skip
    assert "lost-request" in {c.check for c in report.unregistered}


@pytest.mark.parametrize(
    ("fault", "check"),
    [("ReusesRequestId", "lost-request"), ("LeavesEvalMode", "state:training-mode"),
     ("IgnoresMinNewTokens", "min-new-tokens")],
)  # fmt: skip
def test_each_faulty_cb_session_is_caught_by_the_small_fuzz(llama, fault, check):
    """A wrapped engine is never covered by the real engine's findings, so its failures are all unregistered; the
    fault's own check must be among them (eval mode and min_new_tokens are also real CB findings: the check that
    flags the real engine is the one that flags the wrapper)."""
    report = explore(llama.model, "transformers-cb", model_name="tiny-llama-arith", examples=4,
                     session_factory=getattr(faulty, fault), engine_label=f"faulty:{fault}")  # fmt: skip
    assert check in {c.check for c in report.unregistered}


def test_results_reordered_after_an_eviction_are_caught(llama):
    """A cache of 6 pages of 4 tokens for 6 requests of 8 + 16 tokens: the manager must evict; only then does the
    faulty session reorder its answers, and the judge must see it where the real session passes the same checks."""
    from cbverify.fuzz.case import FuzzCase, FuzzRequest, Step
    from reference import tasks

    requests = tuple(FuzzRequest(f"r{i}", tuple(tasks.prompt_ids(p))[:8], 16, ()) for i, p in
                     enumerate(tasks.make_problems(6, seed=3)))  # fmt: skip
    case = FuzzCase("transformers-cb", "tiny-llama-arith", persistent=False, generation={"do_sample": False},
                    config={"page_size": 4, "num_blocks": 6, "max_batch_tokens": 8, "return_logprobs": True},
                    steps=(Step("call", requests),))  # fmt: skip
    outcomes = {}
    for name, factory in (("real", None), ("faulty", faulty.ReordersAfterEviction)):
        pristine = Pristine(llama.model)
        try:
            outcomes[name] = run_case(llama.model, case, *(() if factory is None else (factory,)))
        finally:
            pristine.restore()
    assert "evicted" in outcomes["real"].features and "evicted" in outcomes["faulty"].features
    assert outcomes["faulty"].checks - outcomes["real"].checks, (outcomes["faulty"].checks, outcomes["real"].checks)


def test_a_written_json_record_replays_as_the_same_case(tmp_path):
    """The JSON next to each repro script is enough to re-run the case with ``FuzzCase.from_json``."""
    import json

    from cbverify.fuzz.case import FuzzCase

    for finding in FUZZ_FINDINGS:  # manager programs and generate_batch ones (per-call configs, options, pauses)
        record = repro.write(tmp_path, finding.repro, "x", "detail", finding.id)[0]
        assert FuzzCase.from_json(json.loads(record.read_text())["case"]) == finding.repro


# ------------------------------------------------------------------------------------------------ model.generate_batch
BATCH_EXAMPLES = 4  # ~0.7 s each on one thread


def test_a_small_generate_batch_fuzz_finds_only_registered_failures(llama):
    """Any class no registered finding predicts fails (FAIL or FAIL(not <id>: ...))."""
    report = explore(llama.model, "transformers-cb", model_name="tiny-llama-arith", examples=BATCH_EXAMPLES,
                     entry="generate_batch")  # fmt: skip
    assert report.examples == BATCH_EXAMPLES
    assert not report.unregistered, [(c.check, c.verdict, c.detail, c.case.dumps()) for c in report.unregistered]
    assert report.decisive["result-count"] and report.decisive["conventions"], report.decisive  # calls were judged


@pytest.mark.slow
def test_a_larger_generate_batch_fuzz_finds_only_registered_failures(llama):
    report = explore(llama.model, "transformers-cb", model_name="tiny-llama-arith", examples=60, seed=1,
                     entry="generate_batch")  # fmt: skip
    assert not report.unregistered, [(c.check, c.detail, c.case.dumps()) for c in report.unregistered]


@given(ngram_sequences())
def test_the_ngram_ban_is_the_documented_rule(drawn):
    """``no_repeat_ngram_size`` n: "all ngrams of that size can only occur once". A token is banned exactly when
    appending it makes the sequence's last n-gram occur twice (counted over every n-gram of the longer sequence)."""
    sequence, n = drawn
    for token in range(5):
        longer = [*sequence, token]
        grams = [tuple(longer[i : i + n]) for i in range(len(longer) - n + 1)]
        repeats = len(longer) >= n and grams.count(tuple(longer[-n:])) > 1
        assert (token in banned_by_ngrams(sequence, n)) == repeats, (sequence, n, token)


@given(generation_layers())
def test_a_call_takes_each_option_from_its_most_specific_source(layers):
    """generate()'s rule: keyword argument, then the config passed, then ``model.generation_config``, then the
    defaults (a field left unset falls through)."""
    options, config, model_generation, defaults = layers
    want = intent(config, options, model_generation, defaults)

    def first(name, fallback):
        return next((layer[name] for layer in layers if layer.get(name) is not None), fallback)

    eos = first("eos_token_id", [])
    assert want.eos == ((eos,) if isinstance(eos, int) else tuple(eos))
    assert (want.max_new_tokens, want.top_k, want.temperature) == (
        first("max_new_tokens", None), first("top_k", 0), first("temperature", 1.0))  # fmt: skip
    assert (want.min_length, want.num_return_sequences) == (first("min_length", 0), first("num_return_sequences", 1))


# Meta-tests: a correct generate_batch written from its documentation (no continuous batching: the oracle's processor
# chain, one input at a time) passes every check on hand-built cases; each fault below, planted in it or around the
# real session, must be caught by the check named beside it. A random-weight model keeps the distributions flat, so
# a fault changes what comes out.
V = tasks.VOCAB_SIZE
P1, P2 = (1, 6, 5, 16, 7, 5, 3), (1, 19, 17, 10, 5, 13, 12, 10, 13, 11, 22)


def _batch_case(*steps, generation: dict, persistent: bool = False, **config) -> FuzzCase:
    def call(i, prompts, n):
        reqs = tuple(FuzzRequest(f"c{i}-i{j}", p, n, ()) for j, p in enumerate(prompts))
        return Step("call", reqs, options={"max_new_tokens": n})

    made, i = [], 0
    for s in steps:
        made.append(s if isinstance(s, Step) else call(i, *s))
        i += not isinstance(s, Step)
    cfg = {"page_size": 4, "num_blocks": 32, "max_batch_tokens": 16, "return_logprobs": True, **config}
    return FuzzCase("transformers-cb", "tiny-llama-arith", persistent, cfg, generation, tuple(made),
                    entry="generate_batch")  # fmt: skip


GROUPS = _batch_case(([P1, P2], 4), generation={"do_sample": True, "num_return_sequences": 2, "eos_token_id": 2,
                                                 "top_k": V + 7, "temperature": 1.5})  # fmt: skip
CUT = _batch_case(([P1, P1], 6), generation={"do_sample": True, "top_k": 3, "eos_token_id": []})
# the trained model ends P1's answer with EOS after 6 tokens: a minimum of 8 completion tokens holds it back
MIN_LENGTH = _batch_case(([P1], 9), generation={"do_sample": False, "eos_token_id": 2, "min_length": len(P1) + 8})
NGRAM = _batch_case(([tuple(range(1, 21))], 8), generation={"do_sample": False, "eos_token_id": [],
                                                            "no_repeat_ngram_size": 1})  # fmt: skip
LENGTH = _batch_case(([P1], 3), generation={"do_sample": False, "eos_token_id": []})
CHANGED = _batch_case(([P2], 5), Step("update_weights", seed=3), ([P2], 5), persistent=True,
                      generation={"do_sample": False, "eos_token_id": []})  # fmt: skip


class DocumentedBatch(BatchSession):
    """A correct generate_batch: every input's results (``req_<i>``, then ``__child#k``), inputs in order."""

    def wanted(self, step) -> Intent:
        return intent(self.case.generation_of(step), step.options, self.model.generation_config.to_dict(),
                      compat.generation_defaults())  # fmt: skip

    def call(self, step):
        gen = self.generation_config(step)
        self.passed_configs.append((gen, copy.deepcopy(gen.to_dict())))
        want, rng = self.wanted(step), torch.Generator().manual_seed(len(self.passed_configs))
        raw = []
        for j, r in enumerate(step.requests):
            for k in range(want.num_return_sequences):
                tokens, logprobs = self.complete(want, r.prompt_ids, rng)
                rid = f"req_{j}" + (f"__child#{k}" if k else "")
                raw.append(Output(rid, tuple(tokens), tuple(logprobs), None, tuple(r.prompt_ids)))
        return CallResult(raw, list(raw))

    def complete(self, want: Intent, prompt, rng) -> tuple[list[int], list[float]]:
        tokens, logprobs = [], []
        for _ in range(want.max_new_tokens):
            scores = processed(self.model, want, prompt, tokens)
            pick = torch.multinomial(self.sampled_from(want, prompt, tokens).exp(), 1, generator=rng)
            token = int(pick) if want.do_sample else int(torch.argmax(scores))
            tokens.append(token)
            logprobs.append(self.logprob(scores, want, prompt, tokens))
            if token in want.eos:
                break
        return tokens, logprobs

    def sampled_from(self, want, prompt, tokens):
        return processed(self.model, want, prompt, tokens)

    def logprob(self, scores, want, prompt, tokens) -> float:
        return float(scores[tokens[-1]])


class DropsNumReturnSequences(DocumentedBatch):
    def wanted(self, step):
        return replace(super().wanted(step), num_return_sequences=1)


class ReordersInputs(DocumentedBatch):
    def call(self, step):
        result = super().call(step)
        result.raw = result.ordered = list(reversed(result.raw))
        return result


class IgnoresMinLength(DocumentedBatch):
    def wanted(self, step):
        return replace(super().wanted(step), min_length=0)


class IgnoresNoRepeatNgram(DocumentedBatch):
    def wanted(self, step):
        return replace(super().wanted(step), no_repeat_ngram_size=0)


class CutsTopKBeyondVocab(DocumentedBatch):
    """top_k >= V taken modulo V (a wrap instead of 'no cut')."""

    def wanted(self, step):
        want = super().wanted(step)
        return replace(want, top_k=want.top_k % V if want.top_k >= V else want.top_k)


class SamplesOutsideSupport(DocumentedBatch):
    """Samples from the whole vocabulary, as if no top-k / top-p / min-p were asked."""

    def sampled_from(self, want, prompt, tokens):
        return processed(self.model, replace(want, top_k=0, top_p=1.0, min_p=0.0), prompt, tokens)


class ReturnsRawLogprobs(DocumentedBatch):
    def logprob(self, scores, want, prompt, tokens) -> float:
        return float(torch.log_softmax(next_token_logits(self.model, [*prompt, *tokens[:-1]]), -1)[tokens[-1]])


class OverrunsMaxNewTokens(DocumentedBatch):
    def complete(self, want, prompt, rng):
        tokens, logprobs = super().complete(replace(want, max_new_tokens=want.max_new_tokens + 1), prompt, rng)
        return tokens, logprobs


class ServesTheFirstCallAgain(DocumentedBatch):
    """A persistent manager answering a prompt it has seen from its first answer (weights changed since)."""

    def complete(self, want, prompt, rng, _seen: dict = {}):  # noqa: B006 - per-session memory, keyed by session
        key = (id(self), tuple(prompt))
        if key not in _seen:
            _seen[key] = super().complete(want, prompt, rng)
        return _seen[key]


@pytest.fixture(scope="module")
def flat_model():
    from reference.models import random_like

    return random_like("tiny-llama-arith", seed=0)[0]


@pytest.mark.parametrize(
    ("fault", "case", "check", "model"),
    [(DropsNumReturnSequences, GROUPS, "result-count", "flat_model"),
     (ReordersInputs, GROUPS, "results-order", "flat_model"), (CutsTopKBeyondVocab, GROUPS, "logprobs", "flat_model"),
     (SamplesOutsideSupport, CUT, "support", "flat_model"), (ReturnsRawLogprobs, CUT, "logprobs", "flat_model"),
     (IgnoresMinLength, MIN_LENGTH, "min-new-tokens", "llama"),
     (IgnoresNoRepeatNgram, NGRAM, "no-repeat-ngram", "flat_model"),
     (OverrunsMaxNewTokens, LENGTH, "conventions", "flat_model"),
     (ServesTheFirstCallAgain, CHANGED, "tokens", "flat_model")],
    ids=lambda v: v.__name__ if isinstance(v, type) else v if isinstance(v, str) else "",
)  # fmt: skip
def test_each_generate_batch_check_catches_its_planted_fault(request, fault, case, check, model):
    model = request.getfixturevalue(model)
    model = model.model if isinstance(model, tuple) else model  # the llama fixture is (model, tokenizer)
    outcomes = {}
    for name, factory in (("documented", DocumentedBatch), ("faulty", fault)):
        pristine = Pristine(model)
        try:
            outcomes[name] = run_case(model, case, factory)
        finally:
            pristine.restore()
    correct, broken = outcomes["documented"], outcomes["faulty"]
    assert not correct.checks, [(f.check, f.detail) for f in correct.failures]  # no false alarm on a correct engine
    assert check in correct.decisive, correct.decisive  # the case can make the check fail ...
    assert check in broken.checks, [(f.check, f.detail) for f in broken.failures]  # ... and the fault does


@pytest.mark.parametrize(("mutate", "check"), [("drop-children", "result-count"), ("reverse", "results-order")])
def test_the_real_generate_batchs_results_broken_after_the_call_are_caught(llama, mutate, check):
    """Real transformers CB on GROUPS (two prompts, num_return_sequences=2, top_k beyond the vocabulary, log-probs)
    passes count, order, support and log-probs; the same results with the children dropped or the inputs reversed
    fail the check."""

    class Broken(BatchSession):
        def call(self, step):
            result = super().call(step)
            kept = [o for o in result.raw if "__child#" not in o.request_id] if mutate == "drop-children" else (
                list(reversed(result.raw)))  # fmt: skip
            result.raw = result.ordered = kept
            return result

    outcomes = {}
    for name, factory in (("real", None), ("broken", Broken)):
        pristine = Pristine(llama.model)
        try:
            outcomes[name] = run_case(llama.model, GROUPS, factory)
        finally:
            pristine.restore()
    real = outcomes["real"].failures
    unexplained = [
        (f.check, f.detail) for f in real if not explaining("transformers-cb", f.check, f.detail, GROUPS)[0]
    ]
    assert not unexplained, unexplained
    registered = outcomes["real"].checks
    if registered & {"result-count", check}:  # e.g. before 5.18 generate_batch drops the forked sequences itself
        pytest.skip(f"transformers {transformers.__version__} already fails {registered} on this case (registered)")
    assert {"result-count", "results-order", "logprobs"} <= outcomes["real"].decisive
    assert check in outcomes["broken"].checks - outcomes["real"].checks


@pytest.mark.slow
def test_a_generate_batch_that_never_returns_is_reported_as_a_crash(llama):
    """A persistent manager asked for more num_return_sequences than its first config had waits forever (the
    registered cb-persistent-manager-keeps-the-first-generation-config): the session stops the manager after its
    timeout and the judge reports engine-crash, covered by that finding."""
    case = _batch_case(([P1], 2), Step("call", (FuzzRequest("c1-i0", P1, 2, ()),), generation={"do_sample": True,
                       "num_return_sequences": 2, "max_new_tokens": 2}, options={}), persistent=True,
                       generation={"do_sample": True, "max_new_tokens": 2})  # fmt: skip
    pristine = Pristine(llama.model)
    try:
        outcome = run_case(llama.model, case, lambda **kw: BatchSession(**kw, timeout_s=3.0))
    finally:
        pristine.restore()
    crash = [f.detail for f in outcome.failures if f.check == "engine-crash"]
    assert crash and "did not return" in crash[0], outcome.failures
    finding, why = explaining("transformers-cb", "engine-crash", crash[0], case)
    assert finding and finding.id == "cb-persistent-manager-keeps-the-first-generation-config", why


@pytest.mark.slow
def test_a_written_generate_batch_repro_script_reproduces_its_failure_standalone(tmp_path):
    finding = next(f for f in FUZZ_FINDINGS if f.id == "cb-drops-min-length")
    script = repro.write(tmp_path, finding.repro, "min-new-tokens", finding.evidence, finding.id)[-1]
    assert "generate_batch" in script.read_text()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "min-new-tokens: REPRODUCED" in done.stdout


def test_the_cli_fuzzes_generate_batch_and_reports_decisive_checks(tmp_path, capsys):
    import argparse
    import json

    from cbverify.cli import fuzz as cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["--entry", "generate_batch", "--examples", "2", "--json", str(tmp_path / "r.json")])
    code = cli.run(args)
    payload = json.loads((tmp_path / "r.json").read_text())
    out = capsys.readouterr().out
    unregistered = [c for c in payload["classes"] if c["finding"] is None]
    assert code == (1 if unregistered else 0), out  # 1 exactly when an unregistered class was found, and printed
    assert payload["entry"] == "generate_batch" and payload["examples"] == 2
    assert payload["decisive"]["result-count"] >= 1 and "checks:" in out
    # options in pairs: the line is printed and written, counted from the two cases that ran
    assert f"pairs:    {payload['pair_coverage']}" in out and payload["pairs"]["cases"] == 2


# ----------------------------------------------------------------------------------------------- cb_impl repro scripts
def _preemption_keeps_computed(monkeypatch):
    """cb_impl's recompute preemption forgets to reset the computed-token count (``faulty.PreemptionKeepsComputed``,
    on the class: the repro script builds its own engine)."""
    from cb_impl.scheduler import Scheduler

    preempt = Scheduler.preempt

    def buggy(self, seq) -> None:
        computed = seq.num_computed_tokens
        preempt(self, seq)
        seq.num_computed_tokens = computed

    monkeypatch.setattr(Scheduler, "preempt", buggy)


def _noise_one_position_ahead(monkeypatch):
    """The sampler draws each token with the spec noise of the next completion position."""
    import cb_impl.engine

    sample = cb_impl.engine.sample

    def ahead(logits, b, positions, *a):
        return sample(logits, b, positions + 1, *a)

    monkeypatch.setattr(cb_impl.engine, "sample", ahead)


def _raw_logprobs(monkeypatch):
    """The sampled tokens are right, their log-probs those of the raw distribution instead of the processed one."""
    import cb_impl.engine

    sample = cb_impl.engine.sample

    def raw(logits, b, positions, *a):
        tokens, _ = sample(logits, b, positions, *a)
        return tokens, torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]

    monkeypatch.setattr(cb_impl.engine, "sample", raw)


def _cb_impl_case(model: str, n: int, max_new: int, config: dict, temperature: float) -> FuzzCase:
    eos = (tasks.EOS_ID,) if temperature else ()
    prompts = [tuple(tasks.prompt_ids(p))[:8] for p in tasks.make_problems(n, seed=3)]
    reqs = tuple(FuzzRequest(f"r{i}", p, max_new, eos, temperature=temperature, seed=11 + i)
                 for i, p in enumerate(prompts))  # fmt: skip
    base = dict(block_size=4, num_blocks=16, max_batch_tokens=16, max_num_seqs=256, enable_prefix_sharing=False)
    return FuzzCase("cb_impl", model, persistent=False, config={**base, **config},
                    generation={"do_sample": bool(temperature)}, steps=(Step("call", reqs),))  # fmt: skip


CB_IMPL_FAULTS = {  # fault -> (the case that shows it, the check that must fail)
    "preemption-keeps-computed": (_preemption_keeps_computed,
                                  _cb_impl_case("tiny-llama-arith", 3, 8, {"num_blocks": 5}, 0.0), "engine-crash"),
    "noise-one-position-ahead": (_noise_one_position_ahead, _cb_impl_case("tiny-qwen2-random", 2, 6, {}, 1.0),
                                 "tokens"),
    "raw-logprobs": (_raw_logprobs, _cb_impl_case("tiny-qwen2-random", 2, 6, {}, 0.7), "logprobs"),
}  # fmt: skip


@pytest.mark.parametrize("fault", CB_IMPL_FAULTS)
def test_a_written_cb_impl_repro_script_fails_on_a_faulty_cb_impl_and_passes_on_the_real_one(
    request, tmp_path, monkeypatch, capsys, fault
):  # fmt: skip
    """The fuzz judge fails the case on cb_impl with one planted fault; the repro script written for that failure
    (run in this process, so it builds the patched engine) exits 1 with the check REPRODUCED, and, the fault removed,
    the judge and the same script both pass it (exit 0)."""
    import runpy

    plant, case, check = CB_IMPL_FAULTS[fault]
    model = request.getfixturevalue("llama" if case.model == "tiny-llama-arith" else "qwen2").model

    def judged() -> set[str]:
        pristine = Pristine(model)
        try:
            return run_case(model, case).checks
        finally:
            pristine.restore()

    def script_exit() -> tuple[int, str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(script), run_name="__main__")
        return done.value.code, capsys.readouterr().out

    plant(monkeypatch)
    assert check in judged()
    script = repro.write(tmp_path, case, check, "planted", None)[-1]
    assert script.suffix == ".py"
    code, out = script_exit()
    assert (code, f"{check}: REPRODUCED") == (1, out.splitlines()[-1]), out
    monkeypatch.undo()
    assert not judged()
    code, out = script_exit()
    assert (code, f"{check}: not reproduced") == (0, out.splitlines()[-1]), out


def test_a_written_cb_impl_repro_script_runs_standalone(tmp_path):
    """The shrunk case of a real cb_impl crash (`cbverify fuzz --engine cb_impl --model tiny-qwen3-chat`: a step of
    partial prefills only reached the sampler with zero rows), written by ``repro.write`` and run as a user runs it
    (its own process, another folder): it needs no cbverify, and on the fixed engine it says not reproduced, exit 0."""
    import re

    req = FuzzRequest("c0-p1-g2", (1, 20, 16, 24), 1, (2,), temperature=1.0, top_k=0, top_p=1.0, seed=50)
    case = FuzzCase("cb_impl", "tiny-qwen3-chat", persistent=False, generation={"do_sample": True, "min_p": None},
                    config={"block_size": 2, "enable_prefix_sharing": True, "max_batch_tokens": 2, "max_num_seqs": 1,
                            "num_blocks": 16}, steps=(Step("call", (req,)),))  # fmt: skip
    detail = "EngineStepError: model step failed for requests ['c0-p1-g2']: RuntimeError: cannot reshape tensor of 0"
    script = repro.write(tmp_path / "out", case, "engine-crash", detail, None)[-1]
    assert not re.search(r"^\s*(from|import)\s+cbverify", script.read_text(), re.M)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "engine-crash: not reproduced", done.stdout
    assert "c0-p1-g2: engine [" in done.stdout and "c0-p1-g2: oracle [" in done.stdout


# ------------------------------------------------------------------------------- the caller's plain forwards
# A persistent generate_batch with a training step between its calls, inside pause() where the release has one: the
# caller's plain forwards run after each call and inside the step, each against a twin that never had a manager.
PAUSED_TRAIN = _batch_case(([P1], 3), Step("train", seed=1, paused=compat.CAN_PAUSE), ([P2], 3),
                           persistent="persistent_manager" in compat.BATCH_PARAMETERS,
                           generation={"do_sample": False, "eos_token_id": []})  # fmt: skip
ONE_MANAGER_CALL = FuzzCase("transformers-cb", "tiny-llama-arith", False,
                            {"page_size": 4, "num_blocks": 16, "max_batch_tokens": 16}, {"do_sample": False},
                            (Step("call", (FuzzRequest("r", P2, 3, (2,)),)),))  # fmt: skip


class LeavesPagedAttention(BatchSession):
    """generate_batch leaves a paged attention kernel installed after the call (as 5.8's manager does; paged|eager,
    which later releases keep, where 5.24 reads paged|sdpa as sdpa)."""

    def generate(self, step):
        result = super().generate(step)
        self.model.set_attn_implementation("paged|eager")
        return result


class ForcesTrainMode(BatchSession):
    """generate_batch hands the model back in train mode whatever mode the caller set."""

    def generate(self, step):
        result = super().generate(step)
        self.model.train()
        return result


class TrainsThroughAHook(BatchSession):
    """The training step between calls runs with a hook on the logits (a manager's leftover inside its pause)."""

    def train_step(self, seed, paused=False):
        handle = self.model.lm_head.register_forward_hook(lambda module, args, out: out * 1.5)
        try:
            super().train_step(seed, paused)
        finally:
            handle.remove()


def _leaks_a_logits_hook():
    from cbverify.fuzz.drivers import Session

    class LeaksALogitsHook(Session):
        """The manager's call leaves a forward hook on the model's logits (removed by the test)."""

        handles: list = []

        def _cb_call(self, step):
            result = super()._cb_call(step)
            self.handles.append(self.model.lm_head.register_forward_hook(lambda module, args, out: out + 0.25 * out))
            return result

    return LeaksALogitsHook


LeaksALogitsHook = _leaks_a_logits_hook()


_REAL: dict = {}  # the real session's outcome per case, run once for every fault planted on that case


def _plain(outcome) -> list[str]:
    return [f.detail for f in outcome.failures if f.check == "plain-forward"]


@pytest.mark.parametrize(
    ("fault", "case", "shows"),
    [(LeavesPagedAttention, PAUSED_TRAIN, r"after call 0 \(.*\): attn_implementation 'paged\|eager' where the "
      r"caller set 'sdpa'"),
     (ForcesTrainMode, PAUSED_TRAIN, r"after call 0 \(.*\): training True where the caller set False$"),
     (TrainsThroughAHook, PAUSED_TRAIN, r"^training step \(.*\): training-step forward differs from a model that "
      r"never had a manager: loss"),
     (LeaksALogitsHook, ONE_MANAGER_CALL, r"after call 0 \(no manager left\): caller-mode forward differs from a "
      r"model that never had a manager")],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)  # fmt: skip
def test_a_plain_forward_changed_beside_the_manager_is_caught(llama, fault, case, shows):
    """Real transformers CB (bundled llama, sdpa, eval mode as the caller set them) passes the plain-forward check
    on the case, where it is decisive; the same session with one leftover planted beside the manager (its paged
    attention, train mode, a hook on the logits during the step or after the call) fails it with that detail."""
    outcomes = {}
    for name, factory in (("real", None), ("faulty", fault)):
        if name == "real" and case.dumps() in _REAL:
            outcomes[name] = _REAL[case.dumps()]
            continue
        pristine = Pristine(llama.model)
        try:
            outcomes[name] = run_case(llama.model, case, *(() if factory is None else (factory,)))
        finally:
            for handle in getattr(fault, "handles", []):
                handle.remove()
            pristine.restore()
        if name == "real":
            _REAL[case.dumps()] = outcomes[name]
    assert "plain-forward" in outcomes["real"].decisive, outcomes["real"].decisive
    assert not _plain(outcomes["real"]), _plain(outcomes["real"])
    assert any(re.search(shows, d) for d in _plain(outcomes["faulty"])), _plain(outcomes["faulty"])
    assert all(explaining("transformers-cb", "plain-forward", d, case)[0] is None for d in _plain(outcomes["faulty"]))
