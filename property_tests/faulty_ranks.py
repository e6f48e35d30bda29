"""Faulty ranks for the multi-process checks: ``python -m property_tests.faulty_ranks`` is
``cbverify.upstream.distributed``'s rank entry point with one fault applied, named by ``CBVERIFY_RANK_FAULT``:

- ``swap``: the ``rollout_func`` returns the next rank's completions (gathered over the process group) for its own
  prompts;
- ``drop``: the ``rollout_func`` drops its last completion;
- ``raise``: the last rank's ``rollout_func`` raises (a model error inside generation);
- ``unscaled``: each process's loss is divided by the number of processes once more (a normaliser that forgets that
  gradients are averaged over processes): every gradient is 1/N of the single process's.
"""

from __future__ import annotations

import os

import torch

from cbverify.upstream import distributed, run

FAULT = os.environ.get("CBVERIFY_RANK_FAULT", "")


def _faulty_rollouts(make):
    def build(*args, **kwargs):
        rollout = make(*args, **kwargs)

        def faulty(prompts, trainer):
            out = rollout(prompts, trainer)
            rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
            if FAULT == "swap":
                everyone = [None] * world
                torch.distributed.all_gather_object(everyone, out)
                out = everyone[(rank + 1) % world]
            elif FAULT == "drop":
                out = {k: v[:-1] for k, v in out.items()}
            elif FAULT == "raise" and rank == world - 1:
                raise RuntimeError(f"injected model error on rank {rank}")
            return out

        return faulty

    return build


def _unscaled_loss():
    from trl import GRPOTrainer

    original = GRPOTrainer._compute_loss

    def compute_loss(self, model, inputs):
        return original(self, model, inputs) / self.accelerator.num_processes

    GRPOTrainer._compute_loss = compute_loss


if __name__ == "__main__":
    if FAULT == "unscaled":
        _unscaled_loss()
    elif FAULT:
        run.make_rollout_func = _faulty_rollouts(run.make_rollout_func)
    distributed.rank_main()
