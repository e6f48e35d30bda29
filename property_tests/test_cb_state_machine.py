"""A ``RuleBasedStateMachine`` over cb_impl's block manager + scheduler (no torch, no model: a fake sampler).

Invariants after every rule: no block leaks, reference counts equal uses, free and used blocks partition all blocks,
the token/seat/block budgets are never exceeded, waiting is in arrival order and holds no blocks. Each step checks
that admission is FIFO and that every sample reads a chunk that completes its own (or its parent's) input. At
teardown every admitted request has finished exactly once, with the tokens the fake sampler dictates.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cb_impl.block_manager import BlockManager, blocks_for
from cb_impl.scheduler import Scheduler
from cb_impl.sequence import Sequence, SequenceStatus
from property_tests.helpers import SUMMARY

EOS = 0
# What every run of the machine did, summed over the session and printed at the end (``make fuzz`` runs it long).
TALLY: Counter = Counter()


def fake_token(seq_id: int, position: int) -> int:
    """The fake model's token: a pure function of (request, completion position), like the spec's noise."""
    return (seq_id * 7919 + position * 104729) % 11


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 8]), max_batch_tokens=st.integers(1, 24),
        max_num_seqs=st.integers(1, 6), sharing=st.booleans(),
    )  # fmt: skip
    def setup(self, num_blocks, block_size, max_batch_tokens, max_num_seqs, sharing):
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(self.bm, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                               enable_prefix_sharing=sharing)  # fmt: skip
        self.max_batch_tokens, self.max_num_seqs = max_batch_tokens, max_num_seqs
        self.next_id = 0
        self.all: dict[int, Sequence] = {}
        self.finished: list[int] = []
        self.ever_admitted: set[int] = set()

    @rule(prompt=st.lists(st.integers(1, 10), min_size=1, max_size=12), max_new=st.integers(1, 10),
          group=st.integers(1, 4), eos=st.booleans())  # fmt: skip
    def add_group(self, prompt, max_new, group, eos):
        if blocks_for(len(prompt) + max_new - 1, self.bm.block_size) > self.bm.num_blocks:
            return  # the engine rejects such a request before it reaches the scheduler
        for _ in range(group):
            seq = Sequence(self.next_id, prompt, max_new_tokens=max_new, eos_token_ids=(EOS,) if eos else ())
            self.all[seq.seq_id] = seq
            self.sched.add(seq)
            self.next_id += 1

    @precondition(lambda self: self.sched.has_unfinished())
    @rule()
    def step(self):
        TALLY["scheduler steps"] += 1
        waiting_before = [s.seq_id for s in self.sched.waiting]
        running_before = {s.seq_id for s in self.sched.running}
        preemptions_before = self.sched.num_preemptions
        batch = self.sched.schedule()
        assert batch.num_tokens <= self.max_batch_tokens
        assert len(self.sched.running) <= self.max_num_seqs
        admitted = [s.seq_id for s in self.sched.running if s.seq_id not in running_before]
        still_waiting = [s.seq_id for s in self.sched.waiting]
        # FIFO: those admitted are exactly the oldest waiting ones (preempted ones re-enter at the head)
        assert all(a < w for a in admitted for w in still_waiting if w in waiting_before), (admitted, still_waiting)
        if self.sched.num_preemptions > preemptions_before:  # the policy: no admission in a step that preempts
            assert not admitted, f"admitted {admitted} in a step that preempted (would thrash)"
        self.ever_admitted.update(admitted)
        chunk_seqs = [s for s, _ in batch.chunks]
        assert len({id(s) for s in chunk_seqs}) == len(chunk_seqs), "a sequence scheduled twice in one step"
        for seq, n in batch.chunks:
            assert n >= 1 and seq.status is SequenceStatus.RUNNING and seq.parent is None
            assert seq.num_computed_tokens + n <= len(seq.block_table) * self.bm.block_size, "write past the blocks"
        assert len(batch.sample_chunks) == len(batch.samples)
        assert batch.sample_chunks == sorted(batch.sample_chunks), "the model runner needs them non-decreasing"
        for seq, c in zip(batch.samples, batch.sample_chunks, strict=True):
            owner, n = batch.chunks[c]
            assert owner is seq or seq.parent is owner, "a sample reads another sequence's logits"
            assert owner.num_computed_tokens + n == owner.num_tokens, "sampling before the input is computed"
            if seq is not owner:
                assert seq.token_ids == owner.token_ids and not seq.block_table
        tokens = [fake_token(s.seq_id, s.num_completion_tokens) for s in batch.samples]
        for seq in self.sched.postprocess(batch, tokens, [-1.0] * len(tokens)):
            assert seq.seq_id not in self.finished, f"{seq.seq_id} finished twice"
            assert seq.status is SequenceStatus.FINISHED and not seq.block_table
            self.finished.append(seq.seq_id)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(pick=st.integers(0, 10**6))
    def abort_one(self, pick):
        live = [*self.sched.waiting, *self.sched.running]
        seq = live[pick % len(live)]
        self.sched.finish(seq)
        self.finished.append(seq.seq_id)

    @invariant()
    def accounting_is_consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants(self.sched.running)
        assert self.bm.num_used_blocks <= self.bm.num_blocks
        assert [s.seq_id for s in self.sched.waiting] == sorted(s.seq_id for s in self.sched.waiting)
        for s in self.sched.waiting:
            assert not s.block_table and s.num_computed_tokens == 0 and s.status is SequenceStatus.WAITING
        for s in self.sched.running:
            assert s.status is SequenceStatus.RUNNING
            assert s.parent is None or (s in s.parent.followers and not s.block_table)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for _ in range(10_000):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), "the scheduler stopped making progress"
        TALLY["requests"] += len(self.all)
        TALLY["lost requests"] += len(set(self.all) - set(self.finished))
        TALLY["duplicated results"] += len(self.finished) - len(set(self.finished))
        TALLY["leaked blocks"] += self.bm.num_blocks - self.bm.num_free_blocks
        TALLY["preemptions"] += self.sched.num_preemptions
        assert sorted(self.finished) == sorted(self.all), "a request was lost or finished twice"
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"
        for seq in self.all.values():
            if seq.finish_reason is not None:  # not aborted: its tokens are the fake model's, whatever happened
                expected = [fake_token(seq.seq_id, i) for i in range(seq.num_completion_tokens)]
                assert list(seq.completion_ids) == expected
                stop = seq.finish_reason == "stop"
                assert stop == (EOS in seq.eos_token_ids and seq.completion_ids[-1] == EOS)
                assert stop or seq.num_completion_tokens == seq.max_new_tokens


TestSchedulerMachine = SchedulerMachine.TestCase


@pytest.fixture(scope="module", autouse=True)
def print_tally():
    """After the module, one line of what the machine exercised, in pytest's terminal summary."""
    yield
    if TALLY:
        SUMMARY.append("scheduler state machine: " + ", ".join(f"{v} {k}" for k, v in sorted(TALLY.items())))


