"""Multi-process GRPO: an upstream scenario trained data-parallel on N CPU processes, each rank judged, then the ranks
judged together.

:func:`launch` starts ``python -m torch.distributed.run --nproc_per_node N --master_addr 127.0.0.1`` (torch's own
launcher; accelerate then picks ``MULTI_CPU`` with the gloo backend) on this module. Each rank runs the scenario
exactly as a single process would (:func:`cbverify.upstream.run.run_scenario`, same capture), plus a
:class:`RankRecorder` that keeps, per optimizer step, the gradient handed to the optimizer and a digest of the
parameters after it; then it writes its capture to ``<out>/rank<r>.pt``. A launch that outlives ``timeout_s`` is
killed and reported, never waited on.

:func:`check_ranks` (:mod:`cbverify.upstream.rank_checks`) judges what the ranks wrote.
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
from pathlib import Path

import torch

from cbverify import data
from cbverify.upstream.capture import Capture
from cbverify.upstream.findings import NA, CheckResult
from cbverify.upstream.rank_checks import RANK_CHECKS, check_ranks, exercised
from cbverify.upstream.scenario import TrainerScenario

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
    scenario = scenario_from_json(args.scenario)
    random = args.random_model or scenario.random_weights
    model, tokenizer = random_like(args.model, seed=0) if random else load(args.model)
    recorder = RankRecorder()
    try:
        capture = run_scenario(scenario, model, tokenizer, callbacks=(recorder.callback,))
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
               "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": str(data.import_path())}  # fmt: skip
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


def one_process_equivalent(scenario: TrainerScenario) -> TrainerScenario:
    """The same global batch on one process: ``nproc`` times the prompts per device (and the batch size)."""
    batch, nproc = scenario.per_device_train_batch_size, scenario.nproc
    return dataclasses.replace(scenario, nproc=1, num_prompts=scenario.num_prompts * nproc,
                               per_device_train_batch_size=None if batch is None else batch * nproc)  # fmt: skip


_BASE = dict(nproc=2, num_generations=4, num_prompts=1, per_device_train_batch_size=2, top_k=3, reward="token_sum",
             max_completion_length=6, max_grad_norm=0.0, random_weights=True)  # fmt: skip
# Groups of 4 over 2 processes of 2 rows: every group spans both processes. No gradient clipping: a gradient of the
# wrong size must not be clipped back to the right one. Rewards read the completion alone (token_sum). Random weights:
# near-uniform top-3 choices, so a group's members differ (nonzero advantages and gradients to compare across process
# layouts) and two independent streams draw the same completion with a computable, tiny probability.
DISTRIBUTED_SCENARIOS: tuple[TrainerScenario, ...] = tuple(
    TrainerScenario(**{**_BASE, **kw})
    for kw in (
        dict(path="rollout_func", rollout_backend="reference"),
        dict(path="rollout_func", rollout_backend="cb_impl", top_entropy_quantile=0.5, is_correction=True),
        dict(path="generate", scale_rewards="batch", more_rewards=("length",), reward_weights=(1.0, 0.5), bf16=True),
        # equal rewards (5/7 each): every group's advantages must be exactly 0 on each process's slice
        dict(path="cb", reward="constant"),
        # rows of unequal length, the ones cut at max_completion_length masked: the ranks hold unequal token counts
        dict(
            path="rollout_func",
            rollout_backend="reference",
            max_completion_length=12,
            mask_truncated_completions=True,
            reward="length",
            top_k=0,
        ),
    )
)


def run_distributed(scenarios, model_name: str, model, *, random_model: bool = False, progress: bool = True,
                    launcher: str = "torchrun"):  # fmt: skip
    """``([(scenario, result)], {scenario label: what it exercised})``: each scenario on its processes and, for
    comparison, on one process (:func:`cbverify.upstream.rank_checks.exercised`)."""
    from tqdm import tqdm

    from cbverify.upstream.run import not_applicable
    from reference.models import random_like

    out, facts = [], {}
    for scenario in tqdm(list(scenarios), desc="multi-process scenarios", disable=not progress, unit="run"):
        stand_in = None
        if (reason := not_applicable(scenario)) and not not_applicable(other := stand_in_for(scenario)):
            scenario, stand_in = other, reason  # what the scenario was built to exercise, on a path this release has
        elif reason:
            out += [(scenario, CheckResult(c, scenario.path, NA, reason, scenario.describe())) for c in RANK_CHECKS]
            facts[scenario.describe()] = {"not run": reason}
            continue
        run = launch(scenario, model_name, random_model=random_model, launcher=launcher)
        one = launch(one_process_equivalent(scenario), model_name, random_model=random_model)
        judged = random_like(model_name, seed=0)[0] if scenario.random_weights and not random_model else model
        out += [(scenario, r) for r in check_ranks(scenario, run, judged, one)]
        facts[scenario.describe()] = exercised(scenario, run) | ({"stand-in for": stand_in} if stand_in else {})
    return out, facts


def stand_in_for(scenario: TrainerScenario) -> TrainerScenario:
    """The scenario on ``generate()``, which every release has: a scenario is built for what it exercises (equal
    rewards, unequal token counts per rank, ...), so on a release without its path (TRL before 1.7 has no
    continuous-batching option) the same configuration on another path keeps its checks judging instead of leaving
    them NOT-APPLICABLE there."""
    return dataclasses.replace(scenario, path="generate")


if __name__ == "__main__":
    rank_main()
