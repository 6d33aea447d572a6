"""GPU benchmark of the Triton kernels (not run in CI; needs CUDA):

    python -m kvpilot.kernels.bench [--dtype bfloat16] [--heads 32 --kv-heads 8 --head-dim 128]

Times each kernel with `triton.testing.do_bench` over realistic shapes (Llama-3-8B's
attention by default: 32 query heads over 8 KV heads, head_dim 128, 16-token blocks) and
prints, per shape: the kernel's time, its achieved memory bandwidth (bytes it must move at
least / time) against the device's measured copy bandwidth, its attention TFLOP/s, the
PyTorch reference's time on the same inputs, and the relative error between the two, so
that the first run on a GPU says both whether the kernels are right there and how close
to the memory limit they are. Decode and the cache write are memory-bound, so %copy is
their figure of merit; long prefills are compute-bound, so TFLOP/s is.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpilot.kernels import reference as ref

Timer = Callable[[Callable[[], object]], float]  # returns milliseconds


@dataclass(frozen=True)
class Shape:
    """The attention shape benchmarked: query and KV heads (GQA when they differ), head_dim,
    tokens per KV-cache block and the element dtype. Defaults: Llama-3-8B's, bf16."""
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def elt(self) -> int:
        """Bytes per element of dtype (2 for float16/bfloat16, 4 for float32)."""
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Case:
    """One benchmarked call: the Triton kernel and its PyTorch reference (kvpilot.kernels.reference)
    on the same inputs, each returning the tensor to compare (None: nothing to compare)."""
    kernel: str
    label: str
    run: Callable[[], torch.Tensor | None]
    run_ref: Callable[[], torch.Tensor | None]
    min_bytes: int  # bytes the kernel must read and write at least
    flops: int  # attention matmul flops (0 for the cache write)


def decode_bytes(shape: Shape, seq_lens: list[int]) -> int:
    """K and V of every cached token, plus q and the output."""
    kv = 2 * sum(seq_lens) * shape.num_kv_heads * shape.head_dim
    return (kv + 2 * len(seq_lens) * shape.num_heads * shape.head_dim) * shape.elt


def extend_bytes(shape: Shape, seq_lens: list[int], query_lens: list[int]) -> int:
    """K and V of every token each chunk can see, read once, plus q and the output."""
    kv = 2 * sum(seq_lens) * shape.num_kv_heads * shape.head_dim
    return (kv + 2 * sum(query_lens) * shape.num_heads * shape.head_dim) * shape.elt


def attention_flops(shape: Shape, seq_lens: list[int], query_lens: list[int]) -> int:
    """2 matmuls x 2 flops per multiply-add over the causally visible (query, key) pairs."""
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for s, q in zip(seq_lens, query_lens))
    return 4 * pairs * shape.num_heads * shape.head_dim


def write_bytes(shape: Shape, num_tokens: int) -> int:
    """K and V read from the step's tensors and written into the cache."""
    return 4 * num_tokens * shape.num_kv_heads * shape.head_dim * shape.elt


def _paged(shape: Shape, seq_lens: list[int], device) -> tuple[torch.Tensor, ...]:
    """Full random caches with each sequence's blocks scattered over them."""
    per_seq = [math.ceil(n / shape.block_size) for n in seq_lens]
    num_blocks = sum(per_seq)
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=shape.dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=shape.dtype, device=device)
    physical = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = physical[used : used + n]
        used += n
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, lens


def decode_case(shape: Shape, seq_lens: list[int], device) -> Case:
    """paged_decode_attention over one query token per sequence with seq_lens[i] cached tokens
    (blocks scattered at random over the cache), against paged_decode_attention_ref."""
    from kvpilot.kernels.decode_attention import paged_decode_attention

    k_cache, v_cache, tables, lens = _paged(shape, seq_lens, device)
    q = torch.randn(len(seq_lens), shape.num_heads, shape.head_dim, dtype=shape.dtype, device=device)
    scale, max_len = shape.head_dim**-0.5, max(seq_lens)
    return Case(
        "decode", f"{len(seq_lens)} seqs x {max_len} tokens",
        lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_seq_len=max_len),
        lambda: ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale),
        decode_bytes(shape, seq_lens), attention_flops(shape, seq_lens, [1] * len(seq_lens)),
    )


def extend_case(shape: Shape, num_seqs: int, ctx_len: int, q_len: int, device) -> Case:
    """paged_extend_attention of num_seqs chunks of q_len new tokens, each after ctx_len cached ones
    (prefix caching or chunked prefill; ctx_len 0: a plain prefill), against its reference."""
    from kvpilot.kernels.extend_attention import paged_extend_attention

    seq_lens, query_lens = [ctx_len + q_len] * num_seqs, [q_len] * num_seqs
    k_cache, v_cache, tables, lens = _paged(shape, seq_lens, device)
    q = torch.randn(num_seqs * q_len, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=device)
    starts = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=device) * q_len
    scale = shape.head_dim**-0.5
    return Case(
        "extend", f"{num_seqs} seqs x ({ctx_len} cached + {q_len} new)",
        lambda: paged_extend_attention(q, k_cache, v_cache, tables, starts, lens, scale,
                                       max_query_len=q_len),
        lambda: ref.paged_extend_attention_ref(q, k_cache, v_cache, tables, starts, lens, scale),
        extend_bytes(shape, seq_lens, query_lens), attention_flops(shape, seq_lens, query_lens),
    )


