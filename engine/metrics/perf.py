"""Estimated floating-point operations and memory traffic of one engine step, per device, for
the MFU counters (`vllm:estimated_flops_per_gpu_total`, `..._read_bytes_...`, `..._write_bytes_...`,
counting with `--enable-mfu-metrics`).

vLLM's analytic model for a dense Llama (attention with grouped KV heads, a SwiGLU FFN, the LM
head), term by term:
- attention: QKV and output projections (2 x T x D x (q + 2 kv) x d, 2 x T x D x q x d per
  layer) and scores/values (2 x q x sum(tokens x context) x d each); reads the projection
  weights, the inputs and, for decodes, the K and V of the context from the KV cache; writes
  the projections and the new tokens' K and V;
- FFN: 2 x D x 3 x I x T per layer; reads the up/gate/down weights and activations;
- LM head: 2 x (logit tokens) x D x V, where a prefill needs one logit token and a decode one
  per token; reads its weight once.
Per device: layers divided by the pipeline size (the FFN's by integer division, as in vLLM),
heads and the FFN's inner size by the tensor-parallel size. Bytes per element: the model's
dtype for activations, the KV cache and the weights; a GGUF model's quantized weights count 0.5
bytes (vLLM counts its 4-bit methods so; it has no GGUF entry) except the LM head's.
Source: vLLM `vllm/v1/metrics/perf.py` (`AttentionMetrics`, `FfnMetrics`, `UnembedMetrics`,
`ModelMetrics.get_step_perf_stats_per_gpu`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvpilot.engine.config import EngineConfig

QUANTIZED_WEIGHT_BYTES = {"gguf": 0.5}

Batch = Iterable[tuple[int, int, bool]]  # (num_tokens, context_len, is_prefill) per scheduled request


@dataclass(frozen=True)
class StepPerf:
    """One step's estimate, per device: FLOPs, bytes read, bytes written."""

    flops: int
    read_bytes: int
    write_bytes: int


def _dtype_bytes(dtype: torch.dtype | str) -> int:
    dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    return torch.empty((), dtype=dtype).element_size()


class PerfEstimator:
    """The per-device estimate of a step of `config`'s model (a dense decoder: Llama's shape)."""

    def __init__(self, config: EngineConfig) -> None:
        m, p = config.model, config.parallel
        self.D, self.V, self.I = m.hidden_size, m.vocab_size, m.intermediate_size
        self.d, self.L = m.head_dim, m.num_layers
        self.q = max(1, m.num_heads // p.tensor_parallel_size)
        self.kv = max(1, m.num_kv_heads // p.tensor_parallel_size)
        self.tp, self.pp = p.tensor_parallel_size, p.pipeline_parallel_size
        self.act = self.cache = _dtype_bytes(m.dtype)
        self.weight = QUANTIZED_WEIGHT_BYTES.get(config.quantization or "", self.act)

    def step(self, batch: Batch) -> StepPerf:
        """The estimate for one step's scheduled requests."""
        t_pre = t_dec = ctx_pre = ctx_dec = tc = n_pre = 0
        for num_tokens, context_len, is_prefill in batch:
            tc += num_tokens * context_len
            if is_prefill:
                n_pre, t_pre, ctx_pre = n_pre + 1, t_pre + num_tokens, ctx_pre + context_len
            else:
                t_dec, ctx_dec = t_dec + num_tokens, ctx_dec + context_len
        T, logits = t_pre + t_dec, n_pre + t_dec
        if not T:
            return StepPerf(0, 0, 0)
        D, q, kv, d, V = self.D, self.q, self.kv, self.d, self.V // self.tp
        L, Ld, DI = self.L / self.pp, self.L // self.pp, self.I // self.tp
        act, cache, w = self.act, self.cache, self.weight
        flops = (int(2 * T * D * (q + 2 * kv) * d * L) + int(2 * T * D * q * d * L) + 2 * int(2 * q * tc * d * L)
                 + (2 * D * 3 * DI * T * Ld if Ld else 0) + 2 * logits * D * V)
        attn_in = 0.0
        if t_pre:
            attn_in += (t_pre * q + 2 * ctx_pre * kv) * d * act * L
        if t_dec:
            attn_in += t_dec * q * d * act * L + 2 * ctx_dec * kv * d * cache * L
        read = (int(T * D * act * L) + int(D * (q + 2 * kv) * d * w * L) + int(attn_in) + int(T * q * d * act * L)
                + int(q * d * D * w * L) + logits * D * act + D * V * act)
        if Ld:
            read += (int(T * D * act * Ld) + int(2 * D * DI * w * Ld) + int(2 * T * DI * act * Ld)
                     + int(T * DI * act * Ld) + int(D * DI * w * Ld))
        write = (int(T * (q + 2 * kv) * d * act * L) + int(2 * T * kv * d * cache * L) + int(T * D * act * L)
                 + logits * V * act)
        if Ld:
            write += int(2 * T * DI * act * Ld) + int(T * DI * act * Ld) + int(T * D * act * Ld)
        return StepPerf(flops, read, write)
