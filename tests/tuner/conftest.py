"""Makes tests/tuner's helpers importable (synthetic runner, fake servers)."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