def test_preempting_a_parent_mid_prefill_sends_its_group_back_in_order_and_frees_every_block():
    """A GRPO group admitted together (one prefill, the others following it): preempting the parent while its shared
    prefill is still in chunks puts parent and followers back at the head of the queue in arrival order, detached,
    with every block free, and counts each preempted sequence."""
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_batch_tokens=4, max_num_seqs=4, enable_prefix_sharing=True)
    group = [Sequence(i, list(range(1, 11)), max_new_tokens=3, eos_token_ids=()) for i in range(3)]
    later = Sequence(3, [5, 6], max_new_tokens=2, eos_token_ids=())
    for seq in [*group, later]:
        sched.add(seq)
    batch = sched.schedule()
    parent = group[0]
    assert [s.seq_id for s, _ in batch.chunks] == [0] and parent.followers == group[1:], "not the state under test"
    sched.preempt(parent)
    assert [s.seq_id for s in sched.waiting] == [0, 1, 2, 3] and not sched.running
    assert all(s.parent is None and not s.followers and s.status is SequenceStatus.WAITING for s in group)
    assert all(s.num_computed_tokens == 0 for s in group), "a preempted sequence keeps no computed tokens"
    assert bm.num_free_blocks == 8 and sched.num_preemptions == 3
    bm.check_invariants(sched.running)


def test_the_block_invariant_checker_accepts_shared_blocks_and_catches_a_wrong_refcount():
    """The state machine's oracle must itself be able to fail: a prompt block shared by a group (refcount 2) is
    consistent; the same state with its refcount put at 1, or a used block also on the free list, is not."""
    bm = BlockManager(6, 4)
    parent = Sequence(0, list(range(1, 9)), max_new_tokens=2, eos_token_ids=())
    child = Sequence(1, list(range(1, 9)), max_new_tokens=2, eos_token_ids=())
    bm.allocate(parent, parent.num_tokens)
    bm.fork(parent, child)
    shared = parent.block_table[0]
    assert bm.ref_counts[shared] == 2
    bm.check_invariants([parent, child])
    bm.ref_counts[shared] = 1
    with pytest.raises(AssertionError, match="refcount != uses"):
        bm.check_invariants([parent, child])
    bm.ref_counts[shared] = 2
    bm.free_block_ids.append(shared)
    with pytest.raises(AssertionError, match="free/used mismatch"):
        bm.check_invariants([parent, child])


