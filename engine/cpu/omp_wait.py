"""How the engine's OpenMP threads wait for work, set before torch loads libgomp.

A decode step crosses a few hundred OpenMP fork/join barriers (every matmul, attention and norm
of every layer is a parallel region of torch's or the C kernels' team: one libgomp, see
kernels/cpu/build.py). libgomp's waiting threads spin before they sleep on a futex: 300,000
rounds by default (GOMP_SPINCOUNT; libgomp's `env.c` takes it for ~3 ms, on recent x86 a round's
`pause` makes it longer). Alone, spinning saves the futex wake-up at each barrier. Beside a busy
neighbour (another pod with an equal CPU request, i.e. another cgroup of equal weight) it is a
collapse: when the neighbour holds one CPU, the engine thread behind it waits for a whole time
slice, and the engine's other thread spends the group's share spinning at the barrier instead of
giving its CPU up, so the kernel never moves the descheduled thread there. One thread's slice,
every barrier: 1.4 s per token instead of 10 ms (2-core Sapphire Rapids, DESIGN.md).

So a waiter spins only about as long as a barrier takes when every thread runs (tens of
microseconds), then sleeps: `GOMP_SPINCOUNT` below, measured in
benchmarks/results/shared_node. `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` set by the user win.
libgomp reads both once, when it loads (with torch), so `apply()` runs when `kvpilot.engine` is
first imported; where torch was imported earlier it is too late, and the start-up line says so.
Source: libgomp manual ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"); llama.cpp's `--poll` (spin, then
yield) for the same trade.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPINCOUNT_ENV = "GOMP_SPINCOUNT"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
# rounds of libgomp's spin (each a `pause`) before a waiting thread sleeps; chosen by
# `kvpilot bench shared-node` (benchmarks/results/shared_node/README.md): 1,000 until issue 49, when
# 3,000 beside the thread adapter kept the neighbour's figures (median ITL 10.2 against 11.0 ms, p95
# 15.6 against 15.9) and took a dense bf16 decode step of one sequence from 16.6 to 13.1 ms and 128
# ShareGPT requests at 64 at a time from 22.5 to 20.6 s (Sapphire Rapids, 2 cores); 10,000 missed
# the neighbour's p95 bound (5.3x alone)
SPINCOUNT = 3_000

_state = {"applied": False, "late": False, "user": ""}


def apply(environ: MutableMapping[str, str] | None = None) -> None:
    """Sets GOMP_SPINCOUNT for this process and its children unless the user chose a wait
    policy, and notes whether libgomp (torch) had loaded already."""
    environ = os.environ if environ is None else environ
    user = {k: environ[k] for k in (WAIT_POLICY_ENV, SPINCOUNT_ENV) if environ.get(k, "").strip()}
    if user == {SPINCOUNT_ENV: str(SPINCOUNT)}:
        user = {}  # inherited from a parent that applied this default
    if user:
        _state.update(applied=False, user=", ".join(f"{k}={v}" for k, v in user.items()))
        return
    environ[SPINCOUNT_ENV] = str(SPINCOUNT)
    _state.update(applied=True, late="torch" in sys.modules, user="")


def describe_wait_policy() -> str:
    """The start-up line's words for how threads wait."""
    if _state["user"]:
        return f"waiting threads: {_state['user']} (set by the user)"
    if _state["late"]:
        return (f"waiting threads: libgomp's defaults (torch loaded before kvpilot.engine, so {SPINCOUNT_ENV}="
                f"{SPINCOUNT} came too late; import kvpilot.engine first or set it in the environment)")
    if _state["applied"]:
        return f"waiting threads spin {SPINCOUNT_ENV}={SPINCOUNT} rounds, then sleep"
    return "waiting threads: libgomp's defaults"


def without_default(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment without the GOMP_SPINCOUNT that apply() set (the user's own
    stays): what another program (llama.cpp's OpenMP build, say) should start with."""
    env = dict(os.environ if environ is None else environ)
    if _state["applied"] and env.get(SPINCOUNT_ENV) == str(SPINCOUNT):
        del env[SPINCOUNT_ENV]
    return env
