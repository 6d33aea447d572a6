"""Parallel-aware linear and embedding layers (Megatron-LM style, as in vLLM).

ColumnParallelLinear splits the output features over the tensor-parallel ranks (no
communication); RowParallelLinear splits the input features and all-reduces the partial
sums. With one rank both are plain linear layers. `load_full` takes the full (unsharded)
checkpoint weight and keeps this rank's shard, so checkpoints never need resharding.
On CPU, `pack_weights_for_cpu` reorders each weight once into oneDNN's blocked layout
(as PyTorch Inductor's weight prepacking does when freezing), which saves the per-call
reorder: in bfloat16 about 1.4-1.6x faster matmuls at decode batch sizes (AMX machine);
in float32 on an AVX2-only EPYC 1.3-1.8x over F.linear's MKL sgemm at 1-64 rows for the
model's 30 layers and LM head (section 8 of the throughput notebook, `git show bbe6366:benchmarks/results/throughput/README.md`).
Source: Shoeybi et al., Megatron-LM (2019); vLLM `vllm/model_executor/layers/linear.py`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.distributed import parallel_state as ps
from kvpilot.engine.cpu.row_limits import gguf_max_rows
from kvpilot.kernels.cpu import bf16_gemm
from kvpilot.kernels.cpu.gguf import amx_pack as gguf_amx_pack
from kvpilot.kernels.cpu.gguf import gguf_matmul

_PACK_BATCH_HINT = 128  # oneDNN picks the blocked layout for about this many rows


class _Linear(nn.Module):
    """Holds `weight` [out, in] and, once packed, its oneDNN copy `packed` (and in bf16, where
    kernels/cpu/bf16_gemm.py's kernel runs, its copy `bf16_packed` for decode-sized matmuls); with
    `--quantization gguf`, also the GGUF blocks `qweight` [out, in / 32 * block bytes]
    uint8 of type `qtype` and the kernel's activation format `qactivations`
    (layers/gguf_quant.py)."""

    packed: torch.Tensor | None = None
    bf16_packed: torch.Tensor | None = None
    packed_out_features: int = 0  # rows of the weight bf16_packed was packed from
    bf16_max_rows: int = 0  # matmuls of up to this many rows read bf16_packed (the kernel path's limit)
    qweight: torch.Tensor | None = None
    qtype: int = 0
    qactivations: str = "q8_1"
    qmax_tokens: int = 0  # matmuls of up to this many rows read qweight

    def set_qweight(self, qtype: int, blocks, activations: str = "q8_1", max_tokens: int | None = None,
                    amx: bool = False) -> None:
        """Keeps GGUF blocks (a [rows, row bytes] uint8 array whose rows match `weight`'s),
        read with `activations` "q8_1" (8-bit) or "float32" (kvpilot.kernels.cpu.gguf.ACTIVATIONS)
        by matmuls of up to `max_tokens` rows (default: cpu_row_limits.gguf_max_rows of `activations`); with
        `amx` (8-bit activations, rows a multiple of 16), in gguf.amx_pack's layout for AMX tiles."""
        self.qweight = torch.from_numpy(np.array(blocks, dtype=np.uint8, order="C", copy=True))
        self.qtype = qtype
        if amx and activations == "q8_1" and self.qweight.shape[0] % 16 == 0:
            self.qweight, self.qtype = gguf_amx_pack(self.qweight, qtype)
        self.qactivations = activations
        self.qmax_tokens = gguf_max_rows(activations) if max_tokens is None else max_tokens

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x weight^T [..., out], same dtype. With GGUF blocks, bf16 rows are widened to
        float32 (exact) for the kernel and its float32 results rounded back (nearest even)."""
        if (self.qweight is not None and x.dim() == 2 and x.shape[0] <= self.qmax_tokens
                and x.dtype in (torch.float32, torch.bfloat16) and x.stride(1) == 1):
            y = gguf_matmul(x.float(), self.qweight, self.qtype, self.qweight.shape[0], activations=self.qactivations)
            return y.to(x.dtype)
        if (self.bf16_packed is not None and x.dim() == 2 and x.shape[0] <= self.bf16_max_rows
                and x.dtype == torch.bfloat16 and x.stride(1) == 1):
            return bf16_gemm.matmul(x, self.bf16_packed, self.packed_out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


_PACK_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}  # relative, of the packed matmul vs F.linear


def pack_weights_for_cpu(model: nn.Module) -> int:
    """Packs every linear weight of `model` (CPU, bfloat16 or float32) for oneDNN and
    returns the bytes the packed copies take. A layer is packed only if the packed
    matmul reproduces F.linear on a random input (bf16 within 2e-2, fp32 within 1e-4 of
    the output's scale), so a CPU or build without the op keeps the plain path.

    In bfloat16, where the engine's kernel path takes the AVX512_BF16 kernel of
    kernels/cpu/bf16_gemm.py (engine/cpu/kernel_path.py), every layer (the
    LM head too) also gets that kernel's copy (checked the same way), which serves matmuls of
    up to the path's `bf16_gemm_max_rows` rows (by CPU kind, engine/cpu/row_limits.py).

    In float32, and in bfloat16 once the kernel's copy exists, the plain weight of a linear
    layer is dropped (an empty tensor: nothing reads it again, and a stray F.linear on it
    fails loudly), so the packed copies replace it; an embedding keeps its plain weight for
    the lookup and packs a copy for the (tied) LM head (two with the bf16 kernel). Otherwise in
    bfloat16 plain and packed copies stay. Either way a bfloat16 linear layer holds two copies
    (tuner/search/feasibility.py counts them twice, and an embedding thrice with the kernel)."""
    extra = 0
    for module in model.modules():
        if not isinstance(module, _Linear) or module.packed is not None:
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype not in _PACK_TOLERANCE:
            continue
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_BATCH_HINT)
            x = torch.randn(3, w.shape[1], dtype=w.dtype)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        except (RuntimeError, AttributeError):
            return extra
        want = F.linear(x, w)
        tol = _PACK_TOLERANCE[w.dtype]
        if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item()):
            return extra
        module.packed = packed
        extra += packed.numel() * packed.element_size()
        vocab = isinstance(module, VocabParallelEmbedding)
        if _pack_bf16_gemm(module, x, want, tol):
            extra += module.bf16_packed.numel() * module.bf16_packed.element_size()
        if (w.dtype == torch.float32 or module.bf16_packed is not None) and not vocab:
            module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
    return extra


def _pack_bf16_gemm(module: _Linear, x: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Gives a bf16 layer kernels/cpu/bf16_gemm.py's packed copy where the kernel path takes it and its
    product of x matches `want` (F.linear's) within tol of want's scale."""
    w = module.weight
    rows = cpu_kernel_path.current().bf16_gemm_max_rows
    if not (bf16_gemm.supports(w) and rows > 0):
        return False
    packed = bf16_gemm.pack(w.detach())
    got = bf16_gemm.matmul(x, packed, w.shape[0])
    if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item()):
        return False
    module.bf16_packed, module.packed_out_features, module.bf16_max_rows = packed, w.shape[0], rows
    return True


def _shard(size: int, what: str) -> int:
    tp = ps.get_tp_size()
    if size % tp:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size {tp}")
    return size // tp


class ColumnParallelLinear(_Linear):
    """y = x W^T with W's rows (output features) split over ranks; `output_sizes` lists the
    fused sub-matrices (e.g. q, k, v) so each is sharded separately.

    x: [num_tokens, in_features] -> [num_tokens, sum(output_sizes) / tp]
    """

    def __init__(self, in_features: int, output_sizes: list[int], dtype: torch.dtype) -> None:
        super().__init__()
        self.output_sizes = list(output_sizes)
        self.shard_sizes = [_shard(s, "output features") for s in output_sizes]
        self.weight = nn.Parameter(
            torch.empty(sum(self.shard_sizes), in_features, dtype=dtype), requires_grad=False
        )

    def load_full(self, index: int, weight: torch.Tensor) -> None:
        """Copies this rank's shard of fused part `index` from the full weight
        [output_sizes[index], in_features]."""
        size = self.shard_sizes[index]
        start = ps.get_tp_rank() * size
        offset = sum(self.shard_sizes[:index])
        self.weight.data[offset : offset + size].copy_(weight[start : start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, sum(output_sizes) / tp], x's dtype; no
        communication."""
        return self.matmul(x)


class RowParallelLinear(_Linear):
    """y = all_reduce(x_shard W_shard^T): W's columns (input features) split over ranks.

    x: [num_tokens, in_features / tp] -> [num_tokens, out_features]
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_shard = _shard(in_features, "input features")
        self.weight = nn.Parameter(
            torch.empty(out_features, self.in_shard, dtype=dtype), requires_grad=False
        )

    def load_full(self, weight: torch.Tensor) -> None:
        """Copies this rank's input-feature columns from the full weight [out_features, in_features]."""
        start = ps.get_tp_rank() * self.in_shard
        self.weight.data.copy_(weight[:, start : start + self.in_shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features / tp] -> [num_tokens, out_features], the partial products
        summed over the tensor-parallel ranks (all-reduce)."""
        return ps.tp_all_reduce(self.matmul(x))


class VocabParallelEmbedding(_Linear):
    """Embedding with the vocabulary split over ranks; tokens outside this rank's range
    look up zeros and the all-reduce fills them in. Also serves as the (tied) LM head:
    `logits` gives [num_tokens, vocab_size] gathered over ranks.

    ids: [num_tokens] int64 -> [num_tokens, hidden_size]
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        tp = ps.get_tp_size()
        self.shard = -(-vocab_size // tp)
        self.start = ps.get_tp_rank() * self.shard
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden_size, dtype=dtype), requires_grad=False)

    def load_full(self, weight: torch.Tensor) -> None:
        """Copies this rank's vocabulary rows [start, start + shard) from the full weight
        [vocab_size, hidden_size]; rows past vocab_size (the last shard's padding) stay zero."""
        part = weight[self.start : self.start + self.shard]
        self.weight.data[: part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [num_tokens] int64 -> [num_tokens, hidden_size], the weight's dtype; ids outside
        this rank's shard look up zeros and the all-reduce fills them in."""
        if ps.get_tp_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return ps.tp_all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden_size] -> [n, vocab_size] float32."""
        local = self.matmul(hidden).float()
        return ps.tp_all_gather_last_dim(local)[:, : self.vocab_size]
