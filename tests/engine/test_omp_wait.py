"""The engine's OpenMP waiters spin GOMP_SPINCOUNT rounds, then sleep, unless the user chose a
wait policy; the setting reaches the engine's processes but not other programs'."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpilot.engine.cpu import omp_wait


@pytest.fixture
def state():
    saved = dict(omp_wait._state)
    yield
    omp_wait._state.update(saved)


def test_the_default_is_set_where_the_user_set_nothing(state):
    env = {}
    omp_wait.apply(env)
    assert env == {"GOMP_SPINCOUNT": str(omp_wait.SPINCOUNT)}
    assert omp_wait.without_default(env) == {}
    assert "came too late" in omp_wait.describe_wait_policy()  # torch is loaded in this test process


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}])
def test_the_users_wait_policy_wins(state, user):
    env = dict(user)
    omp_wait.apply(env)
    assert env == user
    assert "(set by the user)" in omp_wait.describe_wait_policy()
    assert omp_wait.without_default(env) == user


def test_an_engine_process_starts_with_the_wait_policy_and_says_so():
    """`kvpilot.engine` imported before torch (as `kvpilot serve` does): libgomp reads the value."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    script = ("import os, kvpilot.engine, torch; from kvpilot.engine.cpu.omp_wait import describe_wait_policy; "
              "print(os.environ['GOMP_SPINCOUNT'], describe_wait_policy())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    n = omp_wait.SPINCOUNT
    assert out.stdout.startswith(f"{n} waiting threads spin GOMP_SPINCOUNT={n} rounds"), out.stdout
    late = subprocess.run([sys.executable, "-c", script.replace("kvpilot.engine, torch", "torch, kvpilot.engine")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert "came too late" in late.stdout, late.stdout
