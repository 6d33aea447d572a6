"""A decoder layer's four bf16 matmuls (SmolLM2-135M: qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536) on kernels/cpu/bf16_gemm.py's kernel (its AMX tiles on an AMX CPU) and on oneDNN's
packed weights (torch.ops.mkldnn, as engine/layers/linear.py calls it), by row count, the two
interleaved over rounds; prints a table and writes JSON with the machine block. With `--layers 30`
each call walks 30 layers' own weights (212 MB, as a step reads them from memory) instead of one
layer's in cache. The crossover sets engine/cpu/row_limits.py's bf16_kernel_amx_tiles.

    python -P benchmarks/results/amx_rows/matmul_rows.py [--rows 32,64,128,256] [--layers 30] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvpilot.kernels.cpu import bf16_gemm
from kvpilot.loadgen.machine import loadavg, machine_info

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] of qkv, o, gate_up, down


def _ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="16,32,48,64,96,128,256")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=1, help="layers of distinct weights a call walks (1: in cache)")
    p.add_argument("--out", default="matmul_rows.json")
    a = p.parse_args()
    before = loadavg()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    weights = [torch.randn(n, k).bfloat16() for _ in range(a.layers) for n, k in SHAPES]
    ours_w = [bf16_gemm.pack(w) for w in weights]
    onednn_w = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in weights]
    shapes = SHAPES * a.layers
    rows_out = []
    print(f"kernel on AMX tiles: {bf16_gemm.amx()}; {a.threads} threads; {a.layers} layer(s) of weights a call")
    print("| rows | kernel ms | oneDNN ms | oneDNN / kernel |\n|---:|---:|---:|---:|")
    for m in (int(r) for r in a.rows.split(",")):
        xs = [torch.randn(m, k).bfloat16() for _, k in shapes]

        def ours():
            for x, w, (n, _) in zip(xs, ours_w, shapes):
                bf16_gemm.matmul(x, w, n)

        def onednn():
            for x, w in zip(xs, onednn_w):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        times = {"kernel": [], "onednn": []}
        for _ in range(a.rounds):
            times["kernel"].append(_ms(ours, a.calls))
            times["onednn"].append(_ms(onednn, a.calls))
        k, d = statistics.median(times["kernel"]), statistics.median(times["onednn"])
        rows_out.append({"rows": m, "kernel_ms": k, "onednn_ms": d, "rounds_ms": times})
        print(f"| {m} | {k:.3f} | {d:.3f} | {d / k:.2f} |")
    with open(a.out, "w") as f:
        json.dump({"machine": machine_info(before), "threads": a.threads, "amx_tiles": bf16_gemm.amx(),
                   "shapes": SHAPES, "layers": a.layers, "results": rows_out}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
