"""Ahead-of-time builds of the CPU kernels: every kernel library once per x86 level.

As llama.cpp's `GGML_CPU_ALL_VARIANTS` (one ggml-cpu backend per x86 level, the best one loaded
at start-up) and PyTorch's ATen CPU dispatch (DEFAULT / AVX2 / AVX512 builds of each kernel,
chosen by `torch.backends.cpu.get_cpu_capability()`), the project's install compiles each
library of `LIBRARIES` for each level of `VARIANTS` into `<out>/<variant>/libkvp_<library>.so`,
with `<out>/manifest.json` saying what was built, with which compiler and how long it took;
kernels/cpu/loader.py loads the best variant the CPU runs. Nothing is compiled where the engine
runs. setup.py calls `build_all` from its `build_kernels` step (wheels, `pip install -e`, the
image's build stage); a compiler error fails the install with the compiler's message.
Developers rebuild in place with `python -m kvpilot.kernels.cpu.build` (or `make install`).

Standard library only: setup.py loads this file by path, before kvpilot is importable.
The variants name their instruction sets explicitly (`-m...` flags), not `-march=<cpu>`, so
that a variant's `cpu_flags` (the /proc/cpuinfo flags the loader requires) cover every
extension the compiler may use in it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
DEFAULT_OUT = Path(__file__).resolve().parent / "lib"
MANIFEST = "manifest.json"

_V2 = ("sse4_1", "sse4_2", "ssse3", "popcnt", "cx16", "lahf_lm")
_V3 = (*_V2, "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass(frozen=True)
class Variant:
    """One x86 level: name, its compiler flags, and the /proc/cpuinfo flags a CPU needs to run it."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]


# Lowest first; the loader takes the last one the CPU runs.
X86_VARIANTS = (
    Variant("generic", ("-march=x86-64", "-mtune=generic"), ()),
    Variant("x86-64-v3", ("-march=x86-64-v3", "-mtune=generic"), _V3),  # Haswell, Zen 1-3: AVX2 + FMA
    Variant("avx512", ("-march=x86-64-v4", "-mtune=generic"), _V4),  # Skylake-X: AVX-512 F/BW/CD/DQ/VL
    Variant("avx512_bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=generic"),
            (*_V4, "avx512_bf16", "avx512_vnni")),  # Cooper Lake, Zen 4
    # Sapphire Rapids: its ISA (AVX512-FP16 and the AMX tile extensions enabled) and tuning
    Variant("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512fp16", "-mamx-tile",
                    "-mamx-bf16", "-mamx-int8", "-mtune=sapphirerapids"),
            (*_V4, "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")),
)
OTHER_VARIANTS = (Variant("generic", (), ()),)  # not x86: the compiler's default target


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants built on (and for) a `machine` (platform.machine(), e.g. x86_64)."""
    machine = machine or platform.machine()
    return X86_VARIANTS if machine.lower() in ("x86_64", "amd64") else OTHER_VARIANTS


@dataclass(frozen=True)
class Library:
    """A shared library: its sources (in csrc/), compile flags and link flags.

    -ffast-math is a compile flag only: linking with it adds crtfastmath.o, whose constructor
    sets the FTZ/DAZ bits of the whole process when the library loads. The attention library's
    -ffast-math lets gcc vectorize expf through glibc's libmvec (finite inputs only: the cache
    holds finite values everywhere); the GGUF matmul's -ffp-contract=off keeps d * q + m and the
    sums as written. -fopenmp: the libraries' libgomp.so.1 is, by soname, the one torch loaded,
    so their parallel regions reuse torch's OpenMP team."""

    sources: tuple[str, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]


_ATTENTION = (("attention.c", "prefill.c", "prefill_amx.c", "layernorm.c", "activation.c"),
              ("-O3", "-fopenmp", "-ffast-math"), ("-fopenmp", "-lmvec", "-lm"))
