"""`--quantization gguf` (engine/layers/gguf_quant.py): the GGUF's blocks describe exactly
the dense float32 weights, row by row, in every layer; greedy outputs stay HF's; and every
case the kernel cannot serve falls back to the dense weights with a log line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize
from test_hf_parity import check_logprobs_close, generate, hf_outputs  # noqa: F401 (a fixture)

from kvpilot.engine import LLM, EngineArgs
from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.distributed import parallel_state as ps
from kvpilot.engine.attention import get_attn_backend
from kvpilot.engine.layers import gguf_quant
from kvpilot.kernels.cpu import gguf as gguf_kernel
from kvpilot.engine.cpu.row_limits import ROW_LIMITS, gguf_max_rows
from kvpilot.engine.model_loader import builtin_gguf_path, iter_weights, load_model_config
from kvpilot.engine.models.llama import LlamaForCausalLM

MODEL = "smollm2-135m-instruct"


def load_quantized(model_path):
    """The real SmolLM2 (this rank's shard) with its dense weights loaded and the GGUF blocks attached."""
    cfg = load_model_config(Path(model_path), 1024, torch.float32)
    model = LlamaForCausalLM(cfg, get_attn_backend("torch"))
    model.load_weights(iter_weights(Path(model_path)))
    extra = gguf_quant.attach_gguf_blocks(model, builtin_gguf_path(MODEL))
    return model, extra


@pytest.fixture(scope="module")
def quantized_model(model_path):
    return load_quantized(model_path)


def assert_blocks_equal_dense_rows(model) -> dict[str, torch.nn.Module]:
    layers = quantized_layers(model)
    for name, module in layers.items():
        dense = dequantize(module.qweight.numpy(), module.qtype)  # gguf-py: d * q + m (Q4_1), d * q (Q8_0) in float32
        assert dense.shape == tuple(module.weight.shape), name
        unequal = (torch.from_numpy(dense) != module.weight).any(dim=1).nonzero().flatten().tolist()
        assert not unequal, f"{name}: rows {unequal[:8]} differ from the dense weight (Q/K row order?)"
    return layers


def quantized_layers(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if getattr(m, "qweight", None) is not None}


@pytest.mark.slow
def test_every_linear_layer_and_the_lm_head_keep_blocks_equal_to_the_dense_rows(quantized_model):
    model, extra = quantized_model
    layers = quantized_layers(model)
    cfg = model.config
    assert len(layers) == 4 * cfg.num_layers + 1  # qkv, o, gate_up, down per layer + the tied LM head
    assert extra == sum(m.qweight.numel() for m in layers.values())
    for name, module in layers.items():
        dense = dequantize(module.qweight.numpy(), module.qtype)  # gguf-py, as the converter dequantized
        assert dense.shape == tuple(module.weight.shape), name  # gguf-py: d * q + m (Q4_1), d * q (Q8_0) in float32
        unequal = (torch.from_numpy(dense) != module.weight).any(dim=1).nonzero().flatten().tolist()
        assert not unequal, f"{name}: rows {unequal[:8]} differ from the dense weight (Q/K row order?)"
    assert model.lm_head.qweight is not None and model.lm_head.qtype == gguf_kernel.Q8_0 and layers["layers.0.mlp.down_proj"].qtype == gguf_kernel.Q4_1


@pytest.mark.slow
def test_a_tensor_parallel_rank_keeps_the_blocks_of_its_own_shard(model_path):
    # tp=3 (SmolLM2's 3 KV heads), the middle rank: fused parts, input columns and the vocabulary all offset
    ps.set_tensor_parallel_group(None, 3, 1)
    try:
        model, _ = load_quantized(model_path)
    finally:
        ps.reset_model_parallel()
    layers = assert_blocks_equal_dense_rows(model)
    assert len(layers) == 4 * model.config.num_layers + 1
    assert layers["layers.0.self_attn.o_proj"].qweight.shape == (576, 576 // 3 // 32 * 20)


@pytest.mark.slow
@pytest.mark.parametrize("activations,tol", [("float32", 1e-4), ("q8_1", 2e-2)])  # q8_1: x rounded to 8 bits
@pytest.mark.parametrize("tokens", [1, 3, "max", "max + 1"])
def test_decode_sized_matmuls_read_the_blocks_and_agree_with_the_dense_weight(quantized_model, tokens, activations,
                                                                             tol, monkeypatch):
    # max: 8 rows with 8-bit activations (vLLM's MMVQ_MAX_BATCH_SIZE), 64 with float32 ones (the tiled path)
    limit = gguf_max_rows(activations)
    assert limit == (ROW_LIMITS.gguf_q8 if activations == "q8_1" else ROW_LIMITS.gguf_float32).rows
    tokens = {"max": limit, "max + 1": limit + 1}.get(tokens, tokens)
    model, _ = quantized_model
    calls = []
    monkeypatch.setattr("kvpilot.engine.layers.linear.gguf_matmul",
                        lambda *a, **k: calls.append((a[2], k["activations"])) or gguf_kernel.gguf_matmul(*a, **k))
    for name in ("layers.0.self_attn.qkv_proj", "layers.29.mlp.down_proj", "embed_tokens"):  # the tied LM head
        module = dict(model.named_modules())[name]
        assert module.qactivations == "q8_1"  # attach_gguf_blocks' default
        monkeypatch.setattr(module, "qactivations", activations)
        monkeypatch.setattr(module, "qmax_tokens", limit)  # set_qweight's default for the format
        x = torch.randn(tokens, module.weight.shape[1])
        got, want = module.matmul(x), F.linear(x, module.weight)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    q4, q8 = gguf_kernel.Q4_1, gguf_kernel.Q8_0
    assert calls == ([(q4, activations), (q4, activations), (q8, activations)] if tokens <= limit else [])


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["float32", "q8_1"])
def test_greedy_outputs_with_gguf_quantization_match_hf(chat_prompts, hf_outputs,  # noqa: F811
                                                        activations, monkeypatch, caplog):
    # vLLM's rule (tests/models/utils.py check_logprobs_close, as test_hf_parity.py applies it): per
    # prompt, tokens equal up to the first difference, where each run's token is in the other's top-5
    # logprobs; the comparison stops there. float32 activations must also keep the dense path's bar
    # of >= 6 prompts equal throughout; 8-bit ones (the default) may diverge earlier, by that rule only.
    path = cpu_kernel_path.choose(gguf_activations=activations)
    with caplog.at_level(logging.INFO, logger="kvpilot.engine.layers.gguf_quant"), cpu_kernel_path.chosen(path):
        llm = LLM(MODEL, quantization="gguf", dtype="float32", max_model_len=1024, max_num_seqs=8,
                  num_gpu_blocks_override=512, swap_space=0.05)
    assert ("(q8_1), integer dot products" if activations == "q8_1" else "float32 activations") in caplog.text
    layers = quantized_layers(llm.engine.runner.model)
    assert len(layers) == 4 * 30 + 1, "the engine did not attach the GGUF blocks"
    assert {m.qactivations for m in layers.values()} == {activations}
    ours = generate(llm, chat_prompts)  # 8 sequences decode together: every decode step runs the kernel
    full = check_logprobs_close(hf_outputs, ours)
    print(f"gguf, {activations} activations: {full}/{len(ours)} prompts equal HF's greedy tokens throughout")
    if activations == "float32":
        assert full >= 6  # test_hf_parity.py's rule for the dense weights


def test_a_bad_activation_format_is_refused_before_loading(monkeypatch):
    # the process's path is chosen at first use: forgotten here, so this engine's config reads the switch
    monkeypatch.setenv(cpu_kernel_path.GGUF_ACTIVATIONS_ENV, "int4")
    cpu_kernel_path.reset()
    try:
        with pytest.raises(ValueError, match="KVPILOT_GGUF_ACTIVATIONS='int4': use one of q8_1, float32"):
            EngineArgs(model=MODEL, quantization="gguf", dtype="float32", device="cpu").create_engine_config()
    finally:
        cpu_kernel_path.reset()


def test_quantization_needs_a_gguf_model(model_path):
    with pytest.raises(ValueError, match="needs a GGUF model"):
        EngineArgs(model=str(model_path), quantization="gguf", dtype="float32", device="cpu").create_engine_config()
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model=MODEL, quantization="awq", device="cpu").create_engine_config()


def test_no_kernel_float16_or_cuda_fall_back_to_the_dense_weights_with_a_log_line(monkeypatch, caplog):
    model = torch.nn.Linear(32, 8)
    gguf = str(builtin_gguf_path(MODEL))
    with caplog.at_level(logging.WARNING, logger="kvpilot.engine.layers.gguf_quant"):
        assert gguf_quant.maybe_quantize(model, "gguf", gguf, torch.device("cpu"), torch.float16) == 0
        assert gguf_quant.maybe_quantize(model, "gguf", gguf, torch.device("cuda"), torch.float32) == 0
        monkeypatch.setenv(cpu_kernel_path.KERNELS_ENV, "0")
        cpu_kernel_path.reset()
        try:
            assert gguf_quant.maybe_quantize(model, "gguf", gguf, torch.device("cpu"), torch.float32) == 0
        finally:
            monkeypatch.delenv(cpu_kernel_path.KERNELS_ENV)
            cpu_kernel_path.reset()
    assert "not float16" in caplog.text and "CPU only" in caplog.text and "the C kernels are off" in caplog.text
    assert gguf_quant.maybe_quantize(model, None, gguf, torch.device("cpu"), torch.float32) == 0
