"""Paged KV-cache block accounting: allocation, reference-counted sharing and copy-on-write (no torch).

Invariants (checked by ``check_invariants`` and the state-machine test):

- every block id in ``[0, num_blocks)`` is either free (in ``free_block_ids``, refcount 0) or used (refcount >= 1),
  never both, and the free list holds no duplicates;
- a block's refcount equals the number of block-table entries, over all live sequences, that name it;
- a sequence's block table covers at least the tokens it has computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from cb_impl.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out fixed-size blocks of KV-cache slots to sequences (nano-vllm / vLLM naming)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.num_cow_copies = 0
        self.peak_used_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def _take(self) -> int:
        if not self.free_block_ids:
            raise RuntimeError("out of KV-cache blocks: the scheduler should have checked can_allocate/can_append")
        block_id = self.free_block_ids.popleft()
        self.ref_counts[block_id] = 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return block_id

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] < 0:
            raise RuntimeError(f"block {block_id} released more often than it was taken")
        if self.ref_counts[block_id] == 0:
            self.free_block_ids.append(block_id)

    # --- allocation --------------------------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give a sequence that holds no blocks enough blocks for ``num_tokens`` tokens."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id!r} already holds blocks")
        needed = blocks_for(num_tokens, self.block_size)
        if not self.can_allocate(needed):
            raise RuntimeError(f"cannot allocate {needed} blocks, {self.num_free_blocks} free")
        seq.block_table = [self._take() for _ in range(needed)]

    def deallocate(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks nobody else uses return to the free list."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (refcount + 1 each); writes later copy on write."""
        if child.block_table:
            raise RuntimeError(f"sequence {child.request_id!r} already holds blocks")
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.ref_counts[block_id] += 1

    # --- appending -----------------------------------------------------------------------------------------------
    def append_cost(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks needed before ``seq`` can write ``num_new_tokens`` more tokens (new blocks + copy on write)."""
        bs, table, start = self.block_size, seq.block_table, seq.num_computed_tokens
        new = -(-(start + num_new_tokens) // bs) - len(table)  # blocks_for, inlined (once per sequence and step)
        shared = start % bs and self.ref_counts[table[start // bs]] > 1  # computed tokens have blocks
        return (new if new > 0 else 0) + (1 if shared else 0)  # a shared, partly filled block is copied first

    def may_append(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make ``seq``'s blocks ready for writing ``num_new_tokens`` tokens; returns ``(src, dst)`` block copies
        the KV cache must perform before the write (copy on write of a shared, partly filled block)."""
        if self.append_cost(seq, num_new_tokens) > len(self.free_block_ids):
            raise RuntimeError(f"sequence {seq.request_id!r}: not enough free blocks to append")
        copies: list[tuple[int, int]] = []
        start, table, bs = seq.num_computed_tokens, seq.block_table, self.block_size
        first = start // bs
        if start % bs and self.ref_counts[table[first]] > 1:  # computed tokens have blocks: table[first] exists
            src, dst = table[first], self._take()
            seq.count("cow_2" if self.ref_counts[src] == 2 else "cow_3plus")
            self._release(src)
            table[first] = dst
            copies.append((src, dst))
            self.num_cow_copies += 1
        table.extend(self._take() for _ in range(max(0, blocks_for(start + num_new_tokens, bs) - len(table))))
        return copies

    # --- checking ------------------------------------------------------------------------------------------------
    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Raise ``AssertionError`` when the accounting is inconsistent with the live sequences' block tables."""
        uses = [0] * self.num_blocks
        for seq in live:
            assert seq.num_computed_tokens <= len(seq.block_table) * self.block_size, f"{seq} overflows its blocks"
            for block_id in seq.block_table:
                uses[block_id] += 1
        free = list(self.free_block_ids)
        assert len(free) == len(set(free)), "duplicate block in the free list"
        free_set = set(free)
        for block_id in range(self.num_blocks):
            assert uses[block_id] == self.ref_counts[block_id], f"block {block_id}: refcount != uses"
            assert (block_id in free_set) == (uses[block_id] == 0), f"block {block_id}: free/used mismatch"
