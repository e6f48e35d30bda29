"""How cb_impl splits a step's work on each kind of device: the same tokens and log-probs either way.

On a CPU, work is cut into cache-sized pieces: attention gathers at most ``GATHER_BUDGET`` keys per SDPA call, the
sampler processes at most ``SAMPLE_BUDGET`` logits per slice, and the Gumbel race computes exact noise only for the
tokens that can still win (its pruning reads indices back, which a CPU does cheaply). On an accelerator each of those
is a kernel launch per piece and the race's index searches are host syncs, so there is one attention call per group
per layer, one sampling pass per step and exact noise for every token: the number of kernels a step launches does not
grow with the number of sequences in it (``property_tests/test_cb_dispatch.py`` counts them). SDPA there may pick
flash, memory-efficient or math kernels but not cuDNN's: cuDNN builds an execution plan for every new shape (~4 ms
a call, measured in bf16 on an H200), and the keys' length changes at every step. On CUDA a decode step's forward
is one graph replay (``graph_decodes``, ``cb_impl.graphs``): the few kernels per layer it records launch as one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.nn.attention import SDPBackend

from cb_impl.attention import GATHER_BUDGET
from cb_impl.noise import RACE_MIN_VOCAB
from cb_impl.sampler import SAMPLE_BUDGET


@dataclass(frozen=True, slots=True)
class DeviceTuning:
    """``None`` = no limit: one piece (``gather_budget``: one SDPA per attention group; ``sample_budget``: one
    sampling pass; ``race_min_vocab``: never race, exact noise for every token); ``sdpa_backends``: the kernels SDPA
    may choose from (``None``: any); ``graph_decodes``: pad decode-only steps to buckets and replay their forward
    from a graph per bucket (CUDA graphs on CUDA, their eager stand-in elsewhere, which is how the CPU tests it)."""

    gather_budget: int | None
    sample_budget: int | None
    race_min_vocab: int | None
    sdpa_backends: tuple[SDPBackend, ...] | None = None
    graph_decodes: bool = False


CPU = DeviceTuning(gather_budget=GATHER_BUDGET, sample_budget=SAMPLE_BUDGET, race_min_vocab=RACE_MIN_VOCAB)
ACCELERATOR = DeviceTuning(
    gather_budget=None,
    sample_budget=None,
    race_min_vocab=None,
    sdpa_backends=(SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
    graph_decodes=True,
)


def tuning_for(device: torch.device | str) -> DeviceTuning:
    """The CPU's tuning; CUDA's; any other accelerator's is CUDA's without graphs (they are CUDA graphs)."""
    kind = torch.device(device).type
    return CPU if kind == "cpu" else ACCELERATOR if kind == "cuda" else replace(ACCELERATOR, graph_decodes=False)
