"""Kernel tests run on the CPU through Triton's interpreter. TRITON_INTERPRET must be set
before the kernels are decorated (when kvpilot.kernels.* is first imported), which is why
it is set here, at collection time."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _kernels_are_interpreted():
    """Fails with the cause, rather than with 'needs CUDA' in every test, when something
    imported the kernels before this conftest set TRITON_INTERPRET."""
    from kvpilot.kernels._common import is_interpreted
    from kvpilot.kernels.decode_attention import _decode_split_kernel

    if not torch.cuda.is_available() and not is_interpreted(_decode_split_kernel):
        pytest.fail("kvpilot.kernels was imported before TRITON_INTERPRET=1 was set; set it in "
                    "the environment or in a conftest.py that runs earlier")


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


@pytest.fixture(autouse=True)
def _no_planned_width():
    """Each kernel test partitions decode attention by torch's thread count (what it sets or
    patches), not by the width an engine built earlier in the session planned."""
    from kvpilot.kernels.cpu import threads

    saved = list(threads._width)
    threads._width.clear()
    yield
    threads._width[:] = saved
