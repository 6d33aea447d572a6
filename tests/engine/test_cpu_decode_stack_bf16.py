"""The C decode stack in bfloat16 (engine/models/cpu_decode_stack.py over kernels/cpu/csrc/decode_stack.c built with -DKVP_BF16) on the
real SmolLM2: it serves decode steps of up to the linear layers' row limit with tokens and
logprobs bit-identical to the per-module path (the same bf16 matmul, norm, activation and fused
attention functions in the same order), leaves larger and prefill steps to the modules, is not
built where a layer lacks the bf16 kernel's packed copy, and the start-up log says which path
decode steps take.

The engine uses the bf16 matmul kernel only on CPUs with AVX512_BF16, up to 32 rows without AMX,
64 where it runs on AMX tiles and 8 on an AMX CPU whose tiles it cannot use
(engine/cpu/row_limits.py). These tests load the engine with the kernel's limit without AMX (32)
whatever the CPU; where it has no AVX512_BF16 the same library builds the same packed layout in
plain C and that build serves (both paths call it), so the stack's glue is checked on every CPU
the suite runs on.
"""

from __future__ import annotations

import pytest
import torch

from decode_stack_helpers import assert_no_stack_without, generate, served_rows  # noqa: F401  (served_rows: a fixture)

from kvpilot.engine import LLM
from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.cpu.row_limits import ROW_LIMITS
from kvpilot.engine.models import cpu_decode_stack

ROWS = ROW_LIMITS.bf16_kernel.rows  # the kernel's limit without AMX (32)

MODEL = "smollm2-135m-instruct"
PROMPTS = [list(range(300 + 11 * i, 300 + 11 * i + 6 + 4 * i)) for i in range(6)]  # 6..26 tokens each


@pytest.fixture(scope="module")
def llm():
    # the kernel path with the bf16 matmul kernel on whatever the CPU: its AVX512_BF16 build where
    # the CPU has one (AMX CPUs too), else the plain-C loop of the same layout
    with cpu_kernel_path.chosen(cpu_kernel_path.choose(bf16_gemm_max_rows=ROWS)):
        # dense weights: the bf16 kernel's packed copies serve every step (test_cpu_decode_stack_bf16_gguf.py
        # covers the default, which reads the GGUF's blocks for the smallest steps)
        # no prefix cache: generations of the same prompts are compared bit for bit
        yield LLM(MODEL, dtype="bfloat16", max_model_len=256, max_num_seqs=16, num_gpu_blocks_override=64,
                  swap_space=0, quantization="none", enable_prefix_caching=False)


@pytest.mark.slow
def test_bf16_decode_steps_run_in_one_call_with_bit_identical_tokens_and_logprobs(llm, served_rows):
    stack = llm.engine.runner.model.decode_stack
    assert stack is not None and stack.dtype == torch.bfloat16, "the model runner attached no bf16 decode stack"
    assert stack.max_rows == ROWS
    want = generate(llm, PROMPTS[:3], stack=False)
    assert served_rows == []
    assert generate(llm, PROMPTS[:3], stack=True) == want
    # 3 prompts finishing after 3, 7 and 12 tokens: steps of 3, then 2, then 1 rows
    assert set(served_rows) == {1, 2, 3}


@pytest.mark.slow
def test_steps_above_the_bf16_kernel_row_limit_take_the_modules_and_agree(llm, served_rows):
    # a lower limit stands in for the CPU kind's (8 with AMX, 32 without; each linear layer keeps it
    # as bf16_max_rows, the stack, built again, as max_rows): above it both paths run oneDNN's matmuls
    model = llm.engine.runner.model
    try:
        with pytest.MonkeyPatch.context() as mp:
            for module in model.modules():
                if getattr(module, "bf16_packed", None) is not None:
                    mp.setattr(module, "bf16_max_rows", 4)
            cpu_decode_stack.apply(model, model.kernel_path)
            assert model.decode_stack.max_rows == 4
            want = generate(llm, PROMPTS, stack=False, max_tokens=(3, 6))
            assert generate(llm, PROMPTS, stack=True, max_tokens=(3, 6)) == want
    finally:
        cpu_decode_stack.apply(model, model.kernel_path)
    assert model.decode_stack.max_rows == ROWS
    # 6 decodes go to the modules; once the three 3-token prompts finish, 3 rows go to the stack
    assert served_rows and set(served_rows) == {3}


@pytest.mark.slow
def test_a_layer_without_the_packed_copy_gets_no_bf16_stack(llm):
    model = llm.engine.runner.model
    assert_no_stack_without(model, model.layers[5].self_attn.o_proj, "bf16_packed")


@pytest.mark.slow
def test_the_start_up_log_says_which_path_decode_steps_take(llm, caplog, monkeypatch):
    model = llm.engine.runner.model
    caplog.set_level("INFO", logger="kvpilot.engine.cpu.kernel_path")
    path = model.kernel_path
    try:
        cpu_decode_stack.apply(model, cpu_kernel_path.choose(env={"KVPILOT_DECODE_STACK": "0"}))
        assert model.decode_stack is None
        assert "bfloat16 decode steps run layer by layer with the C kernels" in caplog.text
        assert "KVPILOT_DECODE_STACK=0" in caplog.text
        cpu_decode_stack.apply(model, path)
        assert model.decode_stack is not None
        assert f"bfloat16 decode steps run the C decode stack (all layers in one call, up to {ROWS} rows)" in caplog.text
        assert f"runs the {path.variant} kernel build" in caplog.text
    finally:
        cpu_decode_stack.apply(model, path)
