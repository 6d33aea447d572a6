"""The images the tests' real node runs, moved from podman's store into containerd's: the
project's images (`make images`) under the names the chart and the operator give them, and the
pod sandbox image (tests/kube/pause/, built here). Each import is skipped when containerd holds
the same image ID already, so a 6 GB engine image is copied once per build, not once per run."""
from __future__ import annotations

import hashlib
import pathlib
import shutil
import subprocess

from .containerd import Containerd
from .podman import PODMAN, podman

PAUSE_IMAGE = "localhost/kvpilot/pause:1"


def build_pause(workdir: pathlib.Path) -> str:
    """Builds the sandbox image (a static `pause`, tests/kube/pause/pause.c) into podman's store;
    its name."""
    context = workdir / "pause"
    context.mkdir(parents=True, exist_ok=True)
    source = pathlib.Path(__file__).with_name("pause")
    subprocess.run([shutil.which("cc") or "gcc", "-static", "-Os", "-Wall", "-Wextra", "-Werror", "-o",
                    str(context / "pause"), str(source / "pause.c")], check=True, capture_output=True, timeout=120)
    podman("build", "--quiet", "-t", PAUSE_IMAGE, "-f", str(source / "Containerfile"), str(context), timeout=600)
    return PAUSE_IMAGE


def import_image(containerd: Containerd, local: str, names: tuple[str, ...]) -> bool:
    """Copies podman's image `local` into containerd as each of `names` (unpacked for the
    overlayfs snapshotter); False when containerd had that image ID under those names already."""
    image_id = podman("image", "inspect", "--format", "{{.Id}}", local).stdout.strip()
    stamp = containerd.root.parent / "imported" / hashlib.sha256(" ".join(names).encode()).hexdigest()[:16]
    if stamp.exists() and stamp.read_text() == image_id and set(names) <= containerd.images():
        return False
    save = subprocess.Popen([str(PODMAN), "save", "--format", "docker-archive", local], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        imported = containerd.ctr("images", "import", "-", stdin=save.stdout, timeout=1800)
    finally:
        assert save.stdout is not None
        save.stdout.close()
        _, err = save.communicate(timeout=60)
    assert save.returncode == 0, f"podman save {local} failed: {err.decode(errors='replace')[-3000:]}"
    # docker-archive names the image by its podman tag; the digest line names it either way
    source = next(line.split()[1] for line in imported.stdout.splitlines() if line.startswith("unpacking"))
    for name in names:
        containerd.ctr("images", "tag", "--force", source, name)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(image_id)
    return True
