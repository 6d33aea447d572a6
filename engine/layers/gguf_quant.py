"""`--quantization gguf` on CPU: every linear layer and the LM head keep the GGUF's raw
Q4_1 / Q8_0 blocks beside their dense float32 weight; decode-sized matmuls (at most
the kernel path's `gguf_max_rows`: 8, 16 on AMX tiles, 64 with float32 activations; see
engine/cpu/row_limits.py) read the blocks through the C kernel (kvpilot.kernels.cpu.gguf), larger
ones (prefill) the dense weight. The kernel quantizes the activations to 8-bit blocks first
(vLLM's GGUF path always does for small batches) unless the path's `gguf_activations` is float32
(KVPILOT_GGUF_ACTIVATIONS=float32, engine/cpu/kernel_path.py) and keeps them exact;
`maybe_quantize` logs which at start-up.

The dense weights still come from the safetensors the loader converted from the same GGUF
(dequantized by gguf-py: d * q + m for Q4_1, d * q for Q8_0, in float32), so the blocks
and the dense rows describe the same numbers; tests/engine/test_gguf_quant.py checks them
row by row. llama.cpp's converter permutes the Q and K rows for its RoPE layout and
transformers undoes that on load (`_reverse_permute_weights`): the blocks get the same row
permutation here, since a GGUF block never spans two rows.
Source: vLLM `vllm/model_executor/layers/quantization/gguf.py` (GGUFLinearMethod: the
quantized matmul for batches up to 8 tokens, MMVQ_MAX_BATCH_SIZE, dequantize otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.distributed import parallel_state as ps
from kvpilot.engine.config import ModelConfig
from kvpilot.kernels.cpu.gguf import BLOCK_BYTES, BLOCK_WEIGHTS

logger = logging.getLogger("kvpilot.engine.layers.gguf_quant")

# GGUF tensor (in block N) -> (our module under layers.N, index of the fused part or None)
_LAYER_TENSORS = {
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1), "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1), "ffn_down": ("mlp.down_proj", None),
}


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the quantized path cannot run here (the dense weights serve instead), or None."""
    if device.type != "cpu":
        return f"the GGUF kernel runs on CPU only, not {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the GGUF kernel takes float32 or bfloat16 activations, not {str(dtype).removeprefix('torch.')}"
    path = cpu_kernel_path.current()
    if not path.kernels:
        return f"the C kernels are off ({path.reason})"
    return None


