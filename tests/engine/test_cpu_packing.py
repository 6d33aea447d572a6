"""oneDNN weight prepacking on CPU (bfloat16 and float32): packed layers compute what
F.linear computes, float32 packed copies replace the plain weights (the embedding keeps
its own for the lookup), and the engine's greedy tokens do not change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.worker import model_runner
from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    pack_weights_for_cpu,
)


# oneDNN's bf16 kernels need avx512bw/vl/dq or avx_ne_convert; on an AVX2-only CPU the reorder
# refuses and the engine keeps the plain path (and `--dtype auto` is float32 there).
needs_onednn_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                       reason="this CPU has no oneDNN bf16 support (AVX2 only)")


def _layers(dtype):
    col = ColumnParallelLinear(64, [96, 32], dtype)
    row = RowParallelLinear(96, 64, dtype)
    emb = VocabParallelEmbedding(500, 64, dtype)
    for layer in (col, row, emb):
        layer.weight.data.copy_(torch.randn_like(layer.weight, dtype=torch.float32).to(dtype))
    return torch.nn.ModuleList([col, row, emb])


@needs_onednn_bf16
def test_packed_bf16_layers_match_f_linear():
    layers = _layers(torch.bfloat16)
    plain = {id(m): m.weight.detach().clone() for m in layers}
    extra = pack_weights_for_cpu(layers)
    if layers[0].packed is None:
        pytest.fail("oneDNN bf16 linear is unavailable on this CPU/torch build: the fast path is not tested")
    col, row, emb = layers
    # with the AVX512_BF16 kernel (where the kernel path takes it) the linear layers (128 and 64 outputs) also
    # get its copy, which replaces their plain weight; the 500-row embedding is no multiple of 64
    kernel = cpu_kernel_path.current().bf16_gemm
    assert (col.bf16_packed is not None) == (row.bf16_packed is not None) == kernel
    assert emb.bf16_packed is None
    assert extra == sum(w.numel() * 2 for w in plain.values()) + kernel * (128 * 64 + 64 * 96) * 2
    if kernel:
        assert col.weight.numel() == 0 and row.weight.numel() == 0
    for x, layer in ((torch.randn(5, 64), col), (torch.randn(1, 96), row), (torch.randn(130, 96), row)):
        x = x.to(torch.bfloat16)
        torch.testing.assert_close(layer(x), F.linear(x, plain[id(layer)]), rtol=1.6e-2, atol=1e-2)
    hidden = torch.randn(7, 64).to(torch.bfloat16)
    torch.testing.assert_close(emb.logits(hidden), F.linear(hidden, emb.weight).float(), rtol=1.6e-2, atol=1e-2)
    ids = torch.tensor([0, 499, 17])
    assert torch.equal(emb(ids), emb.weight[ids])  # the lookup still reads the plain weight
    assert pack_weights_for_cpu(layers) == 0  # idempotent


def test_packed_float32_layers_match_f_linear_and_replace_the_plain_weights():
    layers = _layers(torch.float32)
    col, row, emb = layers
    plain = {id(m): m.weight.detach().clone() for m in layers}
    extra = pack_weights_for_cpu(layers)
    if col.packed is None:
        pytest.fail("oneDNN float32 linear is unavailable on this torch build: the fast path is not tested")
    assert extra == sum(w.numel() * 4 for w in plain.values())  # the packed copies' bytes
    for x, layer in ((torch.randn(5, 64), col), (torch.randn(1, 96), row), (torch.randn(130, 96), row),
                     (torch.randn(2, 3, 96), row)):
        torch.testing.assert_close(layer(x), F.linear(x, plain[id(layer)]), rtol=1e-5, atol=1e-4)
    assert col.weight.numel() == 0 and row.weight.numel() == 0  # replaced by the packed copy
    with pytest.raises(RuntimeError):
        F.linear(torch.randn(1, 64), col.weight)  # a stray use fails loudly instead of reading zeros
    hidden = torch.randn(7, 64)
    torch.testing.assert_close(emb.logits(hidden), F.linear(hidden, plain[id(emb)]), rtol=1e-5, atol=1e-4)
    ids = torch.tensor([0, 499, 17])
    assert torch.equal(emb(ids), plain[id(emb)][ids])  # the embedding keeps its plain weight for the lookup
    assert pack_weights_for_cpu(layers) == 0  # idempotent


def test_engine_greedy_tokens_and_logprobs_with_packed_float32_weights(monkeypatch):
    prompts = ["The three primary colors are", "def fibonacci(n):", "Paris is the capital of"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    packed = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=256, quantization="none")
    assert packed.engine.runner.packed_weights_bytes > 0
    want = packed.generate(prompts, params)
    packed.engine.close()
    monkeypatch.setattr(model_runner, "pack_weights_for_cpu", lambda model: 0)
    plain = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=256, quantization="none")
    got = plain.generate(prompts, params)
    plain.engine.close()
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in la.items():
                assert abs(lp - lb[tok]) < 1e-3


@needs_onednn_bf16
def test_engine_greedy_tokens_agree_with_and_without_packing_as_vllm_checks_bf16(monkeypatch):
    # bf16 outputs depend on the matmul's summation order (oneDNN's packed kernels, F.linear and
    # kernels/cpu/bf16_gemm.py's kernel each have their own), so, as vLLM's check_logprobs_close does
    # for bf16, the two runs must agree token for token until they first differ, and there each
    # side's token must be among the other side's top logprobs (a near tie), not elsewhere.
    prompts = ["The three primary colors are", "def fibonacci(n):", "Paris is the capital of"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    packed = LLM("smollm2-135m-instruct", dtype="bfloat16", max_model_len=256, quantization="none")
    assert packed.engine.runner.packed_weights_bytes > 0
    want = [o.outputs[0] for o in packed.generate(prompts, params)]
    packed.engine.close()
    monkeypatch.setattr(model_runner, "pack_weights_for_cpu", lambda model: 0)
    plain = LLM("smollm2-135m-instruct", dtype="bfloat16", max_model_len=256, quantization="none")
    assert plain.engine.runner.packed_weights_bytes == 0
    got = [o.outputs[0] for o in plain.generate(prompts, params)]
    plain.engine.close()
    agreeing = 0
    for a, b in zip(want, got):
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                assert ta in b.logprobs[pos] and tb in a.logprobs[pos], (pos, ta, tb)
                break
            agreeing += 1
    assert agreeing >= 16  # most of the 48 tokens agree: a broken kernel diverges at once
