"""Paged KV-cache block manager: fixed-size blocks with reference counts, prefix caching by
chained block hashes, LRU reuse of freed cached blocks, and a host swap space.

Token ranges of one sequence's allocation (block_size = 4):

    block_table:  [ b7 ][ b2 ][ b9 ]
    tokens:        0..3  4..7  8..9 (+2 free slots)
                   |<- num_computed_tokens ->|<- scheduled this step ->|

Full blocks get a content hash chained with the previous block's hash, so equal prefixes
map to equal hash chains (vLLM automatic prefix caching). A freed block keeps its hash and
goes to the free queue; a later request with the same prefix takes it back out, and only
when the queue has to hand out a block is the oldest one evicted (LRU).

The free queue is an OrderedDict: O(1) removal from the middle (a cache hit on a free
block) and O(1) pop from the head, which is why vLLM hand-writes a linked list.

The manager asks before it acts: `allocate_slots` returns False and changes nothing when
blocks run out, so the scheduler can preempt and retry.
Source: vLLM v1 `KVCacheManager` / `BlockPool`; nano-vllm `BlockManager`.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpilot.engine.core.kv_cache_residency import KVCacheResidency
from kvpilot.engine.core.sequence import Sequence


class KVBlock:
    """One block of the device KV pool: its id, how many sequences reference it, and the
    prefix hash of its tokens once full and cached (None while partial or uncached)."""

    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None


def hash_block(parent_hash: int | None, token_ids: list[int]) -> int:
    """Chained hash of one full block: equal only for equal prefixes (up to collisions of
    Python's 64-bit tuple hash, which is deterministic for ints)."""
    return hash((parent_hash, tuple(token_ids)))


class BlockManager:
    """Owns the device block pool and the host swap pool.

    Per sequence it keeps `seq.block_table` (device blocks), a host table while swapped,
    and the content hashes of its full blocks when prefix caching is on.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_swap_blocks: int = 0,
        enable_prefix_caching: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_swap_blocks = num_swap_blocks
        self.free_swap_blocks = list(range(num_swap_blocks - 1, -1, -1))
        self.swap_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks
        self._num_registered: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst)
        # Blocks handed out for the first time since the pool was allocated: their memory
        # is uninitialised (it may hold NaN bit patterns), so the runner zeroes them before
        # the step. Keeping every block finite lets attention mask padded slots by score
        # alone (a zero weight times a finite value is zero).
        self._ever_used = [False] * num_blocks
        self.fresh_blocks: list[int] = []
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.residency: KVCacheResidency | None = None  # --kv-cache-metrics (kv_cache_residency.py)

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Device blocks with no reference (cached-but-free ones included; they are evictable)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of device blocks in use (vllm:kv_cache_usage_perc, 0 to 1)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------- prefix cache
    def _block_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the sequence's full blocks, extended as it grows."""
        hashes = self._hashes.setdefault(seq.request_id, [])
        num_full = seq.num_tokens // self.block_size
        bs = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, seq.token_ids_range(i * bs, (i + 1) * bs)))
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Longest run of cached full blocks that prefixes the sequence, leaving at least
        its last token to compute (the step must produce logits); none for a sequence that
        skips reading the cache (prompt logprobs). Takes no references: pass the result to
        `allocate_slots`."""
        if not self.enable_prefix_caching or seq.block_table or seq.skip_reading_prefix_cache:
            return []
        hashes = self._block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in hashes[:max_blocks]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted request's lookup (vllm:prefix_cache_queries / _hits)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_query_tokens
            self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers the sequence's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        done = self._num_registered.get(seq.request_id, 0)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= done:
            return
        hashes = self._block_hashes(seq)
        for i in range(done, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                self.cached[hashes[i]] = block.block_id
        self._num_registered[seq.request_id] = num_full

    # --------------------------------------------------------------- allocation
    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if not self._ever_used[block_id]:
            self._ever_used[block_id] = True
            self.fresh_blocks.append(block_id)
        if block.block_hash is not None:  # evict from the prefix cache
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        if self.residency is not None:
            self.residency.on_allocated(block_id, evicted=self.enable_prefix_caching)
        return block_id

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1
        if self.residency is not None:
            self.residency.on_accessed(block_id)

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Makes room for `num_new_tokens` more tokens after the computed ones. With
        `computed_blocks` (a prefix-cache hit, at admission) the sequence takes references
        on them and its num_computed_tokens/num_cached_tokens are set to cover them.
        Returns False, changing nothing, when not enough free blocks remain."""
        computed_blocks = computed_blocks or []
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        total_blocks = len(seq.block_table) + len(computed_blocks)
        needed = self.blocks_needed(num_computed + num_new_tokens) - total_blocks
        cow = self._needs_copy_on_write(seq, num_computed) if not computed_blocks else False
        hits_in_free = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if max(needed, 0) + int(cow) > self.num_free_blocks - hits_in_free:
            return False
        for block_id in computed_blocks:
            self._touch(block_id)
        if computed_blocks:
            seq.block_table.extend(computed_blocks)
            seq.num_computed_tokens = num_computed
            seq.num_cached_tokens = num_computed
        if cow:
            src = seq.block_table[-1]
            dst = self._pop_free()
            self.blocks[src].ref_count -= 1
            seq.block_table[-1] = dst
            self.pending_copies.append((src, dst))
        for _ in range(max(needed, 0)):
            seq.block_table.append(self._pop_free())
        return True

    def _needs_copy_on_write(self, seq: Sequence, num_computed: int) -> bool:
        """A forked sequence that is about to write into a shared, partly filled block
        must get its own copy first."""
        if not seq.block_table or num_computed % self.block_size == 0:
            return False
        last = num_computed // self.block_size
        return last < len(seq.block_table) and self.blocks[seq.block_table[last]].ref_count > 1

    def free(self, seq: Sequence) -> None:
        """Drops the sequence's references. Blocks reaching zero go to the free queue:
        uncached ones at the head (reused first), cached ones at the tail in reverse order,
        so a sequence's last blocks are evicted before its first (vLLM's policy)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed twice (request {seq.request_id})")
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        self._num_registered.pop(seq.request_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's blocks (copy-on-write on the next write)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    # --------------------------------------------------------------------- swap
    def can_swap_out(self, seq: Sequence) -> bool:
        """True when the host swap pool has a free block for each of the sequence's device blocks."""
        return len(seq.block_table) <= len(self.free_swap_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Moves the sequence's blocks to host swap blocks. Returns (device, host) pairs to
        copy before any device block is reused. Raises RuntimeError without room."""
        if not self.can_swap_out(seq):
            raise RuntimeError(f"no swap space for request {seq.request_id}")
        host = [self.free_swap_blocks.pop() for _ in seq.block_table]
        mapping = list(zip(seq.block_table, host))
        self.swap_tables[seq.request_id] = host
        self.free(seq)
        return mapping

    def can_swap_in(self, seq: Sequence) -> bool:
        """True when the device pool has a free block for each of the sequence's host swap blocks."""
        return len(self.swap_tables.get(seq.request_id, ())) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Brings a swapped sequence back. Returns (host, device) pairs to copy."""
        host = self.swap_tables.pop(seq.request_id)
        if len(host) > self.num_free_blocks:
            self.swap_tables[seq.request_id] = host
            raise RuntimeError(f"not enough free blocks to swap in request {seq.request_id}")
        seq.block_table = [self._pop_free() for _ in host]
        self.free_swap_blocks.extend(reversed(host))
        return list(zip(host, seq.block_table))

    def _free_swap(self, seq: Sequence) -> None:
        host = self.swap_tables.pop(seq.request_id, None)
        if host:
            self.free_swap_blocks.extend(reversed(host))

    def release(self, seq: Sequence) -> None:
        """Forgets a finished or aborted sequence: device blocks, swap blocks, hashes."""
        self.free(seq)
        self._hashes.pop(seq.request_id, None)
        self._free_swap(seq)

    def check_invariants(self, live: list[Sequence]) -> None:
        """Raises AssertionError if ref counts disagree with the live sequences' tables
        or a block is both free and referenced (used by tests)."""
        expected = [0] * self.num_blocks
        for seq in live:
            for b in seq.block_table:
                expected[b] += 1
        for block in self.blocks:
            assert block.ref_count == expected[block.block_id], (block.block_id, block.ref_count)
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), block.block_id
        for h, b in self.cached.items():
            assert self.blocks[b].block_hash == h
        used_swap = sum(len(t) for t in self.swap_tables.values())
        assert used_swap + len(self.free_swap_blocks) == self.num_swap_blocks
        assert len(set(self.free_swap_blocks)) == len(self.free_swap_blocks)
