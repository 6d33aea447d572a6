"""Before/after timing of the C decode attention (kernels/cpu/csrc/attention.c `kvp_paged_decode_bf16`)
on SmolLM2-135M's shape: 30 layers of 9 query and 3 KV heads of 64, 64 sequences of 256 tokens, the
bf16 pool of VLLM_CPU_KVCACHE_SPACE's default 4 GiB, by block size (16: kvpilot's default; 128: vLLM's on
CPU), block layout (in order: a fresh server's pool; scattered: a random permutation, a pool after
hours of requests) and pages (4 KiB, as the engine's caches, or 2 MiB: transparent huge pages
advised on the pool). The attention library of an older commit is built here for the same x86
level with the flags of kernels/cpu/build.py (benchmarks/results/elementwise/bench.py's builder)
against the installed one, in one process, interleaved round by round (alternating which goes first);
the median of the rounds' times of one decode step's 30 layers, and the K/V bytes read per second.

    PYTHONPATH=<checkout's packages> python -P benchmarks/results/decode_attention/bench.py --before <commit>

Prints a Markdown table and the machine block (kvpilot.loadgen.machine) as JSON (--json FILE: also there).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import mmap
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvpilot.kernels.cpu import build, loader
from kvpilot.loadgen.machine import loadavg, machine_info

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
POOL_BYTES = 4 << 30  # both caches of every layer
_P, _I = ctypes.c_void_p, ctypes.c_int64
HUGE_PAGE_BYTES = 2 << 20


def empty_huge(numel: int) -> torch.Tensor:
    """An uninitialized bf16 tensor of `numel` elements starting on a 2 MiB boundary, its memory advised
    huge pages (madvise(MADV_HUGEPAGE): honoured where /sys/kernel/mm/transparent_hugepage/enabled is
    `always` or `madvise`) before anything touches it."""
    buf = torch.empty(numel * 2 + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -buf.data_ptr() % HUGE_PAGE_BYTES
    t = buf[offset:offset + numel * 2].view(torch.bfloat16)
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [_P, ctypes.c_size_t, ctypes.c_int]
    length = numel * 2 // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if madvise(t.data_ptr(), length, mmap.MADV_HUGEPAGE):
        raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) refused: no transparent huge pages here")
    return t


def _builder():
    spec = importlib.util.spec_from_file_location("elementwise_bench", Path(__file__).parents[1] / "elementwise" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_before


def kernel(path: Path):
    fn = ctypes.CDLL(str(path)).kvp_paged_decode_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [_P, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I]
    return fn


def pool(huge: bool) -> list[torch.Tensor]:
    """Each layer's K and V storage as flat bf16 tensors, filled with N(0, 1) values."""
    per = POOL_BYTES // (2 * LAYERS) // 2
    make = (lambda: empty_huge(per)) if huge else (lambda: torch.empty(per, dtype=torch.bfloat16))
    flats = [make() for _ in range(2 * LAYERS)]
    for t in flats:
        t.normal_()
    return flats


def step_ms(fn, flats, q, out, tables, lens, block_size: int, threads: int) -> float:
    start = time.perf_counter()
    for layer in range(LAYERS):
        k, v = flats[2 * layer], flats[2 * layer + 1]
        code = fn(q.data_ptr(), HEADS * HEAD_DIM, HEAD_DIM, k.data_ptr(), v.data_ptr(), tables.data_ptr(),
                  tables.shape[1], lens.data_ptr(), out.data_ptr(), 0, q.shape[0], HEADS, KV_HEADS, HEAD_DIM,
                  block_size, 0.125, threads)
        assert code == 0
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the commit whose kernels are 'before'")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    variant = loader.selected_variant()
    load_before = loadavg()
    results = []
    q = torch.randn(args.seqs, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    row_bytes = KV_HEADS * HEAD_DIM * 2
    read_bytes = 2 * LAYERS * args.seqs * args.context * row_bytes
    with tempfile.TemporaryDirectory() as tmp:
        impls = {"before": kernel(_builder()(args.before, variant, "attention_bf16", Path(tmp))),
                 "after": kernel(build.library_path(loader.LIB_DIR, variant, "attention_bf16"))}
        for huge in (False, True):
            flats = pool(huge)
            for block_size in (16, 128):
                num_blocks = flats[0].numel() // (block_size * KV_HEADS * HEAD_DIM)
                per_seq = -(-args.context // block_size)
                for layout in ("in order", "scattered"):
                    ids = torch.arange(num_blocks) if layout == "in order" else torch.randperm(num_blocks)
                    tables = ids[1:1 + args.seqs * per_seq].to(torch.int32).view(args.seqs, per_seq).contiguous()
                    assert int(tables.max()) < num_blocks
                    times = {k: [] for k in impls}
                    for r in range(args.rounds):
                        for name in (list(impls) if r % 2 == 0 else list(impls)[::-1]):
                            times[name].append(step_ms(impls[name], flats, q, out, tables, lens, block_size, args.threads))
                    med = {k: statistics.median(v) for k, v in times.items()}
                    results.append({"pages": "2 MiB" if huge else "4 KiB", "block_size": block_size, "layout": layout,
                                    "before_ms": med["before"], "after_ms": med["after"],
                                    "before_gb_s": read_bytes / med["before"] / 1e6,
                                    "after_gb_s": read_bytes / med["after"] / 1e6})
            del flats
    print(f"variant {variant}, {args.threads} threads, {args.seqs} sequences x {args.context} tokens, 30 layers; "
          f"median of {args.rounds} interleaved rounds, ms per decode step (all layers), K/V GB/s\n")
    print("| pages | block_size | blocks | before ms | after ms | before / after | before GB/s | after GB/s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['pages']} | {r['block_size']} | {r['layout']} | {r['before_ms']:.1f} | {r['after_ms']:.1f} | "
              f"{r['before_ms'] / r['after_ms']:.2f}x | {r['before_gb_s']:.1f} | {r['after_gb_s']:.1f} |")
    doc = {"variant": variant, "threads": args.threads, "rounds": args.rounds, "seqs": args.seqs,
           "context_tokens": args.context, "before": args.before, "results": results,
           "machine": machine_info(load_before)}
    print()
    print(json.dumps(doc["machine"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
