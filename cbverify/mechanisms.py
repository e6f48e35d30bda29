"""What a ``cbverify verify`` run made the engines do, and whether it reached every mechanism they claim.

A check is only as good as what its workload reached: an engine that honours only the first of several EOS ids
passes every check of a workload whose rollouts never stop on another; one that shares a seed or a KV block between
two members of a group passes wherever the members happen to draw the same tokens (a trained model sure of its
answer). So ``verify`` adds probes to its workload (:func:`group_probes` before the oracle runs, drawn so that the
members' first tokens differ; :func:`eos_probes` from the oracle's rollouts) and judges its coverage
(:func:`reach`), as it judges its checks' decisiveness.

Workload mechanisms (:data:`WORKLOAD_MECHANISMS`) are read off the requests and the oracle's rollouts, the same for
every engine they apply to:

- ``eos-later-id``: a rollout that stops on an EOS id that is not its request's first;
- ``group-of-2`` / ``group-of-3plus``: a group (consecutive requests with one prompt and one sampling, each with its
  own seed) whose members' completions are pairwise distinct, so a mix-up of two members' KV blocks or seeds changes
  a token or a log-prob;
- ``follower-own-seed`` (engines whose tokens follow the spec's noise, so each is compared with the oracle's for its
  own seed): a group member after the first whose completion another seed would reproduce with probability at most
  :data:`FOLLOWER_ALPHA` (the product of its tokens' processed probabilities, the exponential of the oracle's
  log-probs): a member drawn with another member's seed shows;
- ``prefix-across-samplings``: consecutive requests with one prompt and different samplings (a greedy request and
  its group), which a prefix-sharing engine serves from one prompt's KV.

Engine mechanisms (:data:`cbverify.engines.MECHANISMS`) are declared in ``Capabilities.mechanisms`` and counted by
the engine itself (``last_run.extra["mechanisms"]``), summed over its rows (its pressure row included).

A mechanism an engine claims that the run never reached is NOT REACHED, a failure of the run; one the run did not
ask for (a pressure mechanism under ``--no-pressure``, every probe under ``--no-probes``) is "not asked", with why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cbverify.engines import MECHANISMS
from reference.spec import Rollout, RolloutRequest, SamplingParams

FOLLOWER_ALPHA = 0.05
WORKLOAD_MECHANISMS: dict[str, str] = {
    "eos-later-id": "a rollout stops on an EOS id that is not its request's first",
    "group-of-2": "a group of 2 members with distinct completions",
    "group-of-3plus": "a group of 3 or more members with pairwise distinct completions",
    "follower-own-seed": f"a group member after the first that another seed reproduces with p <= {FOLLOWER_ALPHA:g}",
    "prefix-across-samplings": "one prompt asked with several samplings in a row (greedy and a group)",
}
SPEC_ONLY = ("follower-own-seed",)  # judged only for engines whose tokens are compared with the oracle's
PROBE_SAMPLING = SamplingParams(temperature=2.0)  # spreads even a trained model's draws (no cut to hide behind)
PROBE_TOKENS = 12  # completion budget of the group probes
PROBE_PREFIX = "probe"  # request ids of the probes start with it
PROBE_SEED_TRIES = 1000  # seeds tried per group probe for members whose first tokens differ


def group_probes(model, prompts: Sequence[Sequence[int]], *, seed: int, group_size: int, max_new_tokens: int,
                 eos_token_ids: tuple[int, ...]) -> list[RolloutRequest]:  # fmt: skip
    """A group of exactly 2 and one of ``max(3, group_size)`` at :data:`PROBE_SAMPLING`, on the first prompt cut by
    one and by two tokens (prompts no other request has, so an engine that shares prefixes forms these groups as
    they are). Each member's seed is the first, counting up from a base drawn from ``seed``, whose first token
    (the spec's draw from the prompt's next-token logits: one forward per group) is no EOS id and differs from every
    earlier member's: the members' completions differ from their first token on, so a mix-up of two members' seeds
    or KV shows at once, however sure of its answer the model is. A distribution with too few tokens for that
    leaves the group as drawn (its mechanisms may then go unreached, and the run says so)."""
    from reference.generate import choose_token, next_token_logits

    ids = list(prompts[0])
    sampling = replace(PROBE_SAMPLING, max_new_tokens=min(max_new_tokens, PROBE_TOKENS))
    out = []
    for j, size in enumerate((2, max(3, group_size))):
        prompt = ids[: len(ids) - 1 - j] if len(ids) > 2 else ids
        logits = next_token_logits(model, prompt)
        candidates = (seed * 1000 + 900 + j + k * 1_000_003 for k in range(PROBE_SEED_TRIES))
        seeds, firsts = [], set()
        for candidate in candidates:
            first = choose_token(logits, sampling, candidate, 0)[0]
            if first not in firsts and first not in eos_token_ids:
                seeds.append(candidate)
                firsts.add(first)
                if len(seeds) == size:
                    break
        seeds += [seed * 1000 + 900 + j + (PROBE_SEED_TRIES + k) * 1_000_003 for k in range(size - len(seeds))]
        out += [RolloutRequest(f"{PROBE_PREFIX}-group{size}-g{g}", prompt, sampling, seed=member_seed,
                               eos_token_ids=eos_token_ids) for g, member_seed in enumerate(seeds)]  # fmt: skip
    return out


def eos_probes(requests: Sequence[RolloutRequest], rollouts: Sequence[Rollout]) -> list[RolloutRequest]:
    """Requests whose oracle rollouts stop on a later EOS id, built from the oracle's ``rollouts`` of ``requests``:

    - a greedy and a sampled request asked again with the same prompt, sampling and seed (so the oracle draws the
      same tokens) and one more EOS id at the end of the list: the token the rollout draws at the first position
      ``k >= 1``, from half its length on, that is new to the completion and no EOS id. The rollout stops there.
    - the first rollout that stopped on an EOS id, asked again with that id last in the list (after the request's
      other ids, or after a token its completion never draws when it has no other).
    """
    out: list[RolloutRequest] = []
    wanted = {True: None, False: None}  # greedy, sampled
    stopped = None
    for request, rollout in zip(requests, rollouts, strict=True):
        if request.request_id.startswith(PROBE_PREFIX):
            continue
        c = rollout.completion_ids
        if wanted[request.sampling.greedy] is None:
            for k in range(max(1, len(c) // 2), len(c)):
                if c[k] not in c[:k] and c[k] not in request.eos_token_ids:
                    wanted[request.sampling.greedy] = replace(
                        request,
                        request_id=f"{PROBE_PREFIX}-eos-later-{request.request_id}",
                        eos_token_ids=(*request.eos_token_ids, c[k]),
                    )
                    break  # fmt: skip
        if stopped is None and rollout.finish_reason == "stop" and c:
            others = tuple(e for e in request.eos_token_ids if e != c[-1])
            if not others:
                others = (next(t for t in range(max(c) + 2) if t not in c),)
            stopped = replace(request, request_id=f"{PROBE_PREFIX}-eos-last-{request.request_id}",
                              eos_token_ids=(*others, c[-1]))  # fmt: skip
    out += [r for r in (wanted[True], wanted[False], stopped) if r is not None]
    return out


def _groups(requests: Sequence[RolloutRequest]) -> list[list[int]]:
    """Indices of each group: maximal runs of consecutive sampled requests with one prompt and one sampling."""
    runs: list[list[int]] = []
    for i, r in enumerate(requests):
        prev = requests[runs[-1][-1]] if runs else None
        if (prev is not None and not r.sampling.greedy and prev.prompt_ids == r.prompt_ids
                and prev.sampling == r.sampling):  # fmt: skip
            runs[-1].append(i)
        else:
            runs.append([i])
    return [g for g in runs if len(g) >= 2]


def workload_touches(requests: Sequence[RolloutRequest], rollouts: Sequence[Rollout]) -> dict[str, dict[str, int]]:
    """``{request_id: {workload mechanism: times}}``: what the workload's mechanisms reached, from the oracle's
    ``rollouts`` (see the module docstring); requests that reached none are left out."""
    touched: dict[str, dict[str, int]] = {}

    def mark(i: int, mechanism: str, times: int = 1) -> None:
        events = touched.setdefault(requests[i].request_id, {})
        events[mechanism] = events.get(mechanism, 0) + times

    for i, (request, rollout) in enumerate(zip(requests, rollouts, strict=True)):
        c = rollout.completion_ids
        if rollout.finish_reason == "stop" and c and c[-1] in request.eos_token_ids[1:] \
                and c[-1] != request.eos_token_ids[0]:  # the list may name an id twice  # fmt: skip
            mark(i, "eos-later-id")
    for group in _groups(requests):
        completions = [rollouts[i].completion_ids for i in group]
        if len(set(completions)) == len(completions):  # one time per group, touching each member
            for i in group:
                mark(i, "group-of-2" if len(group) == 2 else "group-of-3plus", int(i == group[0]))
        for i in group[1:]:
            if math.exp(sum(rollouts[i].logprobs)) <= FOLLOWER_ALPHA:
                mark(i, "follower-own-seed")
    start = 0
    for i in range(1, len(requests) + 1):  # runs of one prompt
        if i == len(requests) or requests[i].prompt_ids != requests[start].prompt_ids:
            if len({requests[j].sampling for j in range(start, i)}) >= 2:  # one time per run of the prompt
                for j in range(start, i):
                    mark(j, "prefix-across-samplings", int(j == start))
            start = i
    return touched


@dataclass(frozen=True, slots=True)
class Reach:
    """One mechanism's coverage in a run: who claims it, how often it ran, how many requests it touched."""

    mechanism: str
    source: str  # "workload" or "engine"
    engines: tuple[str, ...]
    times: int
    sequences: int
    status: str  # "reached", "NOT REACHED" or "not asked: <why>"


