"""podman as the image tests call it: images/podman.sh (the project's storage and runtime
settings), and the version the images are tagged with."""
from __future__ import annotations

import subprocess
import tomllib

from .tools import ROOT

PODMAN = ROOT / "images" / "podman.sh"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def podman(*args: str, check: bool = True, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """images/podman.sh ARGS (podman with the project's storage and runtime settings)."""
    result = subprocess.run([str(PODMAN), *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({result.returncode}): {result.stderr[-4000:]}")
    return result
