"""The local backend: each task in a fresh process of this interpreter (spawned, so a task's imports and global state
never leak into the next), at most ``jobs`` at once, submitted only when a slot is free."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

from cbverify.campaign.core import AttemptCounter, Task, execute, local_node


class LocalBackend:
    """``run(tasks, prepare)`` yields one envelope per task as each finishes. Nothing is retried: a task that raises
    :class:`~cbverify.campaign.core.InfrastructureError` here is an envelope with that error."""

    def __init__(self, jobs: int = 1) -> None:
        self.jobs = max(1, jobs)
        self.attempts = AttemptCounter()

    def run(self, tasks: list[Task], prepare: Callable[[Task], dict]) -> Iterator[dict]:
        pending = list(tasks)
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(self.jobs, mp_context=context, max_tasks_per_child=1) as pool:
            running: dict[Future, Task] = {}
            while pending or running:
                while pending and len(running) < self.jobs:
                    task = pending.pop(0)
                    attempt = self.attempts.next(task.key)
                    args = (task.fn, prepare(task), task.key, attempt, local_node())
                    running[pool.submit(execute, *args)] = task
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    task = running.pop(future)
                    yield _envelope(future, task, self.attempts.counts()[task.key])

    def close(self) -> None:
        """Nothing to release: each :meth:`run` closes its own pool."""


def _envelope(future: Future, task: Task, attempt: int) -> dict:
    """The task's envelope, or one carrying the error its process died of."""
    try:
        return future.result()
    except Exception as err:  # noqa: BLE001 - a dead process or an infrastructure error: reported, not lost
        return {"key": task.key, "attempt": attempt, "node": local_node(), "seconds": 0.0,
                "error": f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]}  # fmt: skip
