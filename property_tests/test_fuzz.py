"""``cbverify fuzz``: registered findings still reproduce (strict), a written repro script reproduces its failure in
a subprocess, a small derandomised search finds nothing unregistered, and a faulty session is caught."""

from __future__ import annotations

import subprocess
import sys

import pytest
import transformers

from cbverify.fuzz import repro
from cbverify.fuzz.findings import FUZZ_FINDINGS
from cbverify.fuzz.run import Pristine, run_case
from cbverify.fuzz.search import explore
from cbverify.upstream.findings import transformers_in
from property_tests import faulty
from property_tests.helpers import needs_vllm

DEFAULT_EXAMPLES = 4  # ~4 s each on one thread: the default suite keeps the fuzz under a minute
VLLM_EXAMPLES = 6  # ~10-15 s each (a vLLM worker per case): make test-vllm


@pytest.mark.parametrize("finding", FUZZ_FINDINGS, ids=lambda f: f.id)
def test_every_registered_fuzz_finding_still_reproduces(llama, finding):
    """Strict both ways (``cbverify matrix`` runs it on every release): inside the finding's ``transformers`` range
    the repro must fail as registered (the day upstream fixes it this fails and the entry is updated), outside it
    the repro must pass (else the range is mis-scoped)."""
    if not finding.applies(finding.repro):  # e.g. a paused manager before transformers had pause()
        pytest.skip(f"{finding.id}: its repro cannot be expressed on transformers {transformers.__version__}")
    pristine = Pristine(llama.model)
    try:
        checks = run_case(llama.model, finding.repro).checks
    finally:
        pristine.restore()
    if not transformers_in(finding.transformers):
        assert not checks & set(finding.checks), (
            f"{finding.id} reproduces on transformers {transformers.__version__}, outside its registered range "
            f"{finding.transformers!r}: {checks}"
        )
        return
    assert checks & set(finding.checks), f"{finding.id} no longer reproduces (FIXED?): {checks}"
    assert all(finding.covers(c, finding.repro) for c in checks & set(finding.checks))


def test_a_written_repro_script_reproduces_its_failure_standalone(tmp_path):
    finding = next(f for f in FUZZ_FINDINGS if f.id == "cb-drops-min-new-tokens")
    script = repro.write(tmp_path, finding.repro, "min-new-tokens", finding.evidence, finding.id)[-1]
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "min-new-tokens: REPRODUCED" in done.stdout


def test_a_small_fuzz_of_transformers_cb_finds_only_registered_failures(llama):
    report = explore(llama.model, "transformers-cb", model_name="tiny-llama-arith", examples=DEFAULT_EXAMPLES)
    assert report.examples == DEFAULT_EXAMPLES
    assert not report.unregistered, [(c.check, c.detail) for c in report.unregistered]


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

    finding = FUZZ_FINDINGS[0]
    record = repro.write(tmp_path, finding.repro, "x", "detail", finding.id)[0]
    assert FuzzCase.from_json(json.loads(record.read_text())["case"]) == finding.repro
