"""The backend-agnostic part of a campaign: tasks, envelopes, attempt counting, the resume ledger and the merge.

A backend is any object with ``run(tasks, prepare) -> Iterator[envelope]``: it runs each task's function with the
keyword arguments ``prepare(task)`` returns at the moment the task is submitted (so a task submitted later can carry
what earlier ones found) and yields one envelope per task, in the order they finish. :func:`run_campaign` drives a
backend with resume and a progress bar.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import cbverify


class InfrastructureError(RuntimeError):
    """The node could not do the work (no disk for the environment, an unreachable package index): the Ray backend
    retries the task elsewhere. Never raised for a verdict: a check's FAIL is part of a task's result."""


class RayUnavailable(RuntimeError):
    """``--ray`` was given but Ray cannot be used (not installed, or the cluster cannot be reached)."""


@dataclass(frozen=True)
class Task:
    """One unit of a campaign. ``key``: unique within it (a column, a shard); ``pins``: JSON-able, everything besides
    cbverify's version that decides the result (versions, options); ``fn``: a module-level function, importable on
    every node, called with ``prepare(task)`` (default :attr:`kwargs`) and returning a JSON-able dict."""

    key: str
    pins: dict
    fn: Callable[..., dict]
    kwargs: dict = field(default_factory=dict)


def resume_key(kind: str, pins: dict) -> str:
    """The ledger key of a task: the campaign kind, its pins and cbverify's version, hashed."""
    text = json.dumps({"kind": kind, "pins": pins, "cbverify": cbverify.__version__}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class AttemptCounter:
    """How many times each task has started. A task asks for its number as it starts, so a task whose first worker
    died counts 2 (the Ray backend holds one in an actor on the head node; the local backend one in memory)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def next(self, key: str) -> int:
        """Count one more start of ``key``; its attempt number (1 for the first)."""
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            return self._counts[key]

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def local_node() -> dict:
    """This machine as an envelope's ``node``."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    return {"ip": ip, "id": "local"}


def execute(fn: Callable[..., dict], kwargs: dict, key: str, attempt: int, node: dict) -> dict:
    """Run one task and wrap its result: ``{"key", "attempt", "node", "seconds", "result"}``. An
    :class:`InfrastructureError` propagates (the backend may retry); any other exception is the envelope's
    ``error`` (one line), so a broken task is reported once instead of lost."""
    start = time.perf_counter()
    envelope = {"key": key, "attempt": attempt, "node": node}
    try:
        envelope["result"] = fn(**kwargs)
    except InfrastructureError:
        raise
    except Exception as err:  # noqa: BLE001 - reported in the merged table, never swallowed
        envelope["error"] = f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]
    envelope["seconds"] = round(time.perf_counter() - start, 1)
    return envelope


class Ledger:
    """The results file of a campaign in the driver's output folder (``<kind>-campaign.jsonl``): one line per task
    that finished without an error, ``{"resume": resume_key, "envelope": ...}``. A line cut short (the driver killed
    while writing) is ignored; a later line for the same key replaces an earlier one."""

    def __init__(self, folder: Path, kind: str) -> None:
        self.kind = kind
        self.path = folder / f"{kind}-campaign.jsonl"

    def load(self) -> dict[str, dict]:
        """resume key -> envelope of every finished task recorded so far."""
        done: dict[str, dict] = {}
        if not self.path.is_file():
            return done
        for line in self.path.read_text().splitlines():
            try:
                entry = json.loads(line)
                done[entry["resume"]] = entry["envelope"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        return done

    def record(self, task: Task, envelope: dict) -> None:
        """Append a finished task (an envelope with an ``error`` is not recorded: a rerun tries it again)."""
        if "error" in envelope:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as file:
            file.write(json.dumps({"resume": resume_key(self.kind, task.pins), "envelope": envelope}) + "\n")


def merge(tasks: list[Task], stored: dict[str, dict], fresh: Iterable[dict]) -> dict[str, dict]:
    """key -> envelope for every task, in task order, each exactly once: ``stored`` (key -> envelope from the ledger)
    for the skipped ones, ``fresh`` for the ones run now. A task with no envelope, a fresh envelope for a key not
    asked for, or two for one key is an error (something was lost or done twice)."""
    keys = [t.key for t in tasks]
    if len(set(keys)) != len(keys):
        raise ValueError(f"task keys repeat: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    got = dict(stored)
    for envelope in fresh:
        key = envelope["key"]
        if key not in keys or key in got:
            raise ValueError(f"envelope for {key!r}: {'not a task' if key not in keys else 'a second one'}")
        got[key] = envelope
    missing = [k for k in keys if k not in got]
    if missing:
        raise ValueError(f"no result for {missing}")
    return {k: got[k] for k in keys}


def run_campaign(backend, kind: str, tasks: list[Task], folder: Path, *, prepare: Callable[[Task], dict] | None = None,
                 on_done: Callable[[dict], None] | None = None) -> dict[str, dict]:  # fmt: skip
    """Run ``tasks`` on ``backend`` with resume: tasks whose pins were finished before (the ledger in ``folder``)
    are skipped and their stored envelopes reused; every fresh envelope is recorded as it arrives and handed to
    ``on_done``; a tqdm bar counts tasks. Returns :func:`merge`'s key -> envelope."""
    from tqdm import tqdm

    ledger = Ledger(folder, kind)
    done = ledger.load()
    stored = {t.key: done[resume_key(kind, t.pins)] for t in tasks if resume_key(kind, t.pins) in done}
    todo = [t for t in tasks if t.key not in stored]
    if stored:
        print(f"resuming: {len(stored)} of {len(tasks)} finished before, skipped: {', '.join(stored)}", flush=True)
    by_key = {t.key: t for t in todo}
    fresh = []
    with tqdm(total=len(tasks), initial=len(stored), desc=kind, unit="task") as bar:
        for envelope in backend.run(todo, prepare or (lambda t: t.kwargs)):
            ledger.record(by_key[envelope["key"]], envelope)
            fresh.append(envelope)
            if on_done is not None:
                on_done(envelope)
            bar.update()
    return merge(tasks, stored, fresh)
