"""One C call for all decoder layers of a small decode-only step on CPU: the float32
`--quantization gguf` path and the bfloat16 path where the bf16 matmul kernel serves (the C
glue: kernels/cpu/csrc/decode_stack.c, its library and structs: kernels/cpu/decode_stack.py).

Why: at batch 1 a SmolLM2 decode step is 121 GGUF matmuls of ~60 us each, and the Python
around them (module calls, wrapper checks, tensor allocations, ctypes argument
conversion: 8 kernel calls per layer) took about as long again; between two matmuls that
stream weights through the caches the interpreter's own state is cold, so each Python
operation costs more than it does in a micro-benchmark. In bf16 on a Zen 4 EPYC the same
Python took ~7 ms of a ~39 ms 16-row step. `DecodeStack` validates every layer's weights and
caches once, keeps their pointers in C structs, and runs a step's layers with one ctypes call
that calls the same C functions the modules call (the GGUF or bf16 matmul, the fused
RoPE/KV-write/attention, RMSNorm, SiLU*mul) in the same order on the same buffers' contents,
so its outputs are bit-identical to the module path.

A model gets a stack only where the module path runs those same kernels: the kernel path
(`apply` below, the one place a model's modules are set from engine/cpu/kernel_path.py's choice)
has the decode stack, the C attention with its fused RoPE/K/V write, and the C norm and activation
on (KVPILOT_DECODE_STACK=0 turns the stack off); tensor and pipeline parallel size 1; the torch
attention backend; and either float32 with every layer's four linear layers quantized, at most as
many rows as the layers' matmuls read the blocks for (the path's `gguf_max_rows`: 8 with 8-bit
activations, 64 with float32 ones), or bfloat16 with every layer's linear layers packed for the
bf16 kernel, at most their `bf16_max_rows` rows (the path's limit for this CPU kind,
engine/cpu/row_limits.py); with `--quantization gguf` (the default for a GGUF model) the bf16
stack's matmuls of up to the layers' `qmax_tokens` rows read their GGUF blocks instead, as the
modules do (decode_stack.c `matmul_bf16`). The weights are checked once, in `build`; the step's
tensors once, where the model runner prepares them (model_runner.check_step_layout); the KV
caches when they change. A step then serves where its rows are all decodes and at most
`max_rows`; any other step returns None and the modules run.
Its attention takes as many threads as the module path's (`cpu_decode.attention_threads`),
from the same OpenMP team. Source: the per-layer order of models/llama.py (vLLM's residual
stream); llama.cpp's ggml graph, which likewise runs a whole decode step without returning to
the host language.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.cpu.kernel_path import CpuKernelPath
from kvpilot.kernels.cpu import attention as cpu_decode
from kvpilot.kernels.cpu import gguf
from kvpilot.kernels.cpu.decode_stack import Layer as _Layer
from kvpilot.kernels.cpu.decode_stack import Model as _Model
from kvpilot.kernels.cpu.decode_stack import QLinear as _QLinear
from kvpilot.kernels.cpu.decode_stack import gguf_kernel
from kvpilot.kernels.cpu.decode_stack import kernels as _kernels
from kvpilot.kernels.cpu.decode_stack import load
from kvpilot.kernels.cpu.loader import kernel_range

logger = logging.getLogger("kvpilot.engine.cpu.kernel_path")  # the path's one start-up line


def _blocks_ok(module, n: int, k: int) -> bool:
    """Whether the layer holds GGUF blocks for [n, k] the kernel reads."""
    w = getattr(module, "qweight", None)
    return not (w is None or module.qtype not in gguf.BLOCK_BYTES or w.dtype != torch.uint8 or not w.is_contiguous()
                or tuple(w.shape) != (n, k // gguf.BLOCK_WEIGHTS * gguf.BLOCK_BYTES[module.qtype])
                or k % gguf.BLOCK_WEIGHTS)


def _qlinear(module, n: int, k: int) -> _QLinear | None:
    """float32: the layer's GGUF blocks, or None where it has none of the right shape."""
    if not _blocks_ok(module, n, k):
        return None
    return _QLinear(module.qweight.data_ptr(), n, k, module.qtype, int(module.qactivations == "q8_1"))


def _plinear(module, n: int, k: int) -> _QLinear | None:
    """bfloat16: the layer's copy packed for the bf16 kernel (and its GGUF blocks where it has them),
    or None where it has no packed copy for [n, k]."""
    w = getattr(module, "bf16_packed", None)
    if (w is None or module.packed_out_features != n or w.dtype != torch.bfloat16 or not w.is_contiguous()
            or w.numel() != n * k):
        return None
    if not _blocks_ok(module, n, k):
        return _QLinear(w.data_ptr(), n, k, 0, 0, None)
    return _QLinear(w.data_ptr(), n, k, module.qtype, int(module.qactivations == "q8_1"), module.qweight.data_ptr())


