"""Before/after timing of the C RMSNorm (with vLLM's fused residual add) and SiLU-and-mul
(kernels/cpu/csrc/layernorm.c, activation.c): the attention library of an older commit, built
here for the same x86 level with the same flags as kernels/cpu/build.py builds it, against the
installed one (kernels/cpu/lib), in one process, interleaved round by round (alternating which
goes first), the median of the rounds' per-call times; torch's own ops for scale.

    PYTHONPATH=<checkout's packages> python -P benchmarks/results/elementwise/bench.py --before <commit>

Prints a Markdown table and the machine block (kvpilot.loadgen.machine) as JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpilot.kernels.cpu import build, loader
from kvpilot.loadgen.machine import loadavg, machine_info

REPO = Path(__file__).resolve().parents[3]
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I = ctypes.c_void_p, ctypes.c_int64


def build_before(commit: str, variant: str, library: str, tmp: Path) -> Path:
    """`library` (attention or attention_bf16) of `commit`'s kernels/cpu/csrc, built for `variant`."""
    src = tmp / "csrc"
    src.mkdir(exist_ok=True)
    for path in subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{commit}:kernels/cpu/csrc"],
                               check=True, capture_output=True, text=True).stdout.split():
        (src / path).write_bytes(subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:kernels/cpu/csrc/{path}"],
                                                check=True, capture_output=True).stdout)
    lib, var = build.LIBRARIES[library], next(v for v in build.variants() if v.name == variant)
    objects = []
    for source in (s for s in lib.sources if (src / s).exists()):  # the sources the commit had
        objects.append(str(tmp / f"{library}_{Path(source).stem}.o"))
        subprocess.run([build.compiler(), "-c", "-fPIC", "-std=gnu11", *var.cflags, *lib.cflags, "-I", str(src),
                        str(src / source), "-o", objects[-1]], check=True)
    out = tmp / f"libkvp_{library}_before.so"
    subprocess.run([build.compiler(), "-shared", *objects, "-o", str(out), *lib.ldflags], check=True)
    return out


def ops(path: Path, dtype: torch.dtype):
    lib = ctypes.CDLL(str(path))
    norm, silu = (getattr(lib, f"kvp_{n}_{SUFFIX[dtype]}") for n in ("rms_norm", "silu_mul"))
    norm.restype = silu.restype = None
    norm.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_float]
    silu.argtypes = [_P, _P, _I, _I]
    return norm, silu


def per_call(f, n: int) -> float:
    for _ in range(3):
        f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the commit whose kernels are 'before'")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variant = loader.selected_variant()
    load_before = loadavg()
    rows_table = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.bfloat16, torch.float32):
            library = "attention_bf16" if dtype == torch.bfloat16 else "attention"
            impls = {"before": ops(build_before(args.before, variant, library, Path(tmp)), dtype),
                     "after": ops(build.library_path(loader.LIB_DIR, variant, library), dtype)}
            for rows in (64, 2048):
                n = 400 if rows == 64 else 20
                gate_up = torch.randn(rows, 2 * 1536, dtype=dtype) * 4
                silu_out = torch.empty(rows, 1536, dtype=dtype)
                x, res, w = (torch.randn(rows, 576, dtype=dtype), torch.randn(rows, 576, dtype=dtype),
                             torch.randn(576, dtype=dtype))
                cases = {
                    f"silu_and_mul [{rows}, 2x1536]": {
                        **{k: (lambda s=s: s(gate_up.data_ptr(), silu_out.data_ptr(), rows, 1536))
                           for k, (_, s) in impls.items()},
                        "torch": lambda: F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]},
                    f"rms_norm + residual [{rows}, 576]": {
                        **{k: (lambda m=m: m(x.data_ptr(), res.data_ptr(), w.data_ptr(), x.data_ptr(), rows, 576, 1e-5))
                           for k, (m, _) in impls.items()},
                        "torch": lambda: F.rms_norm(x + res, (576,), w, 1e-5)},
                }
                for name, fns in cases.items():
                    times = {k: [] for k in fns}
                    for r in range(args.rounds):
                        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                            times[k].append(per_call(fns[k], n))
                            # the in-place norm grows the residual: keep its values in range
                            res.copy_(torch.randn_like(res))
                    med = {k: statistics.median(v) for k, v in times.items()}
                    rows_table.append((str(dtype).split(".")[1], name, med["before"], med["after"], med["torch"]))
    print(f"variant {variant}, {args.threads} threads, median of {args.rounds} interleaved rounds, us per call\n")
    print("| dtype | op [rows, width] | before | after | before / after | torch |")
    print("|---|---|---:|---:|---:|---:|")
    for dt, name, b, a, t in rows_table:
        print(f"| {dt} | {name} | {b:.1f} | {a:.1f} | {b / a:.2f}x | {t:.1f} |")
    print()
    print(json.dumps({"variant": variant, "threads": args.threads, "rounds": args.rounds,
                      "machine": machine_info(load_before)}, indent=1))


if __name__ == "__main__":
    main()
