"""Time boxes of a bench run: no case can hang it, and every case leaves a record the moment it ends.

Every case runs in a worker process (``cbverify.bench.worker`` for the generation matrix, ``cbverify.bench.grpo_step``
for the GRPO step). The worker appends one JSON line per finished case to its records file (flushed and fsynced) and
writes progress lines to a ``.progress`` file beside it: ``start`` when a case begins, then every ~second (the matrix)
or every trainer step (the GRPO step) what it has done so far. The parent (:func:`supervise`) follows both files and
kills the worker's process group when

- its start (imports, model load, up to its first case) passes the start box (:attr:`TimeBoxes.start_timeout_s`),
- a case passes its box: ``--case-timeout``, or less where the time budget is short (:meth:`Budget.case_box`),
- the parent is interrupted (Ctrl-C, SIGTERM),

and the caller writes the record of the case in flight itself (``timeout`` / ``interrupted``, with the progress the
worker last reported), then starts a fresh worker for the cases left.

**The time budget** (``--time-budget``) is the whole run's: each case's box is its fair share of what is left,
``(left - the starts of the workers still to come) / cases left``, at most ``--case-timeout``; a case that ends early
leaves its time to the others. When less than :data:`MIN_BOX_S` is left, the cases still to come are recorded as
``skipped`` without running. So a run ends within the budget plus :data:`STOP_GRACE_S` (stopping the case running at
the deadline) plus :data:`REPORT_S` (the report), whatever the engines do. Without a budget the worst case is every
case at its box, each after a fresh worker's start (a timeout costs the cases after it a new worker).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

POLL_S = 0.25  # how often the parent reads the worker's files (it sleeps in between: no load on the cores measured)
PROGRESS_EVERY_S = 1.0  # how often a matrix worker reports its case's progress
MIN_BOX_S = 1.0  # a case or start the budget can give less than this is skipped instead
STOP_GRACE_S = 10.0  # killing a worker past its box and reaping it, at most (then the parent moves on regardless)
REPORT_S = 20.0  # writing the report at the end (JSON, Markdown, two PNGs), at most
START_GUESS_S = 10.0  # a worker's start before one was measured (python, torch, transformers, the model)
# Per device class: a case's time box, a worker start's time box, the run's time budget (None: none). On CPU the boxes
# only catch a hang (the slowest committed case took ~45 s, the slowest GRPO case ~190 s) and there is no budget. On
# CUDA the defaults bound `cbverify bench --device cuda` at 8 minutes: a budget of 420 s + 10 s to stop the last case
# + 20 s of report = 7.5 min after the parent's start-up (see bench/README.md, "Time boxes").
DEFAULTS = {
    "cpu": {"case_timeout_s": 600.0, "start_timeout_s": 300.0, "time_budget_s": None},
    "cuda": {"case_timeout_s": 60.0, "start_timeout_s": 120.0, "time_budget_s": 420.0},
}
STATUSES = ("ok", "error", "timeout", "interrupted", "skipped", "missing")
CUT = ("timeout", "interrupted", "skipped", "missing")  # cases without a measurement (not failures of the engine)


def device_class(device: str) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


@dataclass(frozen=True, slots=True)
class TimeBoxes:
    """Seconds; None is no box. ``time_budget_s`` bounds the whole run (``Budget``)."""

    case_timeout_s: float | None
    start_timeout_s: float | None
    time_budget_s: float | None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds or None, got {value}")

    @classmethod
    def for_device(cls, device: str, **given: float | None) -> TimeBoxes:
        """The device's defaults (:data:`DEFAULTS`), each replaced by a given value; a given 0 means no box."""
        values = dict(DEFAULTS[device_class(device)])
        for name, value in given.items():
            if name not in values:
                raise TypeError(f"unknown time box {name!r}")
            if value is not None:
                values[name] = None if value == 0 else float(value)
        return cls(**values)


def status_of(record: dict) -> str:
    """A record's status: its ``status``, else ``error`` when it has one, else ``ok`` (records before statuses)."""
    return record.get("status") or ("error" if "error" in record else "ok")


def is_cut(record: dict) -> bool:
    return status_of(record) in CUT


