"""Pure-PyTorch paged attention: the CPU backend and the engine's reference behaviour.

Decodes run in length buckets: consecutive decode rows whose lengths are close (padding at
most `MAX_PADDING` of the bucket) share one gather of their blocks into a dense
[rows, num_blocks * block_size] view and one batched SDPA call, masked by each row's
length; buckets are split so that one gather stays under `WORKSPACE_BYTES`, which keeps
the gathered K/V in cache while SDPA reads it. The model runner orders decodes by
length, longest first, so buckets are tight; any order is still correct.
Prefill/extend chunks run one sequence at a time; a fresh prefill (nothing cached) attends
to its own new K/V without a gather.

In float32 or bfloat16 on CPU, where the C kernel of kernels/cpu/attention.py serves, all decodes of a
layer run in one call of that kernel instead (no gather, no mask, K/V read in place);
through `forward_qkv` the same call also applies RoPE and writes the new K/V
(cpu_decode.FusedDecode), so a decode-only layer's attention is one C call. Likewise all
prefill/extend chunks of a layer attend in one call of kernels/cpu/prefill.py's kernel
(AVX2 builds), reading K/V in place. The buckets and per-chunk SDPA are the fallback and
the path for other dtypes and devices.

The plan (buckets, block ids, masks) depends only on the step's metadata, so it is built
once per step, in the first layer, and kept in `meta.backend_state`. Gathers write into a
workspace reused across layers and steps instead of fresh allocations (on CPU a large
fresh tensor costs a page fault per 4 KiB).
Source: vLLM PagedAttention (SOSP'23); the cache layout is in attention/backend.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpilot.kernels.cpu import attention as cpu_decode
from kvpilot.kernels.cpu import prefill as cpu_prefill
from kvpilot.engine.attention.backend import AttentionBackend, AttentionMetadata
from kvpilot.engine.layers.rotary_embedding import apply_rotary

MAX_PADDING = 0.25
WORKSPACE_BYTES = 8 << 20
_PLAN_KEY = "torch_paged_plan"
_FUSED_KEY = "cpu_fused_decode"
_PREFILL_KEY = "cpu_prefill"
_PREFILL_ROPE_KEY = "cpu_prefill_rope"


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores key/value [num_tokens, num_kv_heads, head_dim] at flat slots
    slot_mapping [num_tokens] int64 of caches [num_blocks, block_size, num_kv_heads, head_dim]."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@dataclass
class _Gather:
    """Rows [start, end) of the batch (sequences for decodes, tokens for an extend) and
    the blocks to gather for them: block_ids [rows * num_blocks] int64."""

    start: int
    end: int
    num_blocks: int
    block_ids: torch.Tensor | None  # None: the decodes run fused (cpu_decode)
    mask: torch.Tensor | None


def plan_decode_buckets(seq_lens: list[int], block_size: int, max_rows_blocks: int,
                        max_padding: float = MAX_PADDING) -> list[tuple[int, int, int]]:
    """Splits decode rows into consecutive buckets (start, end, num_blocks): a bucket pads
    every row to its longest row's blocks, with padded blocks at most (1 + max_padding) x
    the blocks its rows use (or a tiny bucket), and rows x num_blocks <= max_rows_blocks."""
    buckets: list[tuple[int, int, int]] = []
    start, width, used = 0, 0, 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        new_width = max(width, nb)
        rows = i - start + 1
        fits = rows * new_width <= max(max_rows_blocks, new_width)
        tight = rows * new_width <= (used + nb) * (1 + max_padding) or rows * new_width <= 64
        if i > start and not (fits and tight):
            buckets.append((start, i, width))
            start, new_width, used = i, nb, 0
        width, used = new_width, used + nb
    if seq_lens:
        buckets.append((start, len(seq_lens), width))
    return buckets


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in PyTorch (module docstring): decodes by the C kernel where it
    serves, else in length buckets of SDPA; prefill/extend chunks by the C prefill kernel or
    per-sequence SDPA. Reference behaviour for the Triton backend."""

    name = "torch"

    def __init__(self, use_cpu_kernel: bool = True, fuse_rope_cache: bool = True) -> None:
        """use_cpu_kernel=False keeps the decodes on the torch buckets even where the C
        kernel would serve them; fuse_rope_cache=False keeps RoPE and the K/V write in torch
        before the C attention (tests, comparisons)."""
        self._workspace: torch.Tensor | None = None
        self.use_cpu_kernel = use_cpu_kernel
        self.fuse_rope_cache = fuse_rope_cache

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale):
        """Writes key/value into the cache at meta.slot_mapping, then attends. Shapes and
        dtypes as `AttentionBackend.forward`: query [num_tokens, num_heads, head_dim] in,
        the same shape and dtype out."""
        write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        decodes, extends = self._get_plan(meta, query, k_cache)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if decodes and decodes[0].block_ids is None:  # fused: one kernel call for every decode
            nd = meta.num_decodes
            cpu_decode.paged_decode_attention(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd].to(torch.int32).contiguous(),
                meta.seq_lens[:nd].to(torch.int32), scale, out[:nd],
                meta.seq_lens_cpu[:nd])
            decodes = ()
        for g in decodes:
            k, v = self._gather(k_cache, v_cache, g, query.dtype)  # [rows, L, KVH, D]
            o = F.scaled_dot_product_attention(
                query[g.start:g.end].unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=g.mask, scale=scale, enable_gqa=True,
            )
            out[g.start:g.end] = o.squeeze(2)
        self._extends(query, key, value, k_cache, v_cache, meta, scale, out, 0)
        return out

    def forward_qkv(self, qkv, rope, k_cache, v_cache, meta: AttentionMetadata, scale, num_heads):
        """As the base class; where the C kernel serves the decodes (float32/bf16 CPU), one call
        per layer rotates, stores and attends every decode row (cpu_decode.FusedDecode); where the C
        prefill attention serves the prefill/extend rows, one call rotates them and stores their K/V
        (cpu_decode.PrefillRope) before it; else those rows take torch's RoPE and cache write."""
        nd = meta.num_decodes
        fused = self._fused_decode(meta, qkv, k_cache, rope, num_heads, scale)
        if nd and fused is None:
            return super().forward_qkv(qkv, rope, k_cache, v_cache, meta, scale, num_heads)
        prefill_rope = self._prefill_rope(meta, qkv, k_cache, rope, num_heads) if nd < qkv.shape[0] else None
        if not nd and prefill_rope is None:
            return super().forward_qkv(qkv, rope, k_cache, v_cache, meta, scale, num_heads)
        if nd == qkv.shape[0]:
            return fused(qkv, k_cache, v_cache)
        rest = qkv[nd:]
        if prefill_rope is not None:  # RoPE and the K/V write in one C call, then the C prefill attention
            q = prefill_rope(rest, k_cache, v_cache)
            out = torch.empty((qkv.shape[0], *q.shape[1:]), dtype=q.dtype, device=q.device)
            if nd:  # the decode rows' output straight into the step's, no torch.cat
                fused(qkv[:nd], k_cache, v_cache, out[:nd])
            self._extends(q, None, None, k_cache, v_cache, meta, scale, out[nd:], nd)
            return out
        out = fused(qkv[:nd], k_cache, v_cache)
        num_kv_heads = (qkv.shape[1] - num_heads) // 2
        qk = apply_rotary(rest[:, : num_heads + num_kv_heads], (rope[0][nd:], rope[1][nd:]))
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        v = rest[:, num_heads + num_kv_heads :]
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping[nd:])
        out_rest = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._extends(q, k, v, k_cache, v_cache, meta, scale, out_rest, nd)
        return torch.cat((out, out_rest))

    def _fused_decode(self, meta: AttentionMetadata, qkv, k_cache, rope, num_heads, scale):
        """The step's cpu_decode.FusedDecode (built in the first layer), or None where the
        decodes take the torch path (no decodes, other dtype or device, kernel off/unbuilt)."""
        state = meta.backend_state
        if _FUSED_KEY not in state:
            nd = meta.num_decodes
            ok = (self.use_cpu_kernel and self.fuse_rope_cache and nd > 0 and qkv.stride(-1) == 1
                  and cpu_decode.supports(qkv[:, 0], k_cache) and rope[0].dtype == qkv.dtype)
            state[_FUSED_KEY] = cpu_decode.FusedDecode(
                rope[0][:nd], rope[1][:nd], meta.slot_mapping[:nd], meta.block_tables[:nd],
                meta.seq_lens[:nd], meta.seq_lens_cpu[:nd], num_heads, scale) if ok else None
        return state[_FUSED_KEY]

    def _prefill_rope(self, meta: AttentionMetadata, qkv, k_cache, rope, num_heads):
        """The step's cpu_decode.PrefillRope for its prefill/extend rows (built in the first layer), or
        None where they take torch's RoPE and cache write: the C prefill attention must serve them
        (it reads their K/V from the cache only) and RoPE be fused (fuse_rope_cache), as for decodes."""
        state = meta.backend_state
        if _PREFILL_ROPE_KEY not in state:
            nd = meta.num_decodes
            ok = (self.use_cpu_kernel and self.fuse_rope_cache and qkv.stride(-1) == 1
                  and rope[0].dtype == qkv.dtype and self._prefill(meta, qkv[nd:, :num_heads], k_cache) is not None)
            state[_PREFILL_ROPE_KEY] = cpu_decode.PrefillRope(
                rope[0][nd:], rope[1][nd:], meta.slot_mapping[nd:], num_heads) if ok else None
        return state[_PREFILL_ROPE_KEY]

    def _get_plan(self, meta: AttentionMetadata, query, k_cache) -> tuple[list[_Gather], list[_Gather]]:
        plan = meta.backend_state.get(_PLAN_KEY)
        if plan is None:
            fused = self.use_cpu_kernel and meta.num_decodes > 0 and cpu_decode.supports(query, k_cache)
            chunks_in_c = self._prefill(meta, query, k_cache) is not None
            plan = meta.backend_state[_PLAN_KEY] = self._plan(meta, k_cache, fused, chunks_in_c)
        return plan

    def _prefill(self, meta: AttentionMetadata, query, k_cache) -> cpu_prefill.PrefillBatch | None:
        """The step's cpu_prefill.PrefillBatch (built in the first layer), or None where the
        prefill/extend chunks take torch's SDPA (none, other dtype or device, kernel off/unbuilt)."""
        state = meta.backend_state
        if _PREFILL_KEY not in state:
            ok = self.use_cpu_kernel and meta.num_seqs > meta.num_decodes and cpu_prefill.supports(query, k_cache)
            state[_PREFILL_KEY] = cpu_prefill.PrefillBatch(
                meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_tables, meta.num_decodes) if ok else None
        return state[_PREFILL_KEY]

    def _extends(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale, out, offset: int):
        """Prefill/extend chunks; query/key/value/out hold the batch's rows from `offset` on.
        Where the C kernel serves them (float32/bf16 CPU, kernels/cpu/prefill.py), one call attends
        every chunk over the paged cache (their K/V are written already). Else one SDPA per chunk
        (g.start, g.end are rows of the whole batch), with 4-D [1, heads, q_len, head_dim]
        inputs (as HF's attention passes them): on CPU, torch 2.13 takes its flash-attention
        kernel for 4-D inputs with GQA and falls back to the math path (the full score matrix)
        for 3-D ones, 3-5x slower at 512-1024 tokens (section 9 of the throughput notebook,
        `git show bbe6366:benchmarks/results/throughput/README.md`)."""
        prefill = self._prefill(meta, query, k_cache)
        if prefill is not None:
            s = prefill.first_row - offset
            prefill(query[s:], k_cache, v_cache, scale, out[s:])
            return
        extends = self._get_plan(meta, query, k_cache)[1]
        for g in extends:
            s, e = g.start - offset, g.end - offset
            if g.num_blocks == 0:  # fresh prefill: its own K/V are all there is
                k, v = key[s:e], value[s:e]
            else:
                k, v = (t[0] for t in self._gather(k_cache, v_cache, g, query.dtype))
            o = F.scaled_dot_product_attention(
                query[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=g.mask, is_causal=g.mask is None, scale=scale, enable_gqa=True,
            )
            out[s:e] = o[0].transpose(0, 1)

    @staticmethod
    def _plan(meta: AttentionMetadata, k_cache: torch.Tensor, fused: bool = False,
              chunks_in_c: bool = False) -> tuple[list[_Gather], list[_Gather]]:
        block_size = k_cache.shape[1]
        block_bytes = k_cache[0].numel() * k_cache.element_size()
        tables = meta.block_tables.to(torch.int64)
        dev = k_cache.device
        nd = meta.num_decodes
        decodes = [_Gather(0, nd, 0, None, None)] if fused else []
        for s, e, nb in [] if fused else plan_decode_buckets(meta.seq_lens_cpu[:nd], block_size,
                                                             max(1, WORKSPACE_BYTES // block_bytes)):
            lens = meta.seq_lens[s:e].to(dev).unsqueeze(1)
            mask = torch.arange(nb * block_size, device=dev).unsqueeze(0) < lens
            decodes.append(_Gather(s, e, nb, tables[s:e, :nb].reshape(-1), mask[:, None, None, :]))
        extends = []
        starts = meta.query_start_loc_cpu
        for i in () if chunks_in_c else range(nd, meta.num_seqs):  # the C kernel needs no masks
            s, e = starts[i], starts[i + 1]
            seq_len, q_len = meta.seq_lens_cpu[i], e - s
            if seq_len == q_len:
                extends.append(_Gather(s, e, 0, tables[i, :0], None))
                continue
            nb = -(-seq_len // block_size)
            pos_q = torch.arange(seq_len - q_len, seq_len, device=dev).unsqueeze(1)
            mask = torch.arange(nb * block_size, device=dev).unsqueeze(0) <= pos_q  # [q_len, L]
            extends.append(_Gather(s, e, nb, tables[i, :nb], mask))
        return decodes, extends

    def _gather(self, k_cache, v_cache, g: _Gather, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies the blocks of g into the workspace: two [rows, num_blocks * block_size,
        num_kv_heads, head_dim] views (K, V). Rows are sequences for decodes; an extend
        gathers one sequence (rows = 1)."""
        nb_total, bs, kvh, d = k_cache.shape
        n = g.block_ids.numel()
        row = bs * kvh * d
        ws = self._workspace
        if ws is None or ws.numel() < 2 * n * row or ws.dtype != k_cache.dtype or ws.device != k_cache.device:
            ws = self._workspace = torch.empty(2 * n * row, dtype=k_cache.dtype, device=k_cache.device)
        rows = max(1, n // max(g.num_blocks, 1))
        k = torch.index_select(k_cache.view(nb_total, row), 0, g.block_ids, out=ws[: n * row].view(n, row))
        v = torch.index_select(v_cache.view(nb_total, row), 0, g.block_ids,
                               out=ws[n * row : 2 * n * row].view(n, row))
        shape = (rows, g.num_blocks * bs, kvh, d)
        return k.view(shape).to(dtype), v.view(shape).to(dtype)
