"""Makes tests/cluster importable as `cluster` and provides the `cluster` fixture."""
from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from cluster.harness import TestCluster  # noqa: E402


@pytest.fixture
def cluster(tmp_path: pathlib.Path):
    with TestCluster(tmp_path) as running:
        yield running
