"""KV-block residency for `--kv-cache-metrics`: how long a sampled block lived, how long it sat
unused before it was evicted, and the gaps between its reuses (prefix-cache hits).

A block is sampled (with probability `sample_rate`) when the pool hands it out; a prefix-cache
hit on it is an access; it is evicted when the pool hands it out again (its old content is
gone). Only the last 4 accesses are kept per block. The engine drains the events each step into
`vllm:kv_block_lifetime_seconds`, `vllm:kv_block_idle_before_evict_seconds` and
`vllm:kv_block_reuse_gap_seconds`. Cost without sampling: one dict lookup per hit.
Source: vLLM `vllm/v1/core/kv_cache_metrics.py` (`KVCacheMetricsCollector`), its calls in
`vllm/v1/core/block_pool.py` (`get_new_blocks`, `touch`)."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

HISTORY = 4  # accesses kept per block (vLLM's ring buffer)


@dataclass(frozen=True)
class EvictionEvent:
    """One sampled block's residency, seconds."""

    lifetime_s: float
    idle_s: float
    reuse_gaps_s: tuple[float, ...]


class _BlockState:
    __slots__ = ("born_ns", "last_ns", "accesses")

    def __init__(self, now_ns: int) -> None:
        self.born_ns = self.last_ns = now_ns
        self.accesses: deque[int] = deque(maxlen=HISTORY)


class KVCacheResidency:
    """Residency of a sampled share of KV blocks. Raises ValueError unless 0 < sample_rate <= 1.
    `rng` and `clock_ns` are for tests."""

    def __init__(self, sample_rate: float = 0.01, rng: random.Random | None = None,
                 clock_ns=time.monotonic_ns) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1.0], got {sample_rate}")
        self.sample_rate = sample_rate
        self._random = (rng or random.Random()).random
        self._clock_ns = clock_ns
        self.blocks: dict[int, _BlockState] = {}
        self._events: list[EvictionEvent] = []

    def on_allocated(self, block_id: int, evicted: bool = True) -> None:
        """The pool handed the block out: its previous tenancy (if sampled) ends, recorded when
        `evicted` (vLLM records evictions with prefix caching on only), and a new one may be sampled."""
        now = self._clock_ns()
        state = self.blocks.pop(block_id, None)
        if state is not None and evicted:
            gaps = [(b - a) / 1e9 for a, b in zip(state.accesses, list(state.accesses)[1:])]
            self._events.append(EvictionEvent((now - state.born_ns) / 1e9, (now - state.last_ns) / 1e9, tuple(gaps)))
        if self._random() < self.sample_rate:
            self.blocks[block_id] = _BlockState(now)

    def on_accessed(self, block_id: int) -> None:
        """A prefix-cache hit took the block."""
        state = self.blocks.get(block_id)
        if state is not None:
            state.last_ns = now = self._clock_ns()
            state.accesses.append(now)

    def drain(self) -> list[EvictionEvent]:
        """The events since the last drain."""
        events, self._events = self._events, []
        return events
