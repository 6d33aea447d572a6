"""The C decode stack (engine/models/cpu_decode_stack.py) on the real SmolLM2 with
`--quantization gguf`: it serves decode steps of up to 8 rows (64 with float32 activations)
with tokens and logprobs bit-identical to the per-module path (batches that shrink as
sequences finish, i.e. a different row count from one step to the next), leaves every other
step to the modules, and follows the engine's KV caches when they move."""

from __future__ import annotations

import pytest
import torch

from decode_stack_helpers import assert_no_stack_without, generate, served_rows  # noqa: F401  (served_rows: a fixture)

from kvpilot.engine import LLM
from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.attention import AttentionMetadata
from kvpilot.kernels.cpu import attention as cpu_decode
from kvpilot.engine.models import cpu_decode_stack
from kvpilot.engine.models.cpu_decode_stack import DecodeStack
from kvpilot.engine.cpu.row_limits import ROW_LIMITS

MODEL = "smollm2-135m-instruct"
PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + 9 + 5 * i)) for i in range(18)]  # 9..94 tokens each


@pytest.fixture(scope="module")
def llm():
    # no prefix cache: the tests compare two generations of the same prompts bit for bit, and the
    # second would read the first's KV blocks and compute only the prompts' last partial block
    return LLM(MODEL, quantization="gguf", dtype="float32", max_model_len=512, max_num_seqs=24,
               num_gpu_blocks_override=160, swap_space=0, enable_prefix_caching=False)


@pytest.mark.slow
@pytest.mark.parametrize("num_prompts", [1, 3])
def test_small_decode_steps_run_in_one_call_with_bit_identical_tokens_and_logprobs(llm, served_rows, num_prompts):
    assert llm.engine.runner.model.decode_stack is not None, "gguf_quant did not attach the decode stack"
    prompts = PROMPTS[:num_prompts]
    want = generate(llm, prompts, stack=False)
    assert served_rows == []
    assert generate(llm, prompts, stack=True) == want
    # 3 prompts finishing after 3, 7 and 12 tokens: steps of 3, then 2, then 1 rows
    assert set(served_rows) == ({1} if num_prompts == 1 else {1, 2, 3})


@pytest.mark.slow
def test_more_rows_than_the_kernel_batch_take_the_modules_and_agree(llm, served_rows):
    # One thread: on a shared 2-core machine every OpenMP region with two threads waits for whichever
    # is descheduled, which took this test from 2 s to 20-45 s (the results are the same).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_more_rows_than_the_kernel_batch(llm, served_rows)
    finally:
        torch.set_num_threads(threads)


def check_more_rows_than_the_kernel_batch(llm, served_rows):
    # the blocks' row limit: 8 (vLLM's), 16 where the 8-bit matmuls run on AMX tiles
    limit = llm.engine.runner.model.decode_stack.max_rows
    assert limit == cpu_kernel_path.current().gguf_max_rows >= ROW_LIMITS.gguf_q8.rows
    prompts = PROMPTS[: limit + 2]  # limit + 2 decodes: the modules (dense matmuls) until `limit` remain
    want = generate(llm, prompts, stack=False, max_tokens=(3, 6))
    assert generate(llm, prompts, stack=True, max_tokens=(3, 6)) == want
    assert served_rows and max(served_rows) <= limit