_LINEAR = {torch.float32: (_qlinear, "qweight"), torch.bfloat16: (_plinear, "bf16_packed")}


def _norm_ok(norm, hidden: int, dtype: torch.dtype) -> bool:
    w = norm.weight
    return w.dtype == dtype and w.device.type == "cpu" and w.is_contiguous() and tuple(w.shape) == (hidden,)


def _layer(layer, cfg) -> tuple[_Layer, tuple] | None:
    """One decoder layer's struct and the tensors it points into, or None where the stack
    cannot run it in cfg.dtype."""
    linear, weight_name = _LINEAR[cfg.dtype]
    attn, mlp = layer.self_attn, layer.mlp
    q_n = attn.num_heads * attn.head_dim
    parts = (linear(attn.qkv_proj, (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim, cfg.hidden_size),
             linear(attn.o_proj, cfg.hidden_size, q_n),
             linear(mlp.gate_up_proj, 2 * cfg.intermediate_size, cfg.hidden_size),
             linear(mlp.down_proj, cfg.hidden_size, cfg.intermediate_size))
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if (any(p is None for p in parts) or not all(_norm_ok(n, cfg.hidden_size, cfg.dtype) for n in norms)
            or not getattr(attn.backend, "fuse_rope_cache", False) or attn.head_dim % 2):
        return None
    mods = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    tensors = (norms[0].weight, norms[1].weight, *(getattr(mod, weight_name) for mod in mods),
               *(mod.qweight for mod in mods if getattr(mod, "qweight", None) is not None))
    return _Layer(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), norms[0].eps, norms[1].eps,
                  *parts, None, None), tensors


