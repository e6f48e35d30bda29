"""Multi-process GRPO: an upstream scenario trained data-parallel on N CPU processes, each rank judged, then the ranks
judged together.

:func:`launch` starts ``python -m torch.distributed.run --nproc_per_node N --master_addr 127.0.0.1`` (torch's own
launcher; accelerate then picks ``MULTI_CPU`` with the gloo backend) on this module. Each rank runs the scenario
exactly as a single process would (:func:`cbverify.upstream.run.run_scenario`, same capture), plus a
:class:`RankRecorder` that keeps, per optimizer step, the gradient handed to the optimizer and a digest of the
parameters after it; then it writes its capture to ``<out>/rank<r>.pt``. A launch that outlives ``timeout_s`` is
killed and reported, never waited on.

:func:`check_ranks` runs every single-process check on each rank's capture (a rank's rewards are the gathered ones,
its advantages its slice of them) and the checks that only exist across ranks (:data:`RANK_CHECKS`):

- ``ranks_really_distributed``: every rank saw N processes under a distributed type (``accelerate launch --cpu
  --num_processes 2`` without a multi-process config runs N copies of a single-process job: each says NO / 1);
- ``ranks_cover_the_global_batch``: per generation, the ranks' prompts together hold each prompt of the global batch
  exactly ``num_generations`` times, ranks hold equal shares, and every rank saw the same gathered rewards;
- ``ranks_weights_identical``: after every optimizer step the parameters are bit-identical on every rank;
- ``ranks_sample_distinct_streams``: sampled scenarios only; two rows of one prompt on two ranks must not draw the
  same completion because the ranks share a stream (two ranks' torch RNG states at a generation, and any pair of
  same-prompt rows at the same local position with identical completions on every such pair);
- ``ranks_match_one_process``: the N-process step against one process training the same global batch (``nproc``
  times the prompts per device): the same gathered rewards and, where the completions are the same, the gradient of
  each optimizer step within the float32 trainer tier (``TRAINER_FP32_PARAM_GRAD``) of the gradient's size.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from cbverify.tolerances import TRAINER_FP32_PARAM_GRAD, TRAINER_METRIC
from cbverify.upstream.capture import Capture
from cbverify.upstream.findings import FAIL, NA, PASS, CheckResult
from cbverify.upstream.scenario import TrainerScenario

RANK_CHECKS = (
    "ranks_really_distributed", "ranks_cover_the_global_batch", "ranks_weights_identical",
    "ranks_sample_distinct_streams", "ranks_match_one_process", "ranks_log_what_one_process_logs",
)  # fmt: skip
NOT_COMPARED = ("time", "runtime", "per_second", "epoch")  # logged keys that measure the machine, not the step
LAUNCH_TIMEOUT_S = 600.0


def scenario_to_json(scenario: TrainerScenario) -> str:
    return json.dumps(dataclasses.asdict(scenario))


def scenario_from_json(text: str) -> TrainerScenario:
    """The inverse of :func:`scenario_to_json` (JSON lists back to the tuples the dataclass holds)."""

    def tuples(value):
        return tuple(tuples(v) for v in value) if isinstance(value, list) else value

    return TrainerScenario(**{k: tuples(v) for k, v in json.loads(text).items()})


class RankRecorder:
    """Per optimizer step: the gradient handed to the optimizer, a SHA-256 of every parameter after the step, and what
    the trainer logged."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        recorder = self
        self.grads: list[dict[str, torch.Tensor]] = []
        self.digests: list[str] = []
        self.logs: list[dict] = []

        class Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                recorder.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                       if p.grad is not None})  # fmt: skip

            def on_step_end(self, args, state, control, model=None, **kwargs):
                recorder.digests.append(param_digest(model))

            def on_log(self, args, state, control, logs=None, **kwargs):
                recorder.logs.append(dict(logs or {}))

        self.callback = Callback()


def param_digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _portable(capture: Capture, recorder: RankRecorder) -> dict:
    """What a rank hands the parent: the capture without what does not pickle (exceptions become their text, the
    cb path's raw transformers outputs are dropped) and the recorder's steps."""
    for g in capture.generations:
        g.raw_outputs, g.error = None, None if g.error is None else repr(g.error)
    error = None if capture.run_error is None else f"{type(capture.run_error).__name__}: {capture.run_error}"
    capture.run_error, capture.sampler_model = None, None
    return {"capture": capture, "run_error": error, "grads": recorder.grads, "digests": recorder.digests,
            "logs": recorder.logs,
            "rng_at_generation": [g.before.rng_state for g in capture.generations]}  # fmt: skip


