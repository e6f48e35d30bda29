"""The mechanism coverage of ``cbverify verify`` (:mod:`cbverify.mechanisms`): what the workload's mechanisms reach is
read correctly off requests and rollouts, the probes reach what they are built for on every bundled checkpoint (by
the oracle's own rollouts), and a mechanism an engine claims and the run never reached is NOT REACHED, naming it."""

from __future__ import annotations

import math

import pytest

from cbverify.checkpoint import open_checkpoint
from cbverify.mechanisms import (
    FOLLOWER_ALPHA,
    PROBE_PREFIX,
    eos_probes,
    group_probes,
    reach,
    render,
    unreached,
    workload_touches,
)
from cbverify.workload import build_workload
from reference import generate as ref_gen
from reference.spec import Rollout, RolloutRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)
HOT = SamplingParams(temperature=1.0, max_new_tokens=4)


def _pair(rid, completion, *, sampling=HOT, prompt=(1, 2, 3), eos=(9,), seed=0, logprobs=None, reason=None):
    request = RolloutRequest(rid, prompt, sampling, seed=seed, eos_token_ids=eos)
    logprobs = logprobs if logprobs is not None else (-1.0,) * len(completion)
    reason = reason or ("stop" if completion and completion[-1] in eos else "length")
    return request, Rollout(rid, prompt, tuple(completion), tuple(logprobs), reason)


def _touches(*pairs):
    requests, rollouts = zip(*pairs, strict=True)
    return workload_touches(list(requests), list(rollouts))


def test_a_stop_on_a_later_eos_id_counts_and_a_stop_on_the_first_does_not():
    touched = _touches(_pair("a", (4, 7), eos=(9, 7), sampling=GREEDY),
                       _pair("b", (4, 9), eos=(9, 7), sampling=GREEDY),
                       _pair("c", (4, 5), eos=(9, 7), sampling=GREEDY))  # fmt: skip
    assert touched == {"a": {"eos-later-id": 1}}


@pytest.mark.parametrize("size", [2, 3, 5])
def test_a_group_counts_only_when_its_members_draw_pairwise_distinct_completions(size):
    distinct = [_pair(f"g{i}", (4, i), seed=i) for i in range(size)]
    kind = "group-of-2" if size == 2 else "group-of-3plus"
    touched = _touches(*distinct)
    assert [touched[f"g{i}"][kind] for i in range(size)] == [1] + [0] * (size - 1)  # one time, every member touched
    twins = [_pair(f"g{i}", (4, min(i, size - 2)), seed=i) for i in range(size)]  # the last two draw alike
    assert all(kind not in events for events in _touches(*twins).values())


def test_a_follower_counts_when_another_seed_would_reproduce_it_with_probability_at_most_alpha():
    sure = math.log(FOLLOWER_ALPHA) / 2 + 1e-9  # two tokens: probability just above alpha
    unsure = math.log(FOLLOWER_ALPHA) / 2 - 1e-9
    touched = _touches(_pair("g0", (4, 5), seed=0, logprobs=(unsure, unsure)),
                       _pair("g1", (4, 6), seed=1, logprobs=(unsure, unsure)),
                       _pair("g2", (4, 7), seed=2, logprobs=(sure, sure)))  # fmt: skip
    assert "follower-own-seed" not in touched["g0"]  # the first member: the one a follower would copy
    assert "follower-own-seed" in touched["g1"] and "follower-own-seed" not in touched["g2"]


def test_one_prompt_asked_with_several_samplings_in_a_row_counts_for_each_of_its_requests():
    touched = _touches(_pair("q0", (4,), sampling=GREEDY), _pair("g0", (5,)), _pair("g1", (5,), seed=1),
                       _pair("q1", (4,), sampling=GREEDY, prompt=(1, 2)))  # fmt: skip
    assert [touched[r].get("prefix-across-samplings") for r in ("q0", "g0", "g1")] == [1, 0, 0]
    assert "q1" not in touched


def _engine(name, declared=("cow-2-sharers", "preemption"), touched=None, spec=True):
    return (name, spec, declared, touched)


def test_reach_names_each_claimed_mechanism_nothing_reached_and_asks_pressure_only_where_the_run_did():
    workload = {"a": {"eos-later-id": 2}, "b": {"group-of-2": 1}}
    engines = [_engine("x", touched={"r1": {"cow-2-sharers": 3}}), _engine("x", touched={"r1": {"preemption": 1}}),
               _engine("y", touched={}), _engine("z", declared=(), spec=False)]  # fmt: skip
    table = {r.mechanism: r for r in reach(workload, engines, probes=True, pressure=True)}
    assert (table["eos-later-id"].status, table["eos-later-id"].times) == ("reached", 2)
    assert table["follower-own-seed"].engines == ("x", "y")  # z's tokens are not compared with the oracle's
    assert table["group-of-3plus"].status == "NOT REACHED"
    assert (table["cow-2-sharers"].status, table["cow-2-sharers"].times) == ("NOT REACHED by y", 3)
    assert table["preemption"].status == "NOT REACHED by y" and "chunked-prefill" not in table
    assert set(unreached(table.values())) == {"group-of-3plus", "follower-own-seed", "prefix-across-samplings",
                                              "cow-2-sharers", "preemption"}  # fmt: skip
    text = render(list(table.values()))
    assert "FAIL: 5 mechanism(s) claimed and never reached" in text and "cow-2-sharers" in text
    quiet = {r.mechanism: r.status for r in reach(workload, engines, probes=False, pressure=False)}
    assert quiet["preemption"] == "not asked: --no-pressure" and quiet["group-of-3plus"] == "not asked: --no-probes"
    assert quiet["cow-2-sharers"] == "NOT REACHED by y"  # pressure-free mechanisms are asked of every run


@pytest.mark.parametrize("model_name", ["tiny-llama-arith", "tiny-qwen2-random", "tiny-qwen3-chat"])
def test_the_probes_reach_every_workload_mechanism_on_every_bundled_checkpoint(model_name):
    """By construction, judged on the oracle's own rollouts: each EOS probe stops on a later EOS id, each group probe
    has pairwise distinct completions, and its followers are ones another seed would not reproduce."""
    ckpt = open_checkpoint(model_name)
    workload = build_workload(ckpt, prompts_file=None, num_prompts=2, seed=3, max_new_tokens=16)
    model = ckpt.load_model(dtype="float32", device="cpu")
    requests = list(workload.requests)
    requests += group_probes(model, [r.prompt_ids for r in requests], seed=3, group_size=workload.group_size,
                             max_new_tokens=16, eos_token_ids=ckpt.eos_token_ids)  # fmt: skip
    rollouts = ref_gen.generate(model, requests)
    probes = eos_probes(requests, rollouts)
    assert len(probes) >= 2 and all(p.request_id.startswith(PROBE_PREFIX) for p in probes)
    requests += probes
    rollouts += ref_gen.generate(model, probes)
    touched = workload_touches(requests, rollouts)
    assert all("eos-later-id" in touched.get(p.request_id, {}) for p in probes), touched
    grouped = [r.request_id for r in requests if r.request_id.startswith(f"{PROBE_PREFIX}-group")]
    assert len(grouped) == 2 + workload.group_size
    assert all({"group-of-2", "group-of-3plus"} & set(touched.get(rid, ())) for rid in grouped), touched
    followers = [rid for rid in grouped if not rid.endswith("-g0")]
    assert all("follower-own-seed" in touched[rid] for rid in followers), touched
