"""The engine's OpenMP threads: pinning them to CPUs (csrc/threads.c), as vLLM's CPU worker does
with `VLLM_CPU_OMP_THREADS_BIND`, and the planned width that decode attention partitions by.
engine/cpu/threads.py decides; this module only does it. Source: vLLM csrc/cpu/utils.cpp
`init_cpu_threads_env`.

The width: decode attention cuts long sequences into parts by its thread count
(csrc/attention.c `partition_tokens`), so its result depends on that count in the last bits.
The engine may run a decode step on fewer threads than it planned
(engine/cpu/thread_adapter.py); the kernels then partition by the planned width and run the
parts on the threads there are, and a step's result does not depend on how many ran it.
"""

from __future__ import annotations

import ctypes
import os

import torch

from kvpilot.kernels.cpu.loader import load

_width: list[int] = []  # the planned thread count, once the engine set it


def _lib() -> ctypes.CDLL:
    lib = load("threads")
    if not getattr(lib, "_kvp_ready", False):
        lib.kvp_bind_omp_threads.restype = ctypes.c_int
        lib.kvp_bind_omp_threads.argtypes = [ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]
        lib.kvp_omp_thread_cpus.restype = None
        lib.kvp_omp_thread_cpus.argtypes = [ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]
        lib._kvp_ready = True
    return lib


def bind_omp_threads(cpus: list[int]) -> None:
    """Makes the calling thread's OpenMP team len(cpus) threads and pins team thread i to cpus[i]
    (the caller, thread 0, to cpus[0]). Call it from the thread that runs the engine's steps,
    after torch.set_num_threads(len(cpus)).

    Raises ValueError for an empty list, OSError (with the errno) when the kernel refuses a CPU
    (one outside this process's cpuset), RuntimeError when the team came out smaller."""
    if not cpus:
        raise ValueError("bind_omp_threads needs at least one CPU")
    arr = (ctypes.c_int32 * len(cpus))(*cpus)
    code = _lib().kvp_bind_omp_threads(arr, len(cpus))
    if code > 0:
        raise OSError(code, f"cannot pin OpenMP threads to CPUs {cpus}: {os.strerror(code)}")
    if code < 0:
        raise RuntimeError(f"the OpenMP team came out smaller than the {len(cpus)} threads asked for")


def omp_thread_cpus(n: int) -> list[int]:
    """The CPU each thread of an n-thread team of the calling thread runs on right now."""
    arr = (ctypes.c_int32 * n)()
    _lib().kvp_omp_thread_cpus(arr, n)
    return list(arr)


def set_partition_width(threads: int) -> None:
    """The thread count decode attention partitions by from now on (the engine's plan)."""
    _width[:] = [max(1, threads)]


def partition_width() -> int:
    """The planned width where the engine set one, else torch's current thread count."""
    return _width[0] if _width else torch.get_num_threads()
