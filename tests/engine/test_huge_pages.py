"""engine/cpu/huge_pages.py: the CPU KV caches start on 2 MiB boundaries with huge pages advised."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpilot.engine.cpu.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages, empty_huge

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed THP mode (always, madvise, never), or None without THP."""
    if not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_kb(start: int, end: int) -> int:
    """AnonHugePages (kB) of the mappings overlapping [start, end) in /proc/self/smaps."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_empty_huge_is_aligned_contiguous_and_writable():
    t = empty_huge((37, 16, 3, 64), torch.bfloat16)
    assert t.shape == (37, 16, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    t.fill_(1.5)
    assert float(t.float().sum()) == 1.5 * t.numel()


def test_small_tensors_get_no_advice():
    assert advise_huge_pages(torch.empty(1000)) == 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="the kernel offers no transparent huge pages")
def test_advised_memory_is_backed_by_huge_pages_once_touched():
    """Where THP is `madvise` (or `always`), the advised cache is faulted in 2 MiB pages: a 4 KiB-page
    mapping would show no AnonHugePages however much of it is touched."""
    n = 8 * HUGE_PAGE_BYTES
    t = empty_huge((n // 2,), torch.bfloat16)
    assert advise_huge_pages(t) == n
    t.zero_()
    assert _anon_huge_kb(t.data_ptr(), t.data_ptr() + n) >= 4 * HUGE_PAGE_BYTES // 1024


def test_engine_kv_caches_start_on_huge_page_boundaries():
    from kvpilot.engine import LLM

    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", quantization="none", max_model_len=256,
              num_gpu_blocks_override=64, swap_space=0)
    caches = llm.engine.runner.kv_caches
    assert caches and all(k.data_ptr() % HUGE_PAGE_BYTES == 0 and v.data_ptr() % HUGE_PAGE_BYTES == 0
                          for k, v in caches)
