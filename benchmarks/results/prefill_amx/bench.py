"""Times the bf16 prefill attention kernel (kernels/cpu/csrc/prefill.c) on its AMX path against
the float32 register tiles, in one process, calls interleaved (A, B, A, B, ...) so that a
neighbour's load hits both, and prints a Markdown table of the medians (ms per call) and their ratio.

    PYTHONPATH=<checkout's package folder> python -P benchmarks/results/prefill_amx/bench.py \
        [--rounds 30] [--threads 2] [--old-lib /tmp/oldlib/amx/libkvp_attention_bf16.so]

The AMX path is the selected (amx) variant's attention_bf16 library; the float32 tiles are the
avx512_bf16 variant's (the same source without AMX: AVX2 6 x 16 register tiles); --old-lib adds a
library built from an earlier commit (e.g. `python -m kvpilot.kernels.cpu.build --out /tmp/oldlib
--variant amx` in a checkout of it). Shapes: SmolLM2-135M's attention (9 query heads, 3 KV heads,
head_dim 64), block size 16, a step's chunks: (a) 8 fresh prompts of 256 tokens, (b) 4 of 512,
(c) a 512-token extend chunk after 1024 cached tokens. The K/V blocks are scattered (a random
permutation), as in a serving cache.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

from kvpilot.kernels.cpu import loader
from kvpilot.kernels.cpu import prefill
from kvpilot.loadgen.machine import loadavg, machine_info

BF16 = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = {  # name: (cached tokens per sequence, chunk tokens per sequence)
    "(a) 8 x 256 fresh": [(0, 256)] * 8,
    "(b) 4 x 512 fresh": [(0, 512)] * 4,
    "(c) 512 after 1024 cached": [(1024, 512)],
}


def make_step(seqs: list[tuple[int, int]], gen: torch.Generator) -> dict:
    """q/out [tokens, 9, 64] and a bf16 paged cache holding every sequence's tokens (scaled like
    a model's activations), with the kernel's int32 metadata."""
    blocks = [(c + q + BLOCK - 1) // BLOCK for c, q in seqs]
    perm = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[used:used + n]
        used += n
    shape = (sum(blocks), BLOCK, KV_HEADS, HEAD_DIM)
    tokens = sum(q for _, q in seqs)
    starts = [0]
    for _, q in seqs:
        starts.append(starts[-1] + q)
    return dict(q=torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(BF16),
                k=torch.randn(shape, generator=gen).to(BF16), v=torch.randn(shape, generator=gen).to(BF16),
                tables=tables, starts=torch.tensor(starts, dtype=torch.int32),
                lens=torch.tensor([c + q for c, q in seqs], dtype=torch.int32),
                out=torch.empty(tokens, HEADS, HEAD_DIM, dtype=BF16))


def call(fn, s: dict, threads: int) -> float:
    """One kernel call; its wall time in ms."""
    q, out = s["q"], s["out"]
    t0 = time.perf_counter()
    code = fn(q.data_ptr(), q.stride(0), q.stride(1), s["k"].data_ptr(), s["v"].data_ptr(), s["tables"].data_ptr(),
              s["tables"].shape[1], s["starts"].data_ptr(), s["lens"].data_ptr(), s["lens"].shape[0], out.data_ptr(),
              out.stride(0), HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM**-0.5, threads)
    ms = (time.perf_counter() - t0) * 1e3
    assert code == 0, code
    return ms


def kernel_of(lib: ctypes.CDLL):
    fn = lib.kvp_paged_prefill_bf16
    p, i = ctypes.c_void_p, ctypes.c_int64
    fn.restype = ctypes.c_int
    fn.argtypes = [p, i, i, p, p, p, i, p, p, i, p, i, i, i, i, i, ctypes.c_float, i]
    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--old-lib", default=None, help="an attention_bf16 library built from an earlier commit")
    parser.add_argument("--json", default=None, help="also write the medians and every sample here")
    args = parser.parse_args()
    amx = loader.load("attention_bf16")
    assert amx.kvp_prefill_amx() == 1, "this CPU's variant does not run the AMX path"
    impls = {"fp32 tiles (avx512_bf16 variant)": kernel_of(loader.load("attention_bf16", "avx512_bf16")),
             "AMX": kernel_of(amx)}
    if args.old_lib:
        impls = {"before (--old-lib)": kernel_of(ctypes.CDLL(args.old_lib)), **impls}
    before = loadavg()
    gen = torch.Generator().manual_seed(0)
    result = {}
    for name, seqs in SHAPES.items():
        step = make_step(seqs, gen)
        outs = {}
        for label, fn in impls.items():  # warm up (and keep each output for the agreement check)
            call(fn, step, args.threads)
            outs[label] = step["out"].float().clone()
        samples = {label: [] for label in impls}
        for _ in range(args.rounds):
            for label, fn in impls.items():
                samples[label].append(call(fn, step, args.threads))
        ref = outs["fp32 tiles (avx512_bf16 variant)"]
        result[name] = {"median_ms": {k: statistics.median(v) for k, v in samples.items()}, "samples_ms": samples,
                        "max_abs_diff_vs_fp32_tiles": {k: float((o - ref).abs().max()) for k, o in outs.items()}}
    machine = machine_info(before)
    labels = list(impls)
    print(f"CPU: {machine['cpu']}, {machine['cores']} cores, threads {args.threads}, {args.rounds} rounds; "
          f"load average before {machine['loadavg_before']}, after {machine['loadavg_after']}\n")
    baselines = [k for k in labels if k != "AMX"]
    print("| shape | " + " | ".join(f"{k} ms" for k in labels) + " | "
          + " | ".join(f"{k.split(' (')[0]} / AMX" for k in baselines) + " |")
    print("|---|" + "---:|" * (len(labels) + len(baselines)))
    for name, r in result.items():
        med = r["median_ms"]
        print(f"| {name} | " + " | ".join(f"{med[k]:.2f}" for k in labels) + " | "
              + " | ".join(f"{med[k] / med['AMX']:.2f}x" for k in baselines) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "threads": args.threads, "rounds": args.rounds, "shapes": result}, f, indent=1)


if __name__ == "__main__":
    main()