LIBRARIES = {
    "attention": Library(*_ATTENTION),
    "attention_bf16": Library(_ATTENTION[0], (*_ATTENTION[1], "-DKVP_BF16"), _ATTENTION[2]),
    "bf16_gemm": Library(("bf16_gemm.c",), ("-O3", "-fopenmp"), ("-fopenmp",)),
    "gguf": Library(("gguf.c", "gguf_amx.c"), ("-O3", "-ffp-contract=off", "-fopenmp", "-pthread"), ("-fopenmp", "-pthread")),
    "decode_stack": Library(("decode_stack.c",), ("-O3",), ()),
    "threads": Library(("threads.c",), ("-O2", "-fopenmp"), ("-fopenmp",)),
    "decode_stack_bf16": Library(("decode_stack.c",), ("-O3", "-DKVP_BF16"), ()),
    "sample": Library(("sample.c",), ("-O3", "-fopenmp"), ("-fopenmp", "-lm")),  # no -ffast-math: -inf logits
}


class BuildError(RuntimeError):
    """A kernel library did not compile; the message holds the command and the compiler's output."""


def library_path(out: Path, variant: str, library: str) -> Path:
    """Where the build writes a library: out/VARIANT/libkvp_LIBRARY.so (the loader reads the same path)."""
    return out / variant / f"libkvp_{library}.so"


def compiler() -> str:
    """$CC, else cc. Raises BuildError where it is not on PATH."""
    name = os.environ.get("CC", "cc")
    path = shutil.which(name)
    if path is None:
        raise BuildError(f"building kvpilot's CPU kernels needs a C compiler: {name!r} is not on PATH "
                         "(install gcc, e.g. apt-get install gcc libc6-dev, or set CC)")
    return path


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise BuildError(f"kvpilot CPU kernel {what} failed to build:\n  {' '.join(cmd)}\n{proc.stderr.strip()}")


def _compile(cc: str, out: Path, variant: Variant, name: str, lib: Library) -> float:
    """Compiles each source to an object, then links them without the compile flags (so that
    -ffast-math never reaches the link step). Returns the seconds it took."""
    target = library_path(out, variant.name, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for source in lib.sources:
            objects.append(str(Path(tmp) / f"{Path(source).stem}.o"))
            _run([cc, "-c", "-fPIC", "-std=gnu11", "-Wall", "-Werror=implicit-function-declaration",
                  *variant.cflags, *lib.cflags, "-I", str(CSRC), str(CSRC / source), "-o", objects[-1]],
                 f"{name} ({variant.name})")
        built = Path(tmp) / target.name
        _run([cc, "-shared", *objects, "-o", str(built), *lib.ldflags], f"{name} ({variant.name})")
        os.replace(built, target)  # atomic: a process loading the old file never sees a half-written one
    return time.perf_counter() - start


def build_all(out: Path = DEFAULT_OUT, only: tuple[str, ...] = (), jobs: int | None = None) -> dict:
    """Compiles every library for every variant (or those named in `only`) into `out`, `jobs`
    compilers at a time (default: the CPU count), and writes `out/manifest.json`, which it
    returns. Raises BuildError with the compiler's message on the first failure."""
    cc = compiler()
    chosen = [v for v in variants() if not only or v.name in only]
    if only and len(chosen) != len(only):
        raise BuildError(f"unknown variant in {only}; known: {[v.name for v in variants()]}")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    start = time.perf_counter()
    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        futures = {(v.name, name): pool.submit(_compile, cc, out, v, name, lib)
                   for v in chosen for name, lib in LIBRARIES.items()}
        seconds = {key: f.result() for key, f in futures.items()}
    manifest = {"compiler": cc, "compiler_version": version[0] if version else "",
                "machine": platform.machine(), "libraries": sorted(LIBRARIES),
                "variants": {v.name: {"cflags": list(v.cflags), "cpu_flags": list(v.cpu_flags)} for v in chosen},
                "compile_s": {f"{v}/{n}": round(s, 3) for (v, n), s in seconds.items()},
                "wall_s": round(time.perf_counter() - start, 3)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    """`python -m kvpilot.kernels.cpu.build [--out DIR] [--variant NAME ...]`: rebuilds in place."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    parser.add_argument("--variant", action="append", default=[], help="build only this variant (repeatable)")
    parser.add_argument("--jobs", type=int, default=None, help="compilers at a time (default: CPU count)")
    args = parser.parse_args(argv)
    try:
        manifest = build_all(args.out, tuple(args.variant), args.jobs)
    except BuildError as e:
        print(e)
        return 1
    print(f"{len(manifest['compile_s'])} libraries ({len(manifest['variants'])} variants x "
          f"{len(manifest['libraries'])}) built by {manifest['compiler_version']} in {manifest['wall_s']:.1f} s "
          f"into {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
