"""Once the model has loaded, the server moves every object then alive into the garbage
collector's permanent generation (vLLM's freeze_gc_heap), so the full collections of a
long-running server no longer walk the model's and engine's objects (~180 ms a collection,
a stall of every stream in flight, on the AVX2 EPYC)."""

from __future__ import annotations

import gc
import re

from kvpilot.engine.entrypoints.serve import freeze_gc_heap


class _Node:  # instances are always tracked by the collector (a dict of atoms may be untracked)
    pass


def test_freeze_moves_the_live_objects_out_of_collections():
    keep = [_Node() for _ in range(50_000)]  # alive across the freeze
    assert gc.is_tracked(keep[0])
    try:
        frozen = freeze_gc_heap()
        assert frozen >= len(keep)
        tracked = {id(o) for o in gc.get_objects()}  # what a full collection still walks
        assert not any(id(o) in tracked for o in keep[::1000])
        assert len(tracked) < frozen / 10
    finally:
        gc.unfreeze()
    assert id(keep[0]) in {id(o) for o in gc.get_objects()}


def test_the_server_freezes_its_heap_after_loading(server):
    match = re.search(r"froze (\d+) objects alive after loading", server.log())
    assert match, server.log()[-2000:]
    assert int(match.group(1)) > 100_000  # the model, tokenizer and engine, not an empty heap