def fmt_s(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def cut_text(record: dict) -> str:
    """One line (a table cell) for a case without a measurement."""
    status = status_of(record)
    if status == "skipped":
        return "skipped: " + record.get("reason", "the time budget was spent")
    if status == "missing":
        return "missing: no record (the run stopped before this case)"
    elapsed = record.get("elapsed_s") or 0.0
    head = f"{status} after {elapsed:.0f}s"
    if record.get("phase") == "start":
        return f"{head}: in the worker's start (imports, model load)"
    if "steps_done" in record:  # a GRPO-step case
        return f"{head}: {record['steps_done']}/{record.get('steps', '?')} trainer steps"
    done = record.get("requests_done")
    total = record.get("num_requests")
    speed = record.get("tokens_per_s_so_far")
    text = (f"{head}: {'?' if done is None else done}/{'?' if total is None else total} requests, "
            f"{0 if speed is None else speed:.0f} tok/s so far")  # fmt: skip
    return text + (" (still in the warm-up)" if record.get("phase") == "warmup" else "")


class Budget:
    """The run's clock and its time boxes: the box of each worker start and case, the cases done, and a line on
    stderr per case (``bench [i/n] ...: what it did | elapsed, ETA``).

    ``cases`` and ``workers`` are what the run plans (every case of every round; one worker per job, the vLLM GRPO
    path one per N; :meth:`restart` adds one): the budget keeps the expected starts of the workers still to come out
    of a case's share."""

    def __init__(self, boxes: TimeBoxes, *, cases: int, workers: int, clock: Callable[[], float] = time.monotonic,
                 stream=None) -> None:  # fmt: skip
        self.boxes, self.clock, self.stream = boxes, clock, stream
        self.total, self.cases_left, self.workers_left = cases, cases, workers
        self.done, self.begin, self.starts = 0, clock(), []

    def elapsed(self) -> float:
        return self.clock() - self.begin

    def left(self) -> float:
        budget = self.boxes.time_budget_s
        return math.inf if budget is None else budget - self.elapsed()

    def start_estimate(self) -> float:
        return max(self.starts) if self.starts else START_GUESS_S

    def start_box(self) -> float | None:
        """A worker start's box (``inf``: none); None when the budget cannot give it :data:`MIN_BOX_S`."""
        box = min(self.boxes.start_timeout_s or math.inf, self.left())
        return None if box < MIN_BOX_S else box

    def case_box(self) -> float | None:
        """A case's box (``inf``: none): ``--case-timeout``, less where the budget's fair share is less; None when the
        budget cannot give it :data:`MIN_BOX_S` (the case is skipped)."""
        box, left = self.boxes.case_timeout_s or math.inf, self.left()
        if math.isfinite(left):
            share = (left - self.workers_left * self.start_estimate()) / max(1, self.cases_left)
            box = min(box, max(share, MIN_BOX_S), left)
        return None if box < MIN_BOX_S else box

    def spawning(self) -> None:
        """A worker starts: its start is no longer reserved for."""
        self.workers_left = max(0, self.workers_left - 1)

    def restart(self) -> None:
        """A job's worker will start again for the cases after a cut one: reserve its start too."""
        self.workers_left += 1

    def started(self, seconds: float) -> None:
        self.starts.append(seconds)

    def worst_case_s(self) -> float:
        """The longest the rest of the run can take: every case at its box after a fresh worker's start, or the
        budget, whichever is less, plus stopping the last case and writing the report."""
        start, case = self.boxes.start_timeout_s or math.inf, self.boxes.case_timeout_s or math.inf
        every_box = self.total * (start + case + STOP_GRACE_S)
        if self.boxes.time_budget_s is not None:
            every_box = min(every_box, self.boxes.time_budget_s)
        return every_box + STOP_GRACE_S + REPORT_S

    def plan_line(self, what: str) -> str:
        b = self.boxes
        box = "no case time box" if b.case_timeout_s is None else f"a case's time box {fmt_s(b.case_timeout_s)}"
        start = "no start box" if b.start_timeout_s is None else f"a worker's start {fmt_s(b.start_timeout_s)}"
        budget = "no time budget"
        if b.time_budget_s is not None:
            budget = f"time budget {fmt_s(b.time_budget_s)} (boxes shrink to a fair share of what is left)"
        worst = self.worst_case_s()
        bound = "unbounded" if math.isinf(worst) else f"at most {fmt_s(worst)} from now"
        return f"bench: {what}; {box}, {start}, {budget}: worst case {bound}"

    def say(self, text: str) -> None:
        print(text, file=self.stream or sys.stderr, flush=True)

    def case_done(self, label: str, text: str) -> None:
        """Count one case (any status) and print its progress line."""
        self.done += 1
        self.cases_left = max(0, self.cases_left - 1)
        elapsed = self.elapsed()
        eta = elapsed / self.done * self.cases_left
        left = self.left()
        if math.isfinite(left):
            eta = min(eta, max(0.0, left))
        self.say(f"bench [{self.done}/{self.total}] {label}: {text} | {fmt_s(elapsed)} elapsed, "
                 f"ETA {fmt_s(eta) if self.cases_left else 'done'}")  # fmt: skip


# ------------------------------------------------------------------------------------------------ the worker's side
class ProgressFile:
    """The worker's progress lines (JSON, one per line, flushed): ``start`` of a case, ``progress`` of it."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.stream = open(path, "a") if path else None  # noqa: SIM115 (open for the worker's lifetime)
        self.lock = threading.Lock()
        if self.stream is not None:  # supervised: a worker whose parent died (SIGKILL) must not run on alone
            parent = os.getppid()
            threading.Thread(target=_exit_with_parent, args=(parent,), name="bench-parent", daemon=True).start()

    def write(self, event: str, **fields) -> None:
        if self.stream is None:
            return
        with self.lock:
            self.stream.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
            self.stream.flush()

    def every(self, seconds: float, snapshot: Callable[[], dict | None]) -> Callable[[], None]:
        """Write ``snapshot()`` as a ``progress`` line every ``seconds`` from a daemon thread; returns its stop."""
        done = threading.Event()

        def loop() -> None:
            while not done.wait(seconds):
                try:
                    fields = snapshot()
                except Exception:  # a count read mid-update: the next second's will do
                    continue
                if fields is not None:
                    self.write("progress", **fields)

        if self.stream is not None:
            threading.Thread(target=loop, name="bench-progress", daemon=True).start()
        return done.set


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PROGRESS_EVERY_S)
    os._exit(3)


def append_record(path: Path, record: dict) -> None:
    """Append one JSON line and make it durable (a cut run keeps every record written before the cut)."""
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())


# ------------------------------------------------------------------------------------------------ the parent's side
@dataclass(slots=True)
class Cut:
    """A worker stopped before it finished: the case in flight (``n``; None: the worker had not started a case),
    why, its box, how long it ran and the worker's last progress line for it."""

    n: int | None
    reason: str  # "timeout", "start timeout", "crashed", "interrupted", "skipped"
    box_s: float | None
    elapsed_s: float
    progress: dict = field(default_factory=dict)
    returncode: int | None = None


class _Lines:
    """New complete lines of a file that another process appends to."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path, self.offset = path, offset

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the worker's process group (it may have children: an engine's own process) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:  # never hang on a process that will not die: move on
        pass


def supervise(cmd: list[str], *, env: dict, log: Path, records: Path, progress: Path, budget: Budget,
              on_record: Callable[[dict, float], None], on_cut: Callable[[Cut], None]) -> Cut | None:  # fmt: skip
    """Run one worker and follow it until it exits, a box runs out, or the parent is interrupted.

    Each new record of ``records`` goes to ``on_record(record, seconds since its case started)``. A worker stopped
    before it finished gives a :class:`Cut` to ``on_cut`` (which writes that case's record) and back to the caller;
    an interruption (``KeyboardInterrupt`` and its subclasses) kills the worker, reports its cut and is re-raised.
    Returns None when the worker exited on its own between cases (the caller checks every case has its record)."""
    progress.unlink(missing_ok=True)
    lines = _Lines(records, records.stat().st_size if records.exists() else 0)
    events = _Lines(progress)
    budget.spawning()
    box = budget.start_box()
    if box is None:
        cut = Cut(None, "skipped", None, 0.0)
        on_cut(cut)
        return cut
    with open(log, "a") as stream:
        spawned = budget.clock()
        proc = subprocess.Popen(cmd, stdout=stream, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    since, current, last, started, began = spawned, None, {}, False, {}

    def follow() -> None:
        nonlocal since, current, last, box, started
        for event in events.read():
            if event.get("event") == "start":
                if not started:
                    started = True
                    budget.started(budget.clock() - spawned)
                current, last, since = event["n"], {}, budget.clock()
                began[current] = event.get("t", time.time())  # the worker's clock: a case may start and end in a poll
                box = budget.case_box()
            elif event.get("event") == "progress" and event.get("n") == current:
                last = event
        for record in lines.read():
            on_record(record, time.time() - began.get(record.get("n"), time.time()))
            if record.get("n") == current:
                current, last, since = None, {}, budget.clock()
                box = budget.start_box()  # until the next case starts (a worker between cases does little)

    def stop(reason: str) -> Cut:
        _kill(proc)
        follow()  # a record written while the box ran out counts
        cut = Cut(current, reason, box, budget.clock() - since, last, proc.returncode)
        if current is None and reason == "timeout":
            cut.reason = "start timeout"
        on_cut(cut)
        return cut

    try:
        while True:
            follow()
            if box is None:  # the budget has nothing left for this case
                return stop("skipped")
            if proc.poll() is not None:
                follow()
                if current is None:
                    return None
                cut = Cut(current, "crashed", box, budget.clock() - since, last, proc.returncode)
                on_cut(cut)
                return cut
            if budget.clock() - since > box:
                return stop("timeout")
            time.sleep(POLL_S)
    except BaseException:
        if proc.poll() is None or current is not None:
            stop("interrupted")
        raise
