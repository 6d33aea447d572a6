"""Fixtures for the image tests: podman (installed by images/install-podman.sh, as `make test`
does) and the images that `make images` builds, built once per session into podman's storage
under ~/.cache/kvpilot-images (KVPILOT_IMAGES_DIR), so that reruns reuse the base image and the
cached layers."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kube.tools import ROOT  # noqa: E402
from podman_tools import VERSION, podman  # noqa: E402


@pytest.fixture(scope="session")
def container_engine() -> str:
    """Installs podman where missing; skips (with the reason) only where it cannot be installed."""
    install = subprocess.run(["bash", str(ROOT / "images" / "install-podman.sh")], capture_output=True,
                             text=True, timeout=900)
    if shutil.which("podman") is None:
        pytest.skip(f"no container engine: podman could not be installed here ({install.stderr.strip()[-500:]})")
    assert install.returncode == 0, install.stderr
    return "podman"


@pytest.fixture(scope="session")
def images(container_engine: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`make images`' default targets, built (or found up to date in the layer cache): target -> tag."""
    log = tmp_path_factory.mktemp("images") / "build.log"
    with log.open("w") as out:
        result = subprocess.run(["make", "-C", str(ROOT), "images"], stdout=out, stderr=subprocess.STDOUT,
                                timeout=3000)
    assert result.returncode == 0, f"make images failed:\n{log.read_text()[-6000:]}"
    tags = {t: f"kvpilot/{t}:{VERSION}" for t in ("engine-cpu", "operator")}
    for tag in tags.values():
        podman("image", "exists", tag)
    return tags