def rank_main(argv: list[str] | None = None) -> None:
    """One rank (run by torchrun: ``RANK`` / ``WORLD_SIZE`` in the environment)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--random-model", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from accelerate import PartialState

    from cbverify.upstream.run import run_scenario
    from reference.models import load, random_like

    torch.set_num_threads(1)
    model, tokenizer = random_like(args.model, seed=0) if args.random_model else load(args.model)
    recorder = RankRecorder()
    try:
        capture = run_scenario(scenario_from_json(args.scenario), model, tokenizer, callbacks=(recorder.callback,))
    except Exception as err:  # the trainer could not even be built: still say what this process was
        state = PartialState()
        capture = Capture(run_error=err, trainer_info={"process_index": state.process_index, "num_processes":
                          state.num_processes, "distributed_type": str(state.distributed_type)})  # fmt: skip
    if capture.run_error is not None:
        print(f"rank {os.environ.get('RANK')}: the run raised {capture.run_error!r}", file=sys.stderr)
    rank = capture.trainer_info["process_index"]
    failed = capture.run_error is not None
    torch.save(_portable(capture, recorder), args.out / f"rank{rank}.pt")
    if failed:  # as an uncaught error would: the launcher then stops every other rank (none waits in a collective)
        sys.exit(1)


@dataclasses.dataclass
class Launch:
    nproc: int
    ranks: list[dict]  # what each rank wrote (missing ranks: absent)
    returncode: int | None  # None: killed after the timeout
    log: str

    def error(self) -> str | None:
        if self.returncode is None:
            return f"the {self.nproc}-process launch did not finish within its timeout (killed); log ends: {self.log}"
        raised = [f"rank {r['capture'].trainer_info.get('process_index')} raised {r['run_error']}" for r in self.ranks
                  if r["run_error"] is not None]  # fmt: skip
        if self.returncode != 0 or len(self.ranks) != self.nproc or raised:
            said = "; ".join(raised) if raised else f"log ends: {self.log}"
            return f"exit {self.returncode}, {len(self.ranks)}/{self.nproc} rank records; {said}"[:1500]
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHERS = ("torchrun", "accelerate")


def launch(scenario: TrainerScenario, model: str, *, random_model: bool = False, timeout_s: float = LAUNCH_TIMEOUT_S,
           module: str = "cbverify.upstream.distributed", launcher: str = "torchrun") -> Launch:  # fmt: skip
    """Train ``scenario`` on its ``nproc`` CPU processes; ``module`` is the per-rank entry point (tests swap in faulty
    ranks). ``launcher``: ``torchrun`` (torch's ``torch.distributed.run``, loopback rendezvous), or ``accelerate``
    (``accelerate launch --cpu --num_processes N`` as a user would type it: without a multi-process config it runs one
    single-process job, which ``ranks_really_distributed`` reports)."""
    nproc = scenario.nproc
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    with tempfile.TemporaryDirectory(prefix="cbverify-ranks-") as out:
        if launcher == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                       "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]  # fmt: skip
        else:
            command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", str(nproc),
                       "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
        command += ["-m", module, "--scenario", scenario_to_json(scenario), "--model", model, "--out", out]
        command += ["--random-model"] * random_model
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # fmt: skip
        log_path = Path(out) / "launch.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                returncode = None
        ranks = [torch.load(p, weights_only=False) for p in sorted(Path(out).glob("rank*.pt"))]
        tail = " | ".join(line for line in log_path.read_text(errors="replace").splitlines()[-6:] if line.strip())
        return Launch(nproc, ranks, returncode, tail[-1500:])


def _result(check: str, scenario: TrainerScenario, status: str, reason: str) -> CheckResult:
    return CheckResult(check, scenario.path, status, reason, scenario.describe())


def check_ranks(scenario: TrainerScenario, run: Launch, model, one: Launch | None = None) -> list[CheckResult]:
    """Every single-process check on each rank (a FAIL on any rank is the check's FAIL, naming the rank) and
    :data:`RANK_CHECKS` (``one``: the same global batch on one process, for ``ranks_match_one_process``)."""
    from cbverify.upstream.suite import CHECKS, check_capture

    if (why := run.error()) is not None:  # what the ranks that wrote a record say about the launch, if any did
        seen = [really_distributed(scenario, [record["capture"] for record in run.ranks])] if run.ranks else []
        failed = [_result(c, scenario, FAIL, why) for c in ("run_completes", *RANK_CHECKS) if c not in
                  [r.check for r in seen]]  # fmt: skip
        return seen + failed + [_result(c, scenario, NA, "the launch failed") for c in CHECKS if c != "run_completes"]
    per_check: dict[str, list[tuple[int, CheckResult]]] = {}
    for rank, record in enumerate(run.ranks):
        capture = record["capture"]
        if record["run_error"] is not None:
            capture.run_error = RuntimeError(record["run_error"])
        for r in check_capture(scenario, capture, model):
            per_check.setdefault(r.check, []).append((rank, r))
    out = []
    for check, results in per_check.items():
        failing = [(rank, r) for rank, r in results if r.status == FAIL]
        if failing:
            rank, r = failing[0]
            out.append(_result(check, scenario, FAIL, f"rank {rank}: {r.reason}"))
        elif all(r.status == NA for _, r in results):
            out.append(_result(check, scenario, NA, results[0][1].reason))
        else:
            out.append(_result(check, scenario, PASS, f"every rank: {results[0][1].reason}"))
    captures = [record["capture"] for record in run.ranks]
    out += [
        really_distributed(scenario, captures),
        cover_the_global_batch(scenario, captures),
        weights_identical(scenario, run),
        distinct_streams(scenario, run),
        *match_one_process(scenario, run, one),
    ]
    return out


def really_distributed(scenario: TrainerScenario, captures: list[Capture]) -> CheckResult:
    nproc = scenario.nproc
    seen = [(c.trainer_info.get("num_processes"), c.trainer_info.get("distributed_type")) for c in captures]
    bad = [
        f"rank {i}: {n} process(es), {kind}" for i, (n, kind) in enumerate(seen) if n != nproc or kind.endswith("NO")
    ]
    if bad:
        return _result("ranks_really_distributed", scenario, FAIL, f"{nproc} launched, but {'; '.join(bad)}")
    return _result("ranks_really_distributed", scenario, PASS, f"{nproc} ranks, each saw {seen[0][0]} under "
                   f"{seen[0][1]}")  # fmt: skip


def cover_the_global_batch(scenario: TrainerScenario, captures: list[Capture]) -> CheckResult:
    nproc = scenario.nproc
    check, n = "ranks_cover_the_global_batch", scenario.num_generations
    counts = {len(c.generations) for c in captures}
    if len(counts) != 1:
        return _result(check, scenario, FAIL, f"ranks generated different numbers of batches: {sorted(counts)}")
    for k in range(counts.pop()):
        shares = [c.generations[k].prompts for c in captures]
        if len({len(s) for s in shares}) != 1:
            return _result(check, scenario, FAIL, f"generation {k}: unequal shares {[len(s) for s in shares]}")
        tally = Counter(json.dumps(p, sort_keys=True, default=str) for share in shares for p in share)
        off = {p: c for p, c in tally.items() if c != n}
        if off:
            p, c = next(iter(off.items()))
            return _result(check, scenario, FAIL, f"generation {k}: prompt {p[:60]} generated {c} times across ranks "
                           f"(num_generations={n}); {len(off)} prompt(s) off")  # fmt: skip
        completions = [c.generations[k].completion_ids for c in captures]
        if any(cs is None or len(cs) != len(s) for cs, s in zip(completions, shares, strict=True)):
            return _result(check, scenario, FAIL, f"generation {k}: a rank's completions do not pair with its "
                           "prompts (counts differ)")  # fmt: skip
    rewards = [c.rewards for c in captures]
    for k in range(min(len(r) for r in rewards)):
        if any(not torch.equal(rewards[0][k].nan_to_num(), r[k].nan_to_num()) for r in rewards[1:]):
            return _result(check, scenario, FAIL, f"scored batch {k}: the ranks' gathered rewards differ")
    total = sum(len(c.generations[0].prompts) for c in captures) if captures[0].generations else 0
    return _result(check, scenario, PASS, f"{len(captures[0].generations)} generation(s): {total} rows over {nproc} "
                   f"ranks, every prompt {n} times, gathered rewards identical")  # fmt: skip


def weights_identical(scenario: TrainerScenario, run: Launch) -> CheckResult:
    check = "ranks_weights_identical"
    digests = [record["digests"] for record in run.ranks]
    if not digests[0]:
        return _result(check, scenario, NA, "no optimizer step was taken")
    for k, step in enumerate(zip(*digests, strict=False)):
        if len(set(step)) != 1:
            return _result(check, scenario, FAIL, f"after step {k} the ranks' parameters differ")
    steps = len(digests[0])
    return _result(check, scenario, PASS, f"bit-identical on every rank after each of {steps} step(s)")


def distinct_streams(scenario: TrainerScenario, run: Launch) -> CheckResult:
    check = "ranks_sample_distinct_streams"
    if scenario.greedy:
        return _result(check, scenario, NA, "greedy: nothing is drawn")
    states = [record["rng_at_generation"] for record in run.ranks]
    for k, at_k in enumerate(zip(*states, strict=False)):
        uses_global_rng = scenario.path in ("generate", "cb")
        if uses_global_rng and any(torch.equal(at_k[0], s) for s in at_k[1:]):
            return _result(check, scenario, FAIL, f"generation {k}: two ranks start sampling from the same torch RNG "
                           "state")  # fmt: skip
    captures = [record["capture"] for record in run.ranks]
    pairs = identical = 0
    for k in range(min(len(c.generations) for c in captures)):
        rows = [(r, i, json.dumps(p, default=str), tuple(c.generations[k].completion_ids[i]))
                for r, c in enumerate(captures) for i, p in enumerate(c.generations[k].prompts)]  # fmt: skip
        for a in rows:
            for b in rows:
                if a[0] < b[0] and a[1] == b[1] and a[2] == b[2]:  # same prompt, same local row, different ranks
                    pairs += 1
                    identical += a[3] == b[3]
    if pairs and identical == pairs:
        return _result(check, scenario, FAIL, f"all {pairs} same-prompt row pairs at the same position on different "
                       "ranks drew identical completions: the ranks share a sampling stream")  # fmt: skip
    return _result(check, scenario, PASS, f"{identical}/{pairs} same-prompt row pairs across ranks identical")


def match_one_process(scenario: TrainerScenario, run: Launch, one: Launch | None) -> list[CheckResult]:
    """``ranks_match_one_process`` and ``ranks_log_what_one_process_logs``."""
    names = ("ranks_match_one_process", "ranks_log_what_one_process_logs")
    if one is None:
        return [_result(n, scenario, NA, "no single-process run of the global batch was made") for n in names]
    if (why := one.error()) is not None:
        return [_result(n, scenario, FAIL, f"the single-process run failed: {why}") for n in names]
    single = one.ranks[0]["capture"]
    ranks = [record["capture"] for record in run.ranks]
    if not single.generations or not all(c.generations for c in ranks):
        return [_result(n, scenario, FAIL, "a run generated nothing (see run_completes)") for n in names]
    prompts = [json.dumps(p, default=str) for c in ranks for p in c.generations[0].prompts]
    if prompts != [json.dumps(p, default=str) for p in single.generations[0].prompts]:
        why = "the ranks' prompts, in rank order, are not the single process's global batch"
        return [_result(n, scenario, FAIL, why) for n in names]
    if [row for c in ranks for row in c.generations[0].completion_ids] != single.generations[0].completion_ids:
        why = "the completions differ from the single process's (sampling depends on the process layout)"
        return [_result(n, scenario, NA, why) for n in names]
    return [_same_gradients(scenario, run, one), _same_logs(scenario, run, one)]


def _same_gradients(scenario: TrainerScenario, run: Launch, one: Launch) -> CheckResult:
    check, worst = "ranks_match_one_process", 0.0
    for k, (g_many, g_one) in enumerate(zip(run.ranks[0]["grads"], one.ranks[0]["grads"], strict=False)):
        num = sum(float((g_many[n].double() - g_one[n].double()).norm() ** 2) for n in g_one) ** 0.5
        size = max(sum(float(g.double().norm() ** 2) for g in g_one.values()) ** 0.5, 1e-30)
        worst = max(worst, num / size)
        if num > TRAINER_FP32_PARAM_GRAD * size:
            return _result(check, scenario, FAIL, f"step {k}: the {run.nproc}-process gradient is off the single "
                           f"process's by {num / size:.3g} of its norm")  # fmt: skip
    steps = min(len(run.ranks[0]["grads"]), len(one.ranks[0]["grads"]))
    sizes = [sum(float(g.double().norm() ** 2) for g in grads.values()) ** 0.5 for grads in one.ranks[0]["grads"]]
    if not any(sizes):
        return _result(check, scenario, NA, "every step's gradient is zero: nothing to compare")
    return _result(check, scenario, PASS, f"same completions; {steps} step gradient(s) (norm {max(sizes):.3g}) "
                   f"within {worst:.1e} of the single process's norm")  # fmt: skip


def _same_logs(scenario: TrainerScenario, run: Launch, one: Launch) -> CheckResult:
    """Every number logged per step equals the single process's: a global token- or sample-weighted value, not an
    average of per-process averages (``TRAINER_METRIC``)."""
    check, compared = "ranks_log_what_one_process_logs", 0
    for k, (mine, theirs) in enumerate(zip(run.ranks[0]["logs"], one.ranks[0]["logs"], strict=False)):
        for key, want in theirs.items():
            if any(word in key for word in NOT_COMPARED) or not isinstance(want, int | float):
                continue
            got = mine.get(key)
            if got is None:
                return _result(check, scenario, FAIL, f"log {k}: {key} logged by one process, not by {run.nproc}")
            compared += 1
            if abs(got - want) > TRAINER_METRIC.atol + TRAINER_METRIC.rtol * abs(want):
                return _result(check, scenario, FAIL, f"log {k}: {key} = {got:.6g} on {run.nproc} processes, "
                               f"{want:.6g} on one")  # fmt: skip
    return _result(check, scenario, PASS, f"{compared} logged numbers equal the single process's")


def one_process_equivalent(scenario: TrainerScenario) -> TrainerScenario:
    """The same global batch on one process: ``nproc`` times the prompts per device (and the batch size)."""
    batch, nproc = scenario.per_device_train_batch_size, scenario.nproc
    return dataclasses.replace(scenario, nproc=1, num_prompts=scenario.num_prompts * nproc,
                               per_device_train_batch_size=None if batch is None else batch * nproc)  # fmt: skip


_BASE = dict(nproc=2, num_generations=4, num_prompts=1, per_device_train_batch_size=2, top_k=3, reward="token_sum",
             max_completion_length=6, max_grad_norm=0.0)  # fmt: skip
# Groups of 4 over 2 processes of 2 rows: every group spans both processes. No gradient clipping: a gradient of the
# wrong size must not be clipped back to the right one. Rewards read the completion alone (token_sum).
DISTRIBUTED_SCENARIOS: tuple[TrainerScenario, ...] = tuple(
    TrainerScenario(**{**_BASE, **kw})
    for kw in (
        dict(path="rollout_func", rollout_backend="reference"),
        dict(path="rollout_func", rollout_backend="cb_impl", top_entropy_quantile=0.5),
        dict(path="generate", scale_rewards="batch", more_rewards=("length",), reward_weights=(1.0, 0.5)),
        dict(path="cb"),
        # rows of very unequal length: one process's completions are all truncated and masked
        dict(
            path="rollout_func",
            rollout_backend="reference",
            max_completion_length=12,
            mask_truncated_completions=True,
            reward="length",
        ),
    )
)


def run_distributed(scenarios, model_name: str, model, *, random_model: bool = False, progress: bool = True,
                    launcher: str = "torchrun"):  # fmt: skip
    """``[(scenario, result)]``: each scenario on its processes and, for comparison, on one process."""
    from tqdm import tqdm

    from cbverify.upstream.run import not_applicable

    out = []
    for scenario in tqdm(list(scenarios), desc="multi-process scenarios", disable=not progress, unit="run"):
        if reason := not_applicable(scenario):
            out += [(scenario, _result(c, scenario, NA, reason)) for c in RANK_CHECKS]
            continue
        run = launch(scenario, model_name, random_model=random_model, launcher=launcher)
        one = launch(one_process_equivalent(scenario), model_name, random_model=random_model)
        out += [(scenario, r) for r in check_ranks(scenario, run, model, one)]
    return out


if __name__ == "__main__":
    rank_main()
