"""Kernel tests run on the CPU through Triton's interpreter; the variable must be set
before triton is first imported, which is why it is set here, at collection time."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def seed(request) -> int:
    """A fresh random seed per test (KVPILOT_TEST_SEED=<n> replays one); it is printed in
    the report of a failing test."""
    env = os.environ.get("KVPILOT_TEST_SEED")
    value = int(env) if env else random.SystemRandom().randrange(2**31)
    torch.manual_seed(value)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("seed", f"replay with KVPILOT_TEST_SEED={value}"))
