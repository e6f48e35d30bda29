"""One request's mutable generation state (pure Python: no torch, so the bookkeeping tests run in milliseconds).

Invariants, for a sequence ``s``:

- ``s.token_ids == prompt + completion``; ``len(s.logprobs) == len(completion) <= max_new_tokens``;
- ``0 <= s.num_computed_tokens <= s.num_tokens``: the first ``num_computed_tokens`` tokens have their keys/values in
  the KV cache, in the blocks listed by ``s.block_table`` (position ``p`` lives in ``block_table[p // block_size]``);
- a ``WAITING`` sequence holds no blocks and has ``num_computed_tokens == 0``;
- a sequence with a ``parent`` is ``RUNNING`` but holds no blocks yet: it waits for the parent's prompt prefill and
  is then forked from it (shares its blocks) and sampled from the parent's last-position logits;
- a ``FINISHED`` sequence holds no blocks; it has a ``finish_reason`` unless it failed or was aborted (then the
  engine raised or dropped it: it is never returned).

``events`` counts what the engine's mechanisms did to the sequence (:data:`EVENTS`), so a caller can tell which of
them a workload reached and which requests each one touched.
"""

from __future__ import annotations

import enum
from typing import Any

EVENTS = {
    "shared_prefill": "forked from the request ahead of it with the same prompt: its prompt's blocks shared",
    "cow_2": "copied a shared, partly filled block before writing into it, the block then having 2 sharers",
    "cow_3plus": "the same with 3 or more sharers",
    "partial_prefill": "a prompt chunk that did not reach the prompt's end (chunked prefill)",
    "preemption": "preempted (blocks freed, recomputed later)",
}


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Generation state of one request. ``seq_id`` is the arrival index: smaller ids arrived earlier."""

    __slots__ = (
        "seq_id", "request_id", "token_ids", "num_prompt_tokens", "max_new_tokens", "eos_token_ids", "logprobs",
        "num_computed_tokens", "block_table", "status", "parent", "followers", "finish_reason", "sampler_row",
        "events",
    )  # fmt: skip

    def __init__(self, seq_id: int, prompt_ids: tuple[int, ...] | list[int], *, max_new_tokens: int,
                 eos_token_ids: tuple[int, ...] | frozenset[int] = (),
                 request_id: str | None = None) -> None:  # fmt: skip
        if not prompt_ids:
            raise ValueError(f"sequence {seq_id}: empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"sequence {seq_id}: max_new_tokens must be >= 1, got {max_new_tokens}")
        self.seq_id = seq_id
        self.request_id = request_id if request_id is not None else str(seq_id)
        self.token_ids: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.logprobs: list[float] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.parent: Sequence | None = None
        self.followers: list[Sequence] = []
        self.finish_reason: str | None = None
        self.sampler_row: Any = None  # the engine's per-request sampling constants (opaque to the bookkeeping)
        self.events: dict[str, int] = {}  # EVENTS name -> times

    def count(self, event: str) -> None:
        """One more ``event`` (a name of :data:`EVENTS`) happened to this sequence."""
        self.events[event] = self.events.get(event, 0) + 1

    # --- derived quantities -------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[: self.num_prompt_tokens])

    @property
    def completion_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[self.num_prompt_tokens :])

    # --- transitions -------------------------------------------------------------------------------------------
    def append_token(self, token_id: int, logprob: float) -> bool:
        """Record a sampled token; returns True (and sets ``finish_reason``) when the sequence is now complete."""
        if self.status is SequenceStatus.FINISHED:
            raise RuntimeError(f"sequence {self.request_id!r}: token appended after it finished")
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        if token_id in self.eos_token_ids:
            self.finish_reason = "stop"
        elif len(self.token_ids) - self.num_prompt_tokens >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, tokens={self.num_prompt_tokens}+"
                f"{self.num_completion_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table})")  # fmt: skip
