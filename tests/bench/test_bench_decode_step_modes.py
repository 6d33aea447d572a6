"""`kvpilot bench decode-step --cpu-kernel onednn,bf16-gemm`, the comparison benchmarks/README.md
shows: both engines load in one process, the `onednn` one with no bf16 kernel copy and no bf16
decode stack, the `bf16-gemm` one with the kernel (its AVX512_BF16 or AMX build where the CPU has
one, else the same layout in plain C) and the stack, and each reports a step time per batch size."""
from __future__ import annotations

import json

import pytest

from kvpilot.bench import decode_step


@pytest.mark.slow
def test_decode_step_compares_onednn_with_the_bf16_kernel_and_stack(tmp_path, monkeypatch):
    built = {}
    engine_in_mode = decode_step._engine_in_mode

    def spy(model, dtype, mode, *args):
        llm = engine_in_mode(model, dtype, mode, *args)
        built[mode] = llm.engine.runner.model
        return llm

    monkeypatch.setattr(decode_step, "_engine_in_mode", spy)
    out = tmp_path / "ds.json"
    assert decode_step.main(["--dtypes", "bfloat16", "--cpu-kernel", "onednn,bf16-gemm", "--batch-sizes", "1,2",
                             "--prompt-len", "16", "--steps", "2", "--rounds", "1", "--threads", "2",
                             "--output-json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"bfloat16/onednn", "bfloat16/bf16-gemm"}
    for per_batch in results.values():
        assert set(per_batch) == {"1", "2"} and all(r["step_wall_ms"] > 0 for r in per_batch.values())
    onednn, kernel = built["onednn"], built["bf16-gemm"]
    assert onednn.decode_stack is None
    assert not any(getattr(m, "bf16_packed", None) is not None for m in onednn.modules())
    assert kernel.decode_stack is not None and kernel.decode_stack.max_rows == 32
