"""Makes tests/tuner's helpers (synthetic engine, Prometheus, engine bridge) and tests/cluster importable."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: the `cluster` package
