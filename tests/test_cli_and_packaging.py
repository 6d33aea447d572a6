"""The `kvpilot` entry point and the package layout promised by pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kvpilot(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpilot.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    for name, folder in cfg["package-dir"].items():
        assert (ROOT / folder / "__init__.py").is_file(), folder
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            package = ".".join([name, *rel.parts]) if rel.parts else name
            assert package in listed, f"{package} ({init.parent}) is missing from pyproject's packages"
    assert not (ROOT / "operator.py").exists()
    import operator

    assert hasattr(operator, "itemgetter"), "Python's operator module must not be shadowed"


def test_usage_names_every_command_and_every_command_loads():
    """`kvpilot --help` (cli/main.py's docstring) lists each routed command, and each route names a
    module with a `main`: a command added to the table without a line, or a module moved without
    updating its route, fails here."""
    import importlib

    from kvpilot.cli import main as cli

    usage = cli.__doc__
    for name, module in cli.COMMANDS.items():
        assert f"    kvpilot {name}" in usage, name
        assert callable(importlib.import_module(module).main), module
    for name, module in cli.BENCH_COMMANDS.items():
        assert f"    kvpilot bench {name}" in usage, name
        assert callable(importlib.import_module(module).main), module


def test_unknown_commands_exit_2_with_usage():
    r = kvpilot("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr and "usage" in r.stderr
    r = kvpilot("bench")
    assert r.returncode == 2 and "choose a benchmark" in r.stderr
    r = kvpilot("bench", "throughput", "--num-prompts", "0")
    assert r.returncode == 2 and "--num-prompts must be >= 1" in r.stderr


def test_demo_chats_with_the_builtin_model():
    r = kvpilot("demo", "--no-tune", "--num-prompts", "2", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 requests in" in r.stdout and "output tok/s" in r.stdout
