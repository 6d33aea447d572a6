"""Makes tests/tuner's helpers (synthetic engine, Prometheus, engine bridge) and tests/kube importable."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: the `kube` package


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _cpu_without_bf16_matmul_kernel(monkeypatch):
    """The feasibility model's arithmetic does not depend on the machine running the tests: it
    models a CPU without AVX512_BF16 unless a test says otherwise (the kernel of
    engine/layers/bf16_gemm.py adds a third embedding copy in bf16; tested explicitly)."""
    from kvpilot.tuner.search import feasibility

    monkeypatch.setattr(feasibility, "has_bf16_matmul_kernel", lambda cpu: False)
