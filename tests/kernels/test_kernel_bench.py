"""kernels/bench.py: its accounting, and its cases run end to end with a stand-in timer
(the real run needs a GPU)."""

import pytest
import torch

from kvpilot.kernels import bench


def test_byte_and_flop_accounting():
    shape = bench.Shape(num_heads=4, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float16)
    # decode: K+V of 10 + 6 tokens x 2 kv heads x 8 dims, plus q and out of 2 x 4 heads x 8.
    assert bench.decode_bytes(shape, [10, 6]) == (2 * 16 * 2 * 8 + 2 * 2 * 4 * 8) * 2
    # extend: one sequence, 3 cached + 2 new tokens: pairs 2*3 + (1 + 2) = 9.
    assert bench.attention_flops(shape, [5], [2]) == 4 * 9 * 4 * 8
    assert bench.extend_bytes(shape, [5], [2]) == (2 * 5 * 2 * 8 + 2 * 2 * 4 * 8) * 2
    assert bench.write_bytes(shape, 3) == 4 * 3 * 2 * 8 * 2


def test_cases_run_and_agree_with_the_reference_under_the_interpreter():
    shape = bench.Shape(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
    cases = [bench.decode_case(shape, [5, 40], "cpu"), bench.extend_case(shape, 2, 7, 9, "cpu"),
             bench.write_case(shape, 6, "cpu")]
    rows = bench.run_cases(cases, timer=lambda fn: (fn(), 0.5)[1], copy_bw=1e9)
    assert [r["kernel"] for r in rows] == ["decode", "extend", "cache_write"]
    for row in rows:
        assert row["rel_err"] < 1e-5
        assert row["us"] == 500.0 and row["speedup"] == 1.0
    table = bench.format_table(rows)
    assert "GB/s" in table and "2 seqs x (7 cached + 9 new)" in table


def test_main_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--quick"])
