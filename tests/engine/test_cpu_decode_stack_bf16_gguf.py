"""The bfloat16 decode stack with `--quantization gguf` (the default for the builtin GGUF on CPU):
steps of up to `gguf_max_rows` rows read each layer's GGUF blocks (bf16 rows widened to
float32, the GGUF kernel, results rounded back to bf16), larger ones the bf16 kernel's packed
copies, in the one C call (kernels/cpu/csrc/decode_stack.c, `matmul_bf16`), with tokens and
logprobs bit-identical to the module path (engine/layers/linear.py reads the same blocks for the
same row counts). Loaded with the bf16 kernel up to its own limit and the blocks up to 4 rows
whatever the CPU, so the glue is checked on every CPU the suite runs on."""

from __future__ import annotations

import pytest
import torch

from decode_stack_helpers import generate, served_rows  # noqa: F401  (served_rows: a fixture)

from kvpilot.engine import LLM
from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.cpu.row_limits import ROW_LIMITS
from kvpilot.engine.models import cpu_decode_stack

MODEL = "smollm2-135m-instruct"
PROMPTS = [list(range(500 + 13 * i, 500 + 13 * i + 7 + 3 * i)) for i in range(6)]  # 7..22 tokens each
QROWS = 4
ROWS = ROW_LIMITS.bf16_kernel.rows  # the bf16 kernel's limit without AMX (32)


def _path():
    return cpu_kernel_path.choose(bf16_gemm_max_rows=ROWS, gguf_max_rows=QROWS)


@pytest.fixture(scope="module")
def llm():
    with cpu_kernel_path.chosen(_path()):
        # no prefix cache: generations of the same prompts are compared bit for bit
        yield LLM(MODEL, dtype="bfloat16", max_model_len=256, max_num_seqs=16, num_gpu_blocks_override=64,
                  swap_space=0, enable_prefix_caching=False)


@pytest.mark.slow
def test_the_default_bf16_engine_keeps_the_blocks_for_small_steps(llm):
    model = llm.engine.runner.model
    assert llm.engine.config.quantization == "gguf"
    stack = model.decode_stack
    assert stack is not None and stack.dtype == torch.bfloat16
    assert stack.max_rows == ROWS and stack.md.qmax_rows == QROWS
    o_proj = model.layers[0].self_attn.o_proj
    assert o_proj.qweight is not None and o_proj.qmax_tokens == QROWS and o_proj.bf16_packed is not None


@pytest.mark.slow
def test_steps_on_the_blocks_and_on_the_bf16_kernel_are_bit_identical_to_the_modules(llm, served_rows):
    # 6 prompts finishing after 3, 6, 3, 6, ...: steps of 6 rows (packed bf16), then 3 (blocks)
    want = generate(llm, PROMPTS, stack=False, max_tokens=(3, 6))
    assert served_rows == []
    assert generate(llm, PROMPTS, stack=True, max_tokens=(3, 6)) == want
    assert set(served_rows) == {6, 3}


@pytest.mark.slow
def test_the_stack_really_reads_the_blocks(llm, monkeypatch):
    # with the stack's block limit at 0 its one-row steps take the packed bf16 weights instead: other
    # numbers than the modules' (which read the blocks), so the logprobs part
    want = generate(llm, PROMPTS[:1], stack=False, max_tokens=(8,))
    monkeypatch.setattr(llm.engine.runner.model.decode_stack.md, "qmax_rows", 0)
    assert generate(llm, PROMPTS[:1], stack=True, max_tokens=(8,)) != want


@pytest.mark.slow
def test_the_start_up_log_says_small_steps_read_the_blocks(llm, caplog):
    caplog.set_level("INFO", logger="kvpilot.engine.cpu.kernel_path")
    cpu_decode_stack.apply(llm.engine.runner.model, _path())
    assert (f"bfloat16 decode steps run the C decode stack (all layers in one call, up to "
            f"{ROWS} rows; matmuls of up to {QROWS} rows read the GGUF blocks)") in caplog.text
