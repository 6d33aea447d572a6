"""A CPU KV pool on zero pages (engine/cpu/zero_pages.py): zero everywhere without being written,
resident only where written, and the model runner no longer zeroes its blocks at first use."""
from __future__ import annotations

import os

import pytest
import torch

from kvpilot.engine.cpu.zero_pages import zeroed


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_pool_reads_zero_and_becomes_resident_only_where_written():
    before = rss_bytes()
    pool = zeroed((4096, 16, 3, 64), torch.bfloat16)  # 768 MiB
    assert pool.shape == (4096, 16, 3, 64) and pool.dtype == torch.bfloat16 and pool.data_ptr() % 4096 == 0
    assert rss_bytes() - before < 64 << 20  # nothing written: nothing resident
    pool[7] = 1.5
    assert pool[7].float().mean().item() == 1.5
    assert pool[6].abs().sum().item() == 0 and pool[4095].abs().sum().item() == 0
    assert rss_bytes() - before < 64 << 20


def test_an_empty_shape_is_refused():
    with pytest.raises(ValueError, match="empty shape"):
        zeroed((0, 16), torch.float32)


def test_a_cpu_engine_serves_from_zero_pages_without_zeroing_blocks(tmp_path, monkeypatch):
    from kvpilot.engine import SamplingParams
    from tests.engine.tiny_llama import save_tiny_llama, tiny_llm, tiny_prompts

    llm = tiny_llm(save_tiny_llama(tmp_path / "tiny", num_layers=2))
    try:
        runner = llm.engine.runner
        assert runner._zero_fresh_blocks is False
        fills = []
        monkeypatch.setattr(torch.Tensor, "index_fill_", lambda self, *a: fills.append(a) or self)
        outs = llm.generate(tiny_prompts(), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs) and fills == []
        k, v = runner.kv_caches[0]
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
        assert k[-1].abs().sum().item() == 0  # 32 blocks, at most 9 handed out (from block 0 on): still zero
    finally:
        llm.engine.close()