def unpermute_rows(blocks: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation on [rows, ...] (rows = n_head * 2 * half),
    as transformers' `_reverse_permute_weights` does on the dequantized weight."""
    half = blocks.shape[0] // n_head // 2
    return blocks.reshape(n_head, half, 2, *blocks.shape[1:]).swapaxes(1, 2).reshape(blocks.shape)


def read_gguf_blocks(path: Path, cfg: ModelConfig) -> Iterator[tuple[str, int, np.ndarray]]:
    """Yields (GGUF tensor name, GGML type number, blocks [rows, row bytes] uint8 in the
    dense weight's row order) for every Q4_1 / Q8_0 tensor of the GGUF file (memory-mapped).
    Other types (F32 norms, unsupported quantizations) are skipped."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    for tensor in reader.tensors:
        qtype = int(tensor.tensor_type)
        if qtype not in BLOCK_BYTES:
            continue
        blocks = np.asarray(tensor.data)
        kind = tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else ""
        if kind == "attn_q":
            blocks = unpermute_rows(blocks, cfg.num_heads)
        elif kind == "attn_k":
            blocks = unpermute_rows(blocks, cfg.num_kv_heads)
        yield tensor.name, qtype, blocks


def _shard_rows(blocks: np.ndarray, shard: int, rank: int) -> np.ndarray:
    part = blocks[rank * shard : (rank + 1) * shard]
    if part.shape[0] < shard:  # the last vocabulary shard: rows of zero blocks give logits 0
        part = np.concatenate([part, np.zeros((shard - part.shape[0], blocks.shape[1]), np.uint8)])
    return part


def _shard_columns(blocks: np.ndarray, qtype: int, in_shard: int, rank: int) -> np.ndarray | None:
    if in_shard % BLOCK_WEIGHTS:
        return None
    per = in_shard // BLOCK_WEIGHTS * BLOCK_BYTES[qtype]
    return blocks[:, rank * per : (rank + 1) * per]


def _targets(model: nn.Module, name: str) -> list[tuple[nn.Module, int | None]]:
    """The modules a GGUF tensor quantizes on this stage, with the fused part index."""
    if name in ("token_embd.weight", "output.weight"):
        head = getattr(model, "lm_head", None)
        tied = getattr(model.config, "tie_word_embeddings", False)
        wanted = "token_embd.weight" if tied else "output.weight"
        return [(head, None)] if head is not None and name == wanted else []
    parts = name.split(".")
    if parts[0] != "blk" or parts[2] not in _LAYER_TENSORS:
        return []
    layer = int(parts[1])
    if not model.start_layer <= layer < model.end_layer:
        return []
    module, index = _LAYER_TENSORS[parts[2]]
    return [(model.layers[layer].get_submodule(module), index)]


def attach_gguf_blocks(model: nn.Module, gguf_path: Path, activations: str = "q8_1",
                       max_tokens: int | None = None, amx: bool = False) -> int:
    """Gives each linear layer of `model` (this stage, this rank's shard) and its LM head
    the GGUF's blocks (`qweight` [rows, row bytes] uint8, `qtype`), read with
    `activations` ("q8_1" or "float32", kernels/cpu/gguf.ACTIVATIONS) by matmuls of up to
    `max_tokens` rows (default: the format's limit without AMX, cpu_row_limits.gguf_max_rows),
    in the AMX tiles' layout where `amx` (8-bit activations only; kernels/cpu/gguf.amx_pack, same
    bytes), and returns their bytes.
    A fused layer (qkv, gate_up) is quantized only when all its parts share one type; a
    layer whose input shard is not a whole number of blocks keeps the dense path."""
    from kvpilot.engine.layers.linear import ColumnParallelLinear, RowParallelLinear

    tp, rank = ps.get_tp_size(), ps.get_tp_rank()
    fused: dict[nn.Module, dict[int, tuple[int, np.ndarray]]] = {}
    for name, qtype, blocks in read_gguf_blocks(gguf_path, model.config):
        for module, index in _targets(model, name):
            if isinstance(module, ColumnParallelLinear):
                fused.setdefault(module, {})[index] = (qtype, _shard_rows(blocks, module.shard_sizes[index], rank))
            elif isinstance(module, RowParallelLinear):
                part = _shard_columns(blocks, qtype, module.in_shard, rank)
                if part is not None:
                    module.set_qweight(qtype, part, activations, max_tokens, amx)
            else:  # the LM head (VocabParallelEmbedding)
                module.set_qweight(qtype, _shard_rows(blocks, module.shard, rank) if tp > 1 else blocks, activations,
                                  max_tokens, amx)
    for module, parts in fused.items():
        types = {qtype for qtype, _ in parts.values()}
        if len(parts) == len(module.output_sizes) and len(types) == 1:
            module.set_qweight(types.pop(), np.concatenate([parts[i][1] for i in range(len(parts))]), activations,
                              max_tokens, amx)
    return sum(m.qweight.numel() for m in model.modules() if getattr(m, "qweight", None) is not None)


def maybe_quantize(model: nn.Module, quantization: str | None, gguf_path: str | None,
                   device: torch.device, dtype: torch.dtype) -> int:
    """Attaches the GGUF blocks when `quantization` is 'gguf' and the kernel can run here, read
    as the kernel path says (cpu_kernel_path.current(): activation format, row limit, AMX layout);
    otherwise logs why the dense weights serve. Returns the bytes attached."""
    if quantization != "gguf":
        return 0
    reason = unavailable_reason(device, dtype)
    if reason is not None or gguf_path is None:
        logger.warning("--quantization gguf: %s; using the dense weights", reason or "no GGUF file")
        return 0
    path = cpu_kernel_path.current()
    activations = path.gguf_activations
    extra = attach_gguf_blocks(model, Path(gguf_path), activations, path.gguf_max_rows, amx=path.gguf_amx)
    switch = cpu_kernel_path.GGUF_ACTIVATIONS_ENV
    how = ("activations quantized to 8-bit blocks (q8_1), integer dot products; "
           f"{switch}=float32 keeps them exact" if activations == "q8_1" else f"float32 activations ({switch}=float32)")
    logger.info("--quantization gguf: %.1f MiB of GGUF blocks serve matmuls of up to %d tokens, %s",
                extra / 2**20, path.gguf_max_rows, how)
    return extra
