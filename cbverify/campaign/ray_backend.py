"""The Ray backend: ``--ray auto`` starts a local Ray instance, ``--ray ADDRESS`` joins an existing cluster.

Each task is one Ray task (1 CPU) retried up to :data:`MAX_RETRIES` times elsewhere when its worker or node dies
(Ray's ``max_retries``), and when it raises :class:`~cbverify.campaign.core.InfrastructureError` (``retry_exceptions``
names only that class: a check's FAIL is a result, never an exception). Attempts are counted by an
:class:`~cbverify.campaign.core.AttemptCounter` actor pinned to the head node (zero CPUs, named
``cbverify-attempts-<id>`` in the ``cbverify`` namespace): every attempt asks it for its number as it starts, so a task
whose node died mid-run comes back with ``attempt`` 2. Tasks are submitted as CPUs free up, so a task submitted
later carries what earlier ones found (``prepare``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

from cbverify.campaign.core import AttemptCounter, InfrastructureError, RayUnavailable, Task, execute

MAX_RETRIES = 3
NAMESPACE = "cbverify"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--ray needs Ray: pip install 'cbverify[ray]'") from None
    return ray


def _attempt(fn, kwargs: dict, key: str, counter) -> dict:
    """The body of every Ray task: take an attempt number, note the node, run the task."""
    import ray

    attempt = ray.get(counter.next.remote(key))
    node = {"ip": ray.util.get_node_ip_address(), "id": ray.get_runtime_context().get_node_id()}
    return execute(fn, kwargs, key, attempt, node)


class RayBackend:
    """Connected on construction (``address``: ``"auto"`` for a local instance, else a cluster address); Ray is shut
    down by :meth:`close` only if this backend started it."""

    def __init__(self, address: str) -> None:
        ray = self.ray = _import_ray()
        self.started = not ray.is_initialized()
        if self.started:
            try:
                ray.init(address="local" if address == "auto" else address, namespace=NAMESPACE,
                         log_to_driver=False, logging_level="ERROR")  # fmt: skip
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise RayUnavailable(f"--ray {address}: {' '.join(str(err).split())[:200]}") from None
        self.remote = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=[InfrastructureError])(_attempt)

    def _counter(self):
        """A fresh attempt counter on the head node: the cluster ends with it anyway, so the counter lives as long as
        any task can (the driver's own node is no better: on a machine with several nodes it may be any of them)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        head = next(n["NodeID"] for n in self.ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])
        pinned = NodeAffinitySchedulingStrategy(head, soft=False)
        actor = self.ray.remote(num_cpus=0)(AttemptCounter)
        name = f"cbverify-attempts-{uuid.uuid4().hex[:8]}"
        return actor.options(name=name, namespace=NAMESPACE, scheduling_strategy=pinned).remote()

    def slots(self) -> int:
        """Tasks in flight at once: the cluster's CPUs now (at least one)."""
        return max(1, int(self.ray.cluster_resources().get("CPU", 1)))

    def run(self, tasks: list[Task], prepare: Callable[[Task], dict]) -> Iterator[dict]:
        """One envelope per task as each finishes; a task that failed for good (retries spent) is an envelope with
        the error."""
        ray, counter, pending, running = self.ray, self._counter(), list(tasks), {}
        try:
            while pending or running:
                while pending and len(running) < self.slots():
                    task = pending.pop(0)
                    running[self.remote.remote(task.fn, prepare(task), task.key, counter)] = task
                ready, _ = ray.wait(list(running), num_returns=1)
                task = running.pop(ready[0])
                try:
                    yield ray.get(ready[0])
                except ray.exceptions.RayError as err:
                    attempts = ray.get(counter.counts.remote()).get(task.key, 0)
                    yield {"key": task.key, "attempt": attempts, "node": None, "seconds": 0.0,
                           "error": f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]}  # fmt: skip
        finally:
            ray.kill(counter)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


def connect(address: str) -> RayBackend:
    """The backend for ``--ray ADDRESS``; :class:`RayUnavailable` when Ray is not installed or the address cannot be
    reached (the CLI refuses with its message, exit 2)."""
    return RayBackend(address)