class DecodeStack:
    """The C decode stack of one model (`build` says whether it can serve it at all). One step
    at a time per model, as the model runner calls it: the intermediate rows live in one
    workspace of the stack."""

    def __init__(self, model, lib: ctypes.CDLL, layers: list[tuple[_Layer, tuple]]) -> None:
        cfg = model.config
        self.dtype = cfg.dtype
        self.lib, self.fn = lib, lib.kvp_decode_stack
        self.model = model
        attn = model.layers[model.start_layer].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.qkv_n = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.hidden, self.intermediate = cfg.hidden_size, cfg.intermediate_size
        rope = model.rotary_emb  # rows for every position: ModelConfig keeps max_model_len within them
        # the module path's rope.cos_sin rounds the float32 table's rows to the step dtype: so does this copy
        cos, sin = rope.cos.to(self.dtype).contiguous(), rope.sin.to(self.dtype).contiguous()
        self.md = _Model(*_kernels(self.dtype), self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, 0,
                         self.intermediate, attn.scale, model.norm.weight.data_ptr(), model.norm.eps,
                         cos.data_ptr(), sin.data_ptr())
        self.layers = (_Layer * len(layers))(*(layer for layer, _ in layers))
        self.keep = [cos, sin, model.norm.weight] + [t for _, ts in layers for t in ts]
        self.caches: list | None = None  # the KV caches the layer structs point into
        linears = [mod for layer in model.layers[model.start_layer:model.end_layer]
                   for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                               layer.mlp.down_proj)]
        if self.dtype == torch.bfloat16:
            self.max_rows = min(mod.bf16_max_rows for mod in linears)
            # --quantization gguf: every layer's blocks for steps of up to qmax_rows rows, as the modules read them
            quantized = all(q.qw for layer, _ in layers for q in (layer.qkv, layer.o, layer.gate_up, layer.down))
            self.md.qmax_rows = min([self.max_rows] + [mod.qmax_tokens for mod in linears]) if quantized else 0
        else:
            self.max_rows = min(mod.qmax_tokens for mod in linears)
        widest_k = max(self.hidden, self.num_heads * self.head_dim, self.intermediate)
        widest_n = max(self.qkv_n, self.hidden, 2 * self.intermediate)
        self.qscratch = torch.empty(self.md.qmax_rows * (widest_k + widest_n), dtype=torch.float32)
        self.md.qmatmul, self.md.qscratch = (gguf_kernel() if self.md.qmax_rows else None), self.qscratch.data_ptr()
        self.work = torch.empty(self.max_rows * (self.head_dim + self.qkv_n + self.num_heads * self.head_dim
                                                   + 3 * self.intermediate), dtype=self.dtype)
        self.args_tail = (ctypes.byref(self.md), ctypes.byref(self.layers), len(layers))

    @classmethod
    def build(cls, model) -> DecodeStack | None:
        """A DecodeStack for `model` (a LlamaForCausalLM: float32 with the GGUF blocks attached,
        or bfloat16 packed for the bf16 kernel; its modules set by `apply`), or None where some
        layer would not run the C kernels (see the module docstring)."""
        from kvpilot.engine.distributed import parallel_state as ps

        cfg = model.config
        if (ps.get_tp_size() != 1 or not (model.is_first_stage and model.is_last_stage)
                or model.start_layer >= model.end_layer or cfg.dtype not in _LINEAR
                or model.embed_tokens.weight.dtype != cfg.dtype):
            return None
        # the layers first: a model without GGUF blocks or bf16 kernel copies builds no library
        layers = [_layer(model.layers[i], cfg) for i in range(model.start_layer, model.end_layer)]
        if (any(layer is None for layer in layers) or not _norm_ok(model.norm, cfg.hidden_size, cfg.dtype)
                or not (model.rotary_emb.cos.is_contiguous() and model.rotary_emb.sin.is_contiguous())):
            return None
        return cls(model, load(cfg.dtype), layers)

    def _set_caches(self, kv_caches: list) -> None:
        """Points the layer structs at `kv_caches` (the runner's, allocated in the model's dtype as
        [num_blocks, block_size, num_kv_heads, head_dim] per layer). Raises ValueError where they
        are not that."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"decode stack: {len(kv_caches)} KV cache pairs for {len(self.layers)} layers")
        shape = kv_caches[0][0].shape
        for i, (k, v) in enumerate(kv_caches):
            if (k.dtype != self.dtype or v.dtype != self.dtype or k.device.type != "cpu" or k.dim() != 4
                    or not (k.is_contiguous() and v.is_contiguous()) or v.shape != k.shape or k.shape != shape
                    or tuple(k.shape[2:]) != (self.num_kv_heads, self.head_dim)):
                raise ValueError(f"decode stack: layer {i}'s KV caches are {k.dtype}/{v.dtype} {tuple(k.shape)}/"
                                 f"{tuple(v.shape)}, want contiguous {self.dtype} CPU tensors of one shape "
                                 f"[num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}]")
        for (k, v), layer in zip(kv_caches, self.layers):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
        self.md.block_size = shape[1]
        self.caches = kv_caches

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta) -> torch.Tensor | None:
        """Hidden states [num_tokens, hidden] in the model's dtype after the final norm (a new tensor), as
        LlamaForCausalLM.forward returns them, or None where this step is not one the stack
        serves (a prefill row, or more than max_rows rows: the caller then runs the modules).
        The inputs are in the layout model_runner.check_step_layout checked where the step was
        prepared. Raises ValueError for KV caches the stack cannot point into, RuntimeError when
        a kernel runs out of memory."""
        m = input_ids.shape[0]
        if not 0 < m <= self.max_rows or meta.num_decodes != m:
            return None
        if kv_caches is not self.caches:  # the runner keeps one list; a new one (profiling, tests) is checked
            self._set_caches(kv_caches)
        slots, tables, lens = meta.slot_mapping, meta.block_tables, meta.seq_lens
        residual = self.model.embed_tokens(input_ids)
        hidden = torch.empty(m, self.hidden, dtype=self.dtype)
        with kernel_range("decode_stack"):
            code = self.fn(*self.args_tail, residual.data_ptr(), hidden.data_ptr(), m, positions.data_ptr(),
                           slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), self.work.data_ptr(),
                           torch.get_num_threads(), cpu_decode.attention_threads(meta.seq_lens_cpu, self.num_kv_heads))
        if code:
            raise RuntimeError(f"decode stack: a kernel failed with code {code} (-1, -2: out of memory)")
        return hidden


def set_module_kernels(root: torch.nn.Module, path: CpuKernelPath) -> None:
    """Sets every module under `root` to the kernel path: RMSNorm's and SiluAndMul's
    `use_c_kernel` (path.c_norm_act), each attention layer's backend `use_cpu_kernel`
    (path.c_attention) and `fuse_rope_cache` (path.fused_rope_cache)."""
    for module in root.modules():
        if hasattr(module, "use_c_kernel"):
            module.use_c_kernel = path.c_norm_act
        backend = getattr(module, "backend", None)
        if hasattr(backend, "use_cpu_kernel"):
            backend.use_cpu_kernel = path.c_attention
            backend.fuse_rope_cache = path.fused_rope_cache


def apply(model, path: CpuKernelPath | None = None) -> None:
    """Sets `model`'s modules to the kernel path (default: cpu_kernel_path.current();
    `set_module_kernels`), gives it a decode stack where the path and the model allow, keeps the
    path as `model.kernel_path` and logs it once. Called by the model runner once weights are
    packed or quantized (their row limits came from the same path); comparisons and tests apply
    another path to a loaded model the same way."""
    path = path or cpu_kernel_path.current()
    set_module_kernels(model, path)
    model.kernel_path = path
    model.decode_stack = DecodeStack.build(model) if path.decode_stack else None
    logger.info("%s", cpu_kernel_path.describe(model, path))
