"""Campaigns: run a command's independent units of work (a matrix combination, a fuzz shard, a zoo architecture, a
conformance engine) on a backend, and merge what comes back into the command's usual output.

- :mod:`~cbverify.campaign.core`: the backend-agnostic part. A :class:`~cbverify.campaign.core.Task` is a key, the
  pins that decide its result, and a module-level function returning a JSON-able dict; every finished task comes back
  as an *envelope* (``key``, ``attempt``, ``node``, ``seconds``, ``result`` or ``error``). Finished envelopes are
  appended to a results file in the driver's output folder, keyed by the pins and cbverify's version, so a rerun
  skips them (:class:`~cbverify.campaign.core.Ledger`); :func:`~cbverify.campaign.core.merge` puts every task in the
  merged result exactly once.
- :mod:`~cbverify.campaign.local`: the local backend (one fresh process per task, ``jobs`` at once).
- :mod:`~cbverify.campaign.ray_backend`: the Ray backend (``--ray auto`` or ``--ray ADDRESS``): one Ray task per
  unit, retried elsewhere when its worker or node dies, attempts counted by an actor on the head node.
- :mod:`~cbverify.campaign.matrix`, :mod:`~cbverify.campaign.fuzz`, :mod:`~cbverify.campaign.zoo`,
  :mod:`~cbverify.campaign.conformance`: what each command's unit runs on a node and how its results merge.

Nothing here assumes a shared filesystem: a task's inputs travel as arguments, its outputs (JSON, logs, files' text)
as its return value. Only the CLI layer imports this package (``property_tests/test_layers.py``).
"""
