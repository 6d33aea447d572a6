"""Prints one image's Python requirements, one per line, taken from pyproject.toml so that
versions live in one place: `python3 images/requirements.py engine|engine-cuda|operator [pyproject.toml]`.

engine:   the project's dependencies (torch is installed before, from the build's torch index).
engine-cuda: the same plus the `triton` extra (the Triton attention kernels, the CUDA default).
operator: the operator and the tuner: the `operator` and `tuner` extras plus the few core
          dependencies they import; never torch, transformers or the model's libraries.
Runs on the build stage's bare Python 3.11 (tomllib), without the project installed.
"""
from __future__ import annotations

import re
import sys
import tomllib

# Core dependencies the operator and the tuner import (kvpilot.operator, kvpilot.tuner and the
# load library kvpilot.loadgen the tuner's trials drive: ijson and numpy read and sample the
# ShareGPT wheel, which images/Containerfile installs with --no-deps). Everything else in
# [project].dependencies is the engine's.
OPERATOR_CORE = ("numpy", "ijson", "rich", "tqdm", "prometheus-client", "httpx", "pyyaml", "packaging")
OPERATOR_EXTRAS = ("operator", "tuner")


def name_of(requirement: str) -> str:
    """'prometheus-client>=0.20' -> 'prometheus-client' (PEP 503 normalized)."""
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements(target: str, project: dict) -> list[str]:
    """The requirement strings of `target` ('engine', 'engine-cuda' or 'operator'). Raises
    ValueError for another target, or when a name in OPERATOR_CORE is missing from the
    dependencies."""
    core = list(project["dependencies"])
    engine = [r for r in core if name_of(r) != "torch"]
    if target == "engine":
        return engine
    if target == "engine-cuda":
        return engine + list(project["optional-dependencies"]["triton"])
    if target != "operator":
        raise ValueError(f"unknown image target {target!r}: engine, engine-cuda or operator")
    by_name = {name_of(r): r for r in core}
    missing = [n for n in OPERATOR_CORE if n not in by_name]
    if missing:
        raise ValueError(f"OPERATOR_CORE names {missing}, which pyproject.toml no longer lists")
    extras = [r for e in OPERATOR_EXTRAS for r in project["optional-dependencies"][e]]
    return [by_name[n] for n in OPERATOR_CORE] + extras


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[2] if len(argv) == 3 else "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    try:
        print("\n".join(requirements(argv[1], project)))
    except ValueError as e:
        print(f"images/requirements.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
