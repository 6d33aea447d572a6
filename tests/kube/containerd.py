"""containerd for the tests' real node (tests/kube/node.py): Debian's containerd 1.6 with runc
and the CNI bridge plugin, on a socket and state directory of its own; its root (images and
unpacked snapshots) is kept under the cache between sessions, so that the project's images are
imported once per image ID. Images come from podman's store (`podman save`, then `ctr images
import`), as no registry is reachable. Source: containerd 1.6 docs/cri/config.md, and kind's
node image, which runs the same pieces."""
from __future__ import annotations

import os
import pathlib
import shutil
import string
import subprocess

from .processes import Process
from .tools import wait_for

HERE = pathlib.Path(__file__).resolve().parent
NAMESPACE = "k8s.io"  # the containerd namespace the CRI plugin keeps the kubelet's images and containers in


def cache_dir() -> pathlib.Path:
    """$KVPILOT_CACHE/node (default ~/.cache/kvpilot/node): the node's kept state."""
    root = os.environ.get("KVPILOT_CACHE") or pathlib.Path.home() / ".cache" / "kvpilot"
    return pathlib.Path(root) / "node"


def render(template: str, path: pathlib.Path, **values: str) -> pathlib.Path:
    """Writes tests/kube/<template> to path with ${name} replaced by values."""
    path.write_text(string.Template((HERE / template).read_text()).substitute(values))
    return path


class Containerd:
    """`containerd.start()` runs containerd; `endpoint` is its CRI endpoint for the kubelet;
    `ctr(...)` runs ctr against it in the k8s.io namespace."""

    def __init__(self, workdir: pathlib.Path, sandbox_image: str, cni_conf_dir: pathlib.Path):
        self.workdir = workdir
        self.root = cache_dir() / "containerd"
        self.state = workdir / "containerd"  # short: it holds the sockets (108-byte path limit)
        self.sandbox_image = sandbox_image
        self.cni_conf_dir = cni_conf_dir
        self.process: Process | None = None

    @property
    def socket(self) -> pathlib.Path:
        return self.state / "containerd.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.state.mkdir(parents=True, exist_ok=True)
        config = render("containerd.toml", self.workdir / "containerd.toml", root=str(self.root),
                        state=str(self.state), sandbox_image=self.sandbox_image,
                        runc=shutil.which("runc") or "/usr/sbin/runc", cni_bin_dir="/usr/lib/cni",
                        cni_conf_dir=str(self.cni_conf_dir))
        self.process = Process("containerd", ["containerd", "--config", str(config), "--log-level", "warn"],
                               self.workdir / "containerd.log")

        def up() -> bool:
            assert self.process is not None
            self.process.check()
            return self.socket.exists() and self.ctr("version", check=False).returncode == 0
        wait_for(up, 60, what="containerd's socket")

    def ctr(self, *args: str, check: bool = True, timeout: float = 120,
            stdin: int | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run(["ctr", "--address", str(self.socket), "--namespace", NAMESPACE, *args],
                                capture_output=True, text=True, timeout=timeout, stdin=stdin)
        if check and result.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)} failed ({result.returncode}): {result.stderr[-3000:]}")
        return result

    def images(self) -> set[str]:
        """The names of the images in the k8s.io namespace."""
        return set(self.ctr("images", "list", "--quiet").stdout.split())

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
