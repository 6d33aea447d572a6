"""Cut one process off from the API server with iptables, as a network partition between a
node and the control plane would: the process runs in a cgroup v2 group of its own (as a
pod's containers run in the pod's cgroup) and an OUTPUT rule drops every packet that sockets
of that group send to the API server's port (`-m cgroup --path`, xt_cgroup). The socket's
group is fixed when the socket is created, so the process must start in it (`group()`, then
Operator.cgroup): moved there later, its pooled connections would still pass. Packets are
dropped, not refused: open connections and watches hang as they do behind a dead link, and
new ones time out. Every other process (the standby, the controllers) still gets through.
Needs root. Source: iptables-extensions(8), "cgroup"; cgroups(7).
"""
from __future__ import annotations

import contextlib
import pathlib
import subprocess
from collections.abc import Iterator


def cgroup2_root() -> pathlib.Path:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup/unified on a hybrid host)."""
    for line in pathlib.Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return pathlib.Path(fields[1])
    raise RuntimeError("no cgroup2 hierarchy is mounted")


def group(name: str) -> pathlib.Path:
    """A cgroup v2 group (created if missing) for a process to start in."""
    path = cgroup2_root() / name
    path.mkdir(exist_ok=True)
    return path


def remove(path: pathlib.Path) -> None:
    """Remove the group once its processes have exited."""
    with contextlib.suppress(FileNotFoundError):
        path.rmdir()


@contextlib.contextmanager
def cut_off(path: pathlib.Path, port: int, address: str = "127.0.0.1") -> Iterator[None]:
    """While the block runs, packets from the sockets of group `path` to address:port are
    dropped; the rule goes at the end. Raises subprocess.CalledProcessError when iptables
    refuses the rule."""
    rule = ["OUTPUT", "-p", "tcp", "-d", address, "--dport", str(port),
            "-m", "cgroup", "--path", str(path.relative_to(cgroup2_root())), "-j", "DROP"]
    subprocess.run(["iptables", "-I", *rule], check=True)
    try:
        yield
    finally:
        subprocess.run(["iptables", "-D", *rule], check=True)
