"""verify judges a request in the domain of a deviation the engine declares (``Capabilities.deviations``) against the
deviation's own processing: an engine that does what it declares passes, and the report names the deviation and how
many requests it covered; the same engine undeclared fails, and so does one that declares a deviation it does not
follow. vLLM's declared ``min-p-before-top-p`` is the case (vLLM under the example recipe's min-p and top-p)."""

from __future__ import annotations

import pytest

from cbverify import report
from cbverify.engines import DEVIATIONS, Capabilities, declared_processing
from cbverify.tolerances import FP32
from property_tests import faulty
from reference import tasks
from reference.generate import generate, process_logits
from reference.spec import RolloutRequest

MIN_P_FIRST = DEVIATIONS["min-p-before-top-p"]


class ProcessesItsOwnWay(faulty.OwnProcessing):
    """An own-RNG engine whose processed distribution is ``process`` (the spec's noise, so only the processing
    differs); it declares ``declares``."""

    def __init__(self, model, process, declares: tuple[str, ...]) -> None:
        super().__init__(model)
        self.process, self.last_run = process, None
        self.capabilities = Capabilities(spec_sampling=False, per_request_max_new_tokens=True,
                                         per_request_sampling=True, per_request_eos=True,
                                         logprob_semantics="processed", claims_batch_invariance=True,
                                         deviations=declares)  # fmt: skip


def _requests(sampling, n: int = 6) -> list[RolloutRequest]:
    return [RolloutRequest(f"r{i}", tuple(tasks.prompt_ids(p)), sampling, seed=i, eos_token_ids=(tasks.EOS_ID,))
            for i, p in enumerate(tasks.make_problems(n, seed=3))]  # fmt: skip


@pytest.fixture(scope="module")
def judged(llama):
    """The deviation's example sampling plus a greedy request outside its domain, each engine's row."""
    requests = [*_requests(MIN_P_FIRST.example), *_requests(MIN_P_FIRST.example.__class__(max_new_tokens=8), 1)]
    requests[-1] = RolloutRequest("greedy", requests[-1].prompt_ids, requests[-1].sampling, seed=0,
                                  eos_token_ids=(tasks.EOS_ID,))  # fmt: skip
    reference = generate(llama.model, requests)
    engines = {
        "declared": ProcessesItsOwnWay(llama.model, MIN_P_FIRST.process, (MIN_P_FIRST.id,)),
        "undeclared": ProcessesItsOwnWay(llama.model, MIN_P_FIRST.process, ()),
        "declared, follows the spec": ProcessesItsOwnWay(llama.model, process_logits, (MIN_P_FIRST.id,)),
    }
    return {k: report.evaluate_engine(e, llama.model, requests, reference, FP32) for k, e in engines.items()}


def test_the_example_really_separates_the_two_processings(llama):
    """Without this the rows below would not tell the orders apart (a vacuous check): on the rollouts of the
    example sampling, the two processings' log-probs of the same tokens differ far beyond the float32 tier."""
    from cbverify import compare

    requests = _requests(MIN_P_FIRST.example)
    rollouts = ProcessesItsOwnWay(llama.model, MIN_P_FIRST.process, ()).generate(requests)
    spec = compare.teacher_force(llama.model, requests, rollouts, "processed", FP32)
    own = compare.teacher_force(llama.model, requests, rollouts, "processed", FP32, deviations=(MIN_P_FIRST.id,))
    assert spec.deviated == {} and set(own.deviated) == {r.request_id for r in requests}
    worst = max(float((a - b).abs().max()) for a, b in zip(spec.expected, own.expected, strict=True))
    assert worst > 100 * FP32.logprob_max_abs, worst


def test_an_engine_doing_what_it_declares_passes_and_the_report_names_the_deviation(judged):
    row = judged["declared"]
    assert row.status == "PASS", row.problems
    (note,) = [n for n in row.notes if n.startswith("declared deviation")]
    assert note.startswith(f"declared deviation {MIN_P_FIRST.id}: 6 request(s)"), note  # not the greedy one


@pytest.mark.parametrize("engine", ["undeclared", "declared, follows the spec"])
def test_an_undeclared_or_unfollowed_deviation_fails_on_its_log_probs(judged, engine):
    row = judged[engine]
    assert row.status == "FAIL" and any(p.startswith("log-probs off") for p in row.problems), (row.status, row.notes)


def test_declared_processing_is_the_spec_outside_every_domain_and_refuses_overlapping_ones(monkeypatch):
    greedy, both = MIN_P_FIRST.example.__class__(max_new_tokens=4), MIN_P_FIRST.example
    assert declared_processing((MIN_P_FIRST.id,), greedy) == (None, process_logits)
    assert declared_processing((), both) == (None, process_logits)
    assert declared_processing((MIN_P_FIRST.id,), both) == (MIN_P_FIRST.id, MIN_P_FIRST.process)
    monkeypatch.setitem(DEVIATIONS, "twin", MIN_P_FIRST)
    with pytest.raises(ValueError, match="their order is not defined"):
        declared_processing((MIN_P_FIRST.id, "twin"), both)