@given(block_size=st.integers(2, 5), filled=st.integers(1, 4), spare=st.integers(0, 2), num_new=st.integers(1, 9))
def test_append_cost_counts_new_blocks_and_the_copy_of_a_shared_partly_filled_block(
    block_size, filled, spare, num_new
):
    """Writing ``num_new`` tokens after ``computed`` needs ``blocks_for(computed + num_new) - len(table)`` new blocks
    (never fewer than 0, even with spare blocks already allocated) plus one copy when the partly filled block is
    shared; ``may_append`` takes exactly that many free blocks, also when no other block is free."""
    filled = min(filled, block_size - 1)  # the last computed block is partly filled
    computed = block_size + filled
    allocated = -(-(computed + spare * block_size) // block_size)
    new_blocks = max(0, -(-(computed + num_new) // block_size) - allocated)
    bm = BlockManager(allocated + new_blocks + 1, block_size)  # exactly the blocks the append needs are free
    parent = Sequence(0, list(range(1, computed + 1)), max_new_tokens=9, eos_token_ids=())
    bm.allocate(parent, computed + spare * block_size)  # spare: blocks beyond the computed tokens (a chunked input)
    child = Sequence(1, list(parent.token_ids), max_new_tokens=9, eos_token_ids=())
    bm.fork(parent, child)
    child.num_computed_tokens = computed
    assert bm.append_cost(child, num_new) == new_blocks + 1
    free = bm.num_free_blocks
    assert len(bm.may_append(child, num_new)) == 1 and bm.num_free_blocks == free - new_blocks - 1 == 0
    parent.num_computed_tokens = computed  # its partly filled block is its own again: one more token costs nothing
    assert bm.append_cost(parent, 1) == 0 and bm.may_append(parent, 1) == []
    bm.check_invariants([parent, child])


def test_the_scheduler_refuses_an_arrival_that_does_not_increase_the_ids_and_the_block_peak_is_counted():
    """Arrival order is the sequence id (FIFO and preemption order depend on it): an id equal to the last one queued is
    refused. The block manager's peak starts at 0 and follows the most blocks ever in use (the KV peak the benchmarks
    report)."""
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_batch_tokens=8, max_num_seqs=4, enable_prefix_sharing=False)
    sched.add(Sequence(3, [1, 2], max_new_tokens=1))
    with pytest.raises(ValueError, match="must increase"):
        sched.add(Sequence(3, [1, 2], max_new_tokens=1))
    assert bm.peak_used_blocks == 0
    first, second = Sequence(5, list(range(1, 10)), max_new_tokens=1), Sequence(6, [1], max_new_tokens=1)
    bm.allocate(first, 9)  # 3 blocks
    bm.allocate(second, 1)  # 4 in use
    bm.deallocate(first)
    assert bm.peak_used_blocks == 4 and bm.num_used_blocks == 1


def test_postprocess_refuses_a_token_or_log_prob_count_other_than_the_batchs_samples_and_changes_nothing():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_batch_tokens=8, max_num_seqs=4, enable_prefix_sharing=False)
    for i in range(2):
        sched.add(Sequence(i, [1, 2, 3], max_new_tokens=2, eos_token_ids=()))
    batch = sched.schedule()
    assert len(batch.samples) == 2, "not the state under test"
    for tokens, logprobs in (([4], [-0.1]), ([4], [-0.1, -0.2]), ([4, 5], [-0.1]), ([4, 5, 6], [-0.1, -0.2, -0.3])):
        with pytest.raises(ValueError, match=f"{len(tokens)} tokens, {len(logprobs)} log-probs for 2 samples"):
            sched.postprocess(batch, tokens, logprobs)
    assert all(s.num_completion_tokens == 0 for s in batch.samples)
    assert sched.postprocess(batch, [4, 5], [-0.1, -0.2]) == []
    assert [s.completion_ids for s in batch.samples] == [(4,), (5,)]


def test_a_sequence_is_named_after_its_id_unless_given_a_request_id_and_refuses_an_empty_or_endless_request():
    assert Sequence(7, [1], max_new_tokens=1).request_id == "7"
    assert Sequence(7, [1], max_new_tokens=1, request_id="r7").request_id == "r7"
    with pytest.raises(ValueError, match="sequence 3: empty prompt"):
        Sequence(3, [], max_new_tokens=1)
    with pytest.raises(ValueError, match="sequence 3: max_new_tokens must be >= 1, got 0"):
        Sequence(3, [1], max_new_tokens=0)
