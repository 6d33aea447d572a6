"""`kvpilot bench decode-step --cpu-kernel ...`: every mode is a kernel path (engine/cpu/kernel_path.py)
the engine loads with. The comparison benchmarks/README.md shows, `--cpu-kernel onednn,bf16-gemm`:
both engines load in one process, the `onednn` one with no bf16 kernel copy and no bf16 decode
stack, the `bf16-gemm` one with the kernel (its AVX512_BF16 or AMX build where the CPU has one,
else the same layout in plain C) and the stack, and each reports a step time per batch size."""
from __future__ import annotations

import json

import pytest

from kvpilot.bench import decode_step
from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.cpu.row_limits import ROW_LIMITS
from kvpilot.kernels.cpu import bf16_gemm


def test_every_cpu_kernel_mode_is_a_kernel_path():
    assert set(decode_step._MODES) == set(decode_step._MODE_LABEL)
    paths = {mode: cpu_kernel_path.choose(**decode_step._mode_overrides(mode)) for mode in decode_step._MODES}
    default = cpu_kernel_path.choose()
    assert paths["on"] == default
    unfused, off = paths["unfused"], paths["off"]
    assert unfused.c_attention and not (unfused.fused_rope_cache or unfused.c_norm_act or unfused.decode_stack)
    assert not (off.c_attention or off.fused_rope_cache or off.c_norm_act or off.decode_stack)
    assert off.gguf_max_rows == default.gguf_max_rows and off.bf16_gemm_max_rows == default.bf16_gemm_max_rows
    # the kernel's own limit on this CPU: on AMX tiles where it runs there, else without them
    tiles = ROW_LIMITS.bf16_kernel_amx_tiles if bf16_gemm.amx() else ROW_LIMITS.bf16_kernel
    assert paths["bf16-gemm"].bf16_gemm_max_rows == tiles.rows
    assert paths["onednn"].bf16_gemm_max_rows == 0 and "bf16_gemm_max_rows=0" in paths["onednn"].reason


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
    assert onednn.decode_stack is None and onednn.kernel_path.bf16_gemm_max_rows == 0
    assert not any(getattr(m, "bf16_packed", None) is not None for m in onednn.modules())
    assert kernel.decode_stack is not None
    assert kernel.decode_stack.max_rows == decode_step._mode_overrides("bf16-gemm")["bf16_gemm_max_rows"]
