"""Block manager: allocation, prefix caching, LRU reuse, swap, fork; and a stateful
property test that any sequence of operations leaks nothing and never double-frees."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpilot.engine.core.block_manager import BlockManager
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.core.sequence import Sequence, SequenceStatus


def make_seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=100))


def compute(bm: BlockManager, seq: Sequence, n: int) -> bool:
    """Allocate n new tokens and mark them computed, as a scheduler step would."""
    if not bm.allocate_slots(seq, n):
        return False
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return True


def test_allocate_reports_failure_without_side_effects():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq("a", list(range(12)))
    assert compute(bm, a, 12)
    assert bm.num_free_blocks == 1
    b = make_seq("b", list(range(100, 108)))
    assert not bm.allocate_slots(b, 8)
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.check_invariants([a, b])


def test_prefix_cache_hit_shares_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prefix = list(range(8))
    a = make_seq("a", prefix + [50, 51, 52])
    assert compute(bm, a, a.num_tokens)
    b = make_seq("b", prefix + [60, 61])
    hit = bm.get_computed_blocks(b)
    assert hit == a.block_table[:2]
    assert bm.allocate_slots(b, b.num_tokens - 8, hit)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    # a prompt made only of cached full blocks still recomputes its last block
    c = make_seq("c", prefix)
    assert bm.get_computed_blocks(c) == a.block_table[:1]
    bm.check_invariants([a, b])


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq("a", [1, 2, 3, 4, 5])
    assert compute(bm, a, 5)
    a.status = SequenceStatus.FINISHED_STOPPED
    bm.release(a)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    # same prefix: the freed blocks come back from the free queue
    b = make_seq("b", [1, 2, 3, 4, 9])
    hit = bm.get_computed_blocks(b)
    assert len(hit) == 2
    assert bm.allocate_slots(b, 1, hit)
    assert bm.num_free_blocks == 1
    b.status = SequenceStatus.FINISHED_STOPPED
    bm.release(b)
    old_hashes = set(bm.cached)
    # a request needing every block evicts the cached ones
    c = make_seq("c", list(range(20, 28)))
    assert compute(bm, c, 8)
    assert not old_hashes & set(bm.cached)
    assert len(bm.cached) == 4  # c's own full blocks
    bm.check_invariants([c])


def test_swap_out_and_in_round_trip():
    bm = BlockManager(num_blocks=4, block_size=4, num_swap_blocks=3)
    a = make_seq("a", list(range(10)))
    assert compute(bm, a, 10)
    out = bm.swap_out(a)
    assert [d for d, _ in out] == [d for d, _ in out] and len(out) == 3
    assert bm.num_free_blocks == 4 and a.block_table == []
    assert bm.can_swap_in(a)
    back = bm.swap_in(a)
    assert [h for h, _ in back] == [h for _, h in out]
    assert len(a.block_table) == 3 and bm.num_free_blocks == 1
    bm.check_invariants([a])


def test_fork_copy_on_write_on_shared_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq("p", list(range(6)))
    assert compute(bm, parent, 6)
    child = make_seq("c", list(range(6)))
    bm.fork(parent, child)
    assert bm.blocks[parent.block_table[1]].ref_count == 2
    shared_last = parent.block_table[1]
    assert bm.allocate_slots(child, 1)
    assert child.block_table[1] != shared_last
    assert bm.pending_copies == [(shared_last, child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]
    bm.check_invariants([parent, child])


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq("a", [1, 2, 3])
    assert compute(bm, a, 3)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(a)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random interleavings of allocate, append, fork, free, swap with prefix caching."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=4, num_swap_blocks=6, enable_prefix_caching=True)
        self.live: dict[str, Sequence] = {}
        self.swapped: dict[str, Sequence] = {}
        self.n = 0

    def _new_id(self) -> str:
        self.n += 1
        return f"r{self.n}"

    @rule(prefix=st.integers(0, 2), extra=st.lists(st.integers(0, 5), min_size=1, max_size=9))
    def allocate(self, prefix, extra):
        seq = make_seq(self._new_id(), [7] * (4 * prefix) + extra)
        hit = self.bm.get_computed_blocks(seq)
        n = seq.num_tokens - len(hit) * 4
        if self.bm.allocate_slots(seq, n, hit):
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
            self.live[seq.request_id] = seq

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 6))
    def append(self, data, k):
        seq = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda s: s.request_id)))
        seq.output_token_ids.extend([3] * k)
        if not compute(self.bm, seq, k):
            del seq.output_token_ids[-k:]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda s: s.request_id)))
        child = make_seq(self._new_id(), parent.prompt_token_ids)
        child.output_token_ids = list(parent.output_token_ids)
        self.bm.fork(parent, child)
        self.live[child.request_id] = child
        self.bm.pending_copies.clear()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        seq.status = SequenceStatus.FINISHED_STOPPED
        self.bm.release(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if self.bm.can_swap_out(self.live[rid]):
            self.bm.swap_out(self.live[rid])
            self.swapped[rid] = self.live.pop(rid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.bm.can_swap_in(self.swapped[rid]):
            self.bm.swap_in(self.swapped[rid])
            self.live[rid] = self.swapped.pop(rid)

    @invariant()
    def ref_counts_match_tables(self):
        self.bm.check_invariants(list(self.live.values()))
        for seq in self.live.values():
            assert len(seq.block_table) == self.bm.blocks_needed(seq.num_computed_tokens)
        assert sum(len(t) for t in self.bm.swap_tables.values()) == sum(
            self.bm.blocks_needed(s.num_computed_tokens) for s in self.swapped.values()
        )

    def teardown(self):
        for seq in list(self.live.values()) + list(self.swapped.values()):
            seq.status = SequenceStatus.FINISHED_STOPPED
            self.bm.release(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert len(self.bm.free_swap_blocks) == self.bm.num_swap_blocks


TestBlockManagerProperties = BlockManagerMachine.TestCase
TestBlockManagerProperties.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_blocks_are_reported_fresh_exactly_once():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq("a", [1, 2, 3])
    assert compute(bm, a, 3)
    assert sorted(bm.fresh_blocks) == sorted(a.block_table)
    bm.fresh_blocks.clear()
    a.status = SequenceStatus.FINISHED_STOPPED
    bm.release(a)
    b = make_seq("b", [4, 5, 6, 7, 8, 9, 10])
    assert compute(bm, b, 7)
    assert len(bm.fresh_blocks) == 2  # two of b's four blocks were never used before
