"""Which tokens of which sequences run in the next forward (no torch).

Policy, per step (vLLM v1-style unified scheduling):

1. Running sequences, oldest first, each get their uncomputed tokens (1 for a decode, a chunk for a partial
   prefill) within the ``max_batch_tokens`` budget. When blocks run out, the most recently admitted running
   sequence is preempted (recompute: its blocks are freed and it returns to the head of the queue); a sequence that
   is itself the most recent preempts itself.
2. If nothing was preempted, waiting sequences are admitted in arrival order (FIFO, never skipping the head) while
   seats (``max_num_seqs``), budget and blocks last. Blocks for the whole input are allocated on admission, so a
   chunked prefill never runs out halfway. With prefix sharing, fresh sequences with the same prompt queued right
   behind the head (a GRPO group) are admitted with it as followers: they are forked from the head once its prompt
   is computed and sample their first token from its last-position logits.

Invariants: tokens scheduled <= ``max_batch_tokens``; running <= ``max_num_seqs``; waiting is sorted by arrival;
every admitted sequence finishes (or is aborted) exactly once; every chunk has at least one token, and a step with
unfinished work schedules at least one chunk (nothing empty reaches the model: ``model_runner.check_batch``). A step
may sample nothing (partial prefills only); then the sampler is not called.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cb_impl.block_manager import BlockManager, blocks_for
from cb_impl.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: ``(seq, num_new_tokens)`` chunks in packing order, the sequences that sample this step and
    (``sample_chunks``) the chunk whose last logits each uses, block copies to perform before the forward; counts of
    the chunks' tokens, of decode tokens (one-token chunks of a completion token) and of partial prefills."""

    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    samples: list[Sequence] = field(default_factory=list)
    sample_chunks: list[int] = field(default_factory=list)  # non-decreasing
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_tokens: int = 0
    num_decode_tokens: int = 0
    num_partial_prefills: int = 0
    forks: bool = False  # some sampling sequence is a follower, forked from its parent after the forward
    tables_changed: bool = False  # a running table grew or copied a block (admissions, preemptions: new chunks)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_batch_tokens: int, max_num_seqs: int,
                 enable_prefix_sharing: bool = True) -> None:  # fmt: skip
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_sharing = enable_prefix_sharing
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_forks = 0

    def add(self, seq: Sequence) -> None:
        if self.waiting and self.waiting[-1].seq_id >= seq.seq_id:
            raise ValueError(f"sequence ids must increase with arrival, got {seq.seq_id} after {self.waiting[-1]}")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling --------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        bm, budget, preempted, i = self.block_manager, self.max_batch_tokens, False, 0
        running, refs, bs = self.running, bm.ref_counts, bm.block_size
        while i < len(running) and budget > 0:
            seq = running[i]
            i += 1
            if seq.parent is not None:  # a follower waits for its parent's prefill
                continue
            start = seq.num_computed_tokens
            num_new = min(len(seq.token_ids) - start, budget)  # 1 for a decode
            if num_new == 1 and start % bs and refs[seq.block_table[start // bs]] == 1:
                self._add_chunk(batch, seq, 1)  # inside its own partly filled block: nothing to allocate or copy
                budget -= 1
                continue
            while (cost := bm.append_cost(seq, num_new)) > len(bm.free_block_ids):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            if cost:  # new blocks, or a copy of a shared block before writing into it
                batch.copies += bm.may_append(seq, num_new)
                batch.tables_changed = True
            self._add_chunk(batch, seq, num_new)
            budget -= num_new
        if not preempted:
            budget = self._admit(batch, budget)
        return batch

    def _add_chunk(self, batch: ScheduledBatch, seq: Sequence, num_new: int) -> None:
        batch.chunks.append((seq, num_new))
        batch.num_tokens += num_new
        if num_new == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
            batch.num_decode_tokens += 1
        if seq.num_computed_tokens + num_new < len(seq.token_ids):
            batch.num_partial_prefills += 1
            seq.count("partial_prefill")
            return
        chunk_index = len(batch.chunks) - 1
        batch.samples.append(seq)
        batch.sample_chunks.append(chunk_index)
        if seq.followers:
            batch.samples += seq.followers
            batch.sample_chunks += [chunk_index] * len(seq.followers)
            batch.forks = True

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            if not bm.can_allocate(blocks_for(head.num_tokens, bm.block_size)):
                break
            bm.allocate(self.waiting.popleft(), head.num_tokens)
            head.status = SequenceStatus.RUNNING
            self.running.append(head)
            while self.enable_prefix_sharing and head.num_completion_tokens == 0 and self.waiting:
                nxt = self.waiting[0]
                same_prompt = nxt.num_completion_tokens == 0 and nxt.token_ids == head.token_ids
                if len(self.running) >= self.max_num_seqs or not same_prompt:
                    break
                self.waiting.popleft()
                nxt.status, nxt.parent = SequenceStatus.RUNNING, head
                head.followers.append(nxt)
                self.running.append(nxt)
            num_new = min(head.num_tokens, budget)  # a waiting sequence has nothing computed
            self._add_chunk(batch, head, num_new)
            budget -= num_new
        return budget

    # --- transitions -------------------------------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks and put the sequence back at the head of the queue."""
        for follower in reversed(seq.followers):  # followers are behind their parent; normally already gone
            self.preempt(follower)
        if seq.parent is not None:
            seq.parent.followers.remove(seq)
            seq.parent = None
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        seq.count("preemption")
        self.num_preemptions += 1

    def postprocess(self, batch: ScheduledBatch, tokens: list[int], logprobs: list[float]) -> list[Sequence]:
        """Advance the computed counts, fork followers, append the sampled tokens (one per ``batch.samples``
        entry, same order); returns the sequences that finished, already freed."""
        if len(tokens) != len(batch.samples) or len(logprobs) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens, {len(logprobs)} log-probs for {len(batch.samples)} samples")
        for seq, num_new in batch.chunks:
            seq.num_computed_tokens += num_new
        for seq in batch.samples if batch.forks else ():  # parents precede followers; a fork reads its blocks
            if seq.parent is not None:
                self.block_manager.fork(seq.parent, seq)
                seq.num_computed_tokens = seq.parent.num_computed_tokens
                seq.parent = None
                seq.count("shared_prefill")
                self.num_forks += 1
            if seq.followers:
                seq.followers = []
        finished = []
        for seq, token, logprob in zip(batch.samples, tokens, logprobs, strict=True):
            if seq.append_token(token, logprob):
                self.finish(seq)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished, failed or aborted) from the queues and free its blocks."""
        for follower in list(seq.followers):
            follower.parent = None
        seq.followers = []
        if seq.parent is not None:
            seq.parent.followers.remove(seq)
            seq.parent = None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