def counts(touched: dict[str, dict[str, int]], mechanism: str) -> tuple[int, int]:
    """``(times, sequences)`` of ``mechanism`` in ``{request_id: {mechanism: times}}`` (a request it touched without
    counting a time, e.g. a group's member after the first, with 0)."""
    hits = [events[mechanism] for events in touched.values() if mechanism in events]
    return sum(hits), len(hits)


def reach(workload: dict[str, dict[str, int]], engines: Sequence[tuple[str, bool, Sequence[str], dict | None]], *,
          probes: bool, pressure: bool) -> list[Reach]:  # fmt: skip
    """The coverage table. ``workload``: :func:`workload_touches`; ``engines``: ``(name, spec_sampling, declared
    mechanisms, touched)`` per engine row that ran (a pressure row under its engine's name; ``touched`` the row's
    ``last_run.extra["mechanisms"]``, ``None`` when it reported none). ``probes`` / ``pressure``: whether the run
    asked for them."""
    names = list(dict.fromkeys(name for name, *_ in engines))
    spec = {name: s for name, s, _, _ in engines}
    declared = {name: set(d) for name, _, d, _ in engines}
    out = []
    for mechanism in WORKLOAD_MECHANISMS:
        claim = tuple(n for n in names if mechanism not in SPEC_ONLY or spec[n])
        times, seqs = counts(workload, mechanism)
        status = "reached" if times else "not asked: --no-probes" if not probes else "NOT REACHED"
        out.append(Reach(mechanism, "workload", claim, times, seqs, status if claim else "not asked: no engine"))
    for mechanism, about in MECHANISMS.items():
        claim = tuple(n for n in names if mechanism in declared[n])
        if not claim:
            continue
        per_engine = {n: {} for n in claim}  # {engine: {row/request: {mechanism: times}}}
        for row, (name, _, _, touched) in enumerate(engines):
            if name in per_engine:
                per_engine[name] |= {f"{row}/{rid}": events for rid, events in (touched or {}).items()}
        missing = [n for n in claim if not counts(per_engine[n], mechanism)[0]]
        times, seqs = (sum(c) for c in zip(*(counts(per_engine[n], mechanism) for n in claim), strict=True))
        if about.pressure and not pressure:
            status = "not asked: --no-pressure"
        else:
            status = "NOT REACHED by " + ", ".join(missing) if missing else "reached"
        out.append(Reach(mechanism, "engine", claim, times, seqs, status))
    return out


def unreached(table: Sequence[Reach]) -> list[str]:
    return [r.mechanism for r in table if r.status.startswith("NOT REACHED")]


def render(table: Sequence[Reach]) -> str:
    """The table as text, then a FAIL line naming every mechanism claimed and never reached."""
    lines = [("mechanism", "source", "claimed by", "times", "sequences", "status")]
    lines += [(r.mechanism, r.source, ", ".join(r.engines) or "-", str(r.times), str(r.sequences), r.status)
              for r in table]  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = ["mechanisms this run reached (a mechanism claimed and never reached fails the run):"]
    text += ["  " + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    if missing := unreached(table):
        text.append(f"FAIL: {len(missing)} mechanism(s) claimed and never reached: {', '.join(missing)}")
    return "\n".join(text)