def write_case(shape: Shape, num_tokens: int, device) -> Case:
    """write_kv_cache of num_tokens tokens' K and V into distinct random slots of a cache, against
    write_kv_cache_ref on a copy of the cache."""
    from kvpilot.kernels.cache_write import write_kv_cache

    k_cache, v_cache, _, _ = _paged(shape, [num_tokens * 2], device)
    key = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(k_cache.shape[0] * shape.block_size, device=device)[:num_tokens]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    def run_ref():
        ref.write_kv_cache_ref(key, value, k_ref, v_ref, slots)
        return k_ref

    def run():
        write_kv_cache(key, value, k_cache, v_cache, slots)
        return k_cache

    return Case("cache_write", f"{num_tokens} tokens", run, run_ref, write_bytes(shape, num_tokens), 0)


def default_cases(shape: Shape, device, quick: bool = False) -> list[Case]:
    """The cases the benchmark runs: decodes from 1 x 32k to 256 x 1k tokens, extends from one
    4k prefill to 16 x 64-token chunks after 3000 cached, and cache writes of 256 to 16k tokens;
    quick: one of each."""
    decodes = [[32768], [4096] * 8, [2048] * 64, [1024] * 256]
    extends = [(1, 0, 4096), (4, 1024, 512), (16, 3000, 64)]
    writes = [256, 4096, 16384]
    if quick:
        decodes, extends, writes = decodes[1:2], extends[1:2], writes[1:2]
    return (
        [decode_case(shape, lens, device) for lens in decodes]
        + [extend_case(shape, *e, device) for e in extends]
        + [write_case(shape, n, device) for n in writes]
    )


def copy_bandwidth(timer: Timer, device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (each byte is read and written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (timer(lambda: dst.copy_(src)) * 1e-3)


def run_cases(cases: list[Case], timer: Timer, copy_bw: float) -> list[dict]:
    """One table row per case: kernel time (us), achieved bandwidth (min_bytes / time, in GB/s and
    as % of copy_bw, which is in bytes/s), TFLOP/s, the reference's time, the speedup over it and
    the relative error (max |out - ref| / max |ref|). Runs on the device the cases were built on."""
    rows = []
    for case in cases:
        out = case.run()
        expected = case.run_ref()
        err = 0.0
        if out is not None and expected is not None:
            diff = (out.float() - expected.float()).abs().max()
            err = float(diff / expected.float().abs().max().clamp_min(1e-30))
        ms = timer(case.run)
        ref_ms = timer(case.run_ref)
        bw = case.min_bytes / (ms * 1e-3)
        rows.append({
            "kernel": case.kernel, "shape": case.label, "us": ms * 1e3,
            "GB/s": bw / 1e9, "%copy": 100 * bw / copy_bw,
            "TFLOP/s": case.flops / (ms * 1e-3) / 1e12, "ref_us": ref_ms * 1e3,
            "speedup": ref_ms / ms, "rel_err": err,
        })
    return rows


def format_table(rows: list[dict]) -> str:
    """rows as a plain-text table, one left-aligned column per figure, with units in the headers."""
    cols = ["kernel", "shape", "us", "GB/s", "%copy", "TFLOP/s", "ref_us", "speedup", "rel_err"]
    fmt = {"us": "{:.1f}", "GB/s": "{:.0f}", "%copy": "{:.0f}%", "TFLOP/s": "{:.1f}",
           "ref_us": "{:.1f}", "speedup": "{:.1f}x", "rel_err": "{:.1e}"}
    cells = [[fmt.get(c, "{}").format(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark on the first CUDA device and prints the table; returns 0. argv: the flags
    (None: sys.argv). Raises SystemExit without a CUDA GPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="one shape per kernel")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kvpilot.kernels.bench needs a CUDA GPU; the kernels' CPU tests "
                         "run under TRITON_INTERPRET=1 in tests/kernels instead")
    import triton.testing

    torch.manual_seed(0)
    device = torch.device("cuda")
    shape = Shape(args.heads, args.kv_heads, args.head_dim, args.block_size, getattr(torch, args.dtype))
    timer: Timer = triton.testing.do_bench
    copy_bw = copy_bandwidth(timer, device)
    print(f"{torch.cuda.get_device_name(device)}: copy bandwidth {copy_bw / 1e9:.0f} GB/s; {shape}")
    print(format_table(run_cases(default_cases(shape, device, args.quick), timer, copy_bw)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