@pytest.mark.slow
def test_attention_large_enough_for_threads_runs_on_threads_inside_the_stack(llm, served_rows, monkeypatch):
    # above PARALLEL_MIN_WORK a layer's attention takes torch's threads, one sequence included (the
    # kernel cuts long ones into parts), in the stack as in the modules; these prompts are shorter
    # than a part (128 tokens), so each row is still computed by one thread and outputs do not change
    monkeypatch.setattr(cpu_decode, "PARALLEL_MIN_WORK", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cpu_decode.attention_threads([5, 7], 3) == 2 and cpu_decode.attention_threads([5], 3) == 2
        want = generate(llm, PROMPTS[:2], stack=False, max_tokens=(4,))
        assert generate(llm, PROMPTS[:2], stack=True, max_tokens=(4,)) == want
        assert served_rows == [2, 2, 2]  # the stack served every decode step, on 2 attention threads
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_the_stack_follows_kv_caches_that_moved(llm, served_rows):
    runner = llm.engine.runner
    want = generate(llm, PROMPTS[1:3], stack=False)
    generate(llm, PROMPTS[:1], stack=True)  # the stack now points into the runner's caches
    old = runner.kv_caches
    runner.kv_caches = [(k.clone(), v.clone()) for k, v in old]  # new addresses, same contents
    try:
        served_rows.clear()
        assert generate(llm, PROMPTS[1:3], stack=True) == want  # stale pointers would miss the prompts' K/V
        assert served_rows
    finally:
        runner.kv_caches = old


@pytest.mark.slow
def test_kv_caches_the_stack_cannot_point_into_are_refused(llm):
    runner, stack = llm.engine.runner, llm.engine.runner.model.decode_stack
    with torch.inference_mode():
        meta = AttentionMetadata(torch.tensor([0]), torch.tensor([0, 1], dtype=torch.int32),
                                 torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                 1, [0, 1], [1], [1])
        for caches, what in (([(k.double(), v.double()) for k, v in runner.kv_caches], "layer 0's KV caches"),
                             ([(k[..., :32], v[..., :32]) for k, v in runner.kv_caches], "layer 0's KV caches"),
                             (runner.kv_caches[:-1], "KV cache pairs for 30 layers")):
            with pytest.raises(ValueError, match=what):
                stack.forward(torch.tensor([5]), torch.tensor([0]), caches, meta)


@pytest.mark.slow
def test_a_layer_without_gguf_blocks_gets_no_stack(llm):
    model = llm.engine.runner.model
    assert_no_stack_without(model, model.layers[3].mlp.down_proj, "qweight")


@pytest.mark.slow
def test_a_model_without_gguf_blocks_builds_no_library(llm, monkeypatch):
    # every CPU model goes through DecodeStack.build at start-up: a dense one (the float32 default on
    # AVX2 CPUs) must not compile or load the GGUF and glue libraries it can never use
    model = llm.engine.runner.model
    loads = []
    monkeypatch.setattr(cpu_decode_stack, "load", lambda dtype: loads.append(dtype))
    blocks = {i: model.layers[i].self_attn.qkv_proj.qweight for i in range(model.start_layer, model.end_layer)}
    try:
        for i in blocks:
            model.layers[i].self_attn.qkv_proj.qweight = None
        assert DecodeStack.build(model) is None and loads == []
    finally:
        for i, b in blocks.items():
            model.layers[i].self_attn.qkv_proj.qweight = b


@pytest.mark.slow
def test_the_environment_can_turn_the_stack_off(llm):
    model = llm.engine.runner.model
    path = model.kernel_path
    try:
        cpu_decode_stack.apply(model, cpu_kernel_path.choose(env={"KVPILOT_DECODE_STACK": "0"}))
        assert model.decode_stack is None
        cpu_decode_stack.apply(model, cpu_kernel_path.choose(env={"KVPILOT_CPU_KERNELS": "0"}))
        assert model.decode_stack is None and not model.layers[0].input_layernorm.use_c_kernel
        assert not model.layers[0].self_attn.backend.use_cpu_kernel
    finally:
        cpu_decode_stack.apply(model, path)
    assert model.decode_stack is not None and model.layers[0].input_layernorm.use_c_kernel


@pytest.mark.slow
def test_a_prefill_step_is_left_to_the_modules(llm):
    model = llm.engine.runner.model
    with torch.inference_mode():
        meta = AttentionMetadata(torch.arange(2), torch.tensor([0, 2], dtype=torch.int32),
                                 torch.tensor([2], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                 0, [0, 2], [2], [2])
        assert model.decode_stack.forward(torch.tensor([5, 6]), torch.arange(2), llm.engine.runner.kv_caches,
                                          meta) is None


@pytest.fixture(scope="module")
def llm_float32():
    with cpu_kernel_path.chosen(cpu_kernel_path.choose(gguf_activations="float32")):
        return LLM(MODEL, quantization="gguf", dtype="float32", max_model_len=512, max_num_seqs=16,
                   num_gpu_blocks_override=128, swap_space=0, enable_prefix_caching=False)


@pytest.mark.slow
def test_float32_activations_serve_more_rows_than_the_8_bit_batch_limit(llm_float32, served_rows):
    # float32 activations read the blocks up to ROW_LIMITS.gguf_float32 rows (the tiled kernel),
    # so the stack serves the 10-row steps that 8-bit activations leave to the modules
    stack = llm_float32.engine.runner.model.decode_stack
    assert stack is not None and stack.max_rows == ROW_LIMITS.gguf_float32.rows == 64 > ROW_LIMITS.gguf_q8.rows
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_more_rows_than_the_kernel_batch_take_the_modules_and_agree
    try:
        want = generate(llm_float32, PROMPTS[:10], stack=False, max_tokens=(3, 6))
        assert served_rows == []
        assert generate(llm_float32, PROMPTS[:10], stack=True, max_tokens=(3, 6)) == want
    finally:
        torch.set_num_threads(threads)
    assert max(served_rows) == 10 > ROW_LIMITS.gguf_q8.rows
