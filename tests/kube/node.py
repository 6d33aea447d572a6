"""A real node for the tests (issue 31, item 3): the kubelet and kube-proxy built with the
control plane (controlplane/), Debian's containerd 1.6 with runc, and a CNI bridge, on this
machine. Pods get addresses on their own bridge (`kvpilot0`, 10.245.0.0/24); the node and the
API server listen on the bridge's gateway address, so the pods reach the API server through the
`kubernetes` Service as on any cluster and nothing listens on the machine's own network.
CoreDNS, built beside them, serves cluster.local on that address as the cluster's DNS add-on,
and kube-network-policies (built into the control plane binary) enforces NetworkPolicies, which
the bridge plugin alone ignores. Probes, pod IPs, Services (kube-proxy's iptables rules), DNS
names, NetworkPolicies, `kubectl logs` and `kubectl port-forward` are the real thing.

One node per machine at a time (a file lock): the bridge, the kubelet's cgroups and
kube-proxy's iptables chains are the machine's. What a killed session left (pods in containerd,
the bridge, iptables chains) is removed when the next one starts. Needs root.
Sources: the kubelet's and kube-proxy's command-line references, kubeadm's and kind's node
setups, the CNI bridge plugin's documentation."""
from __future__ import annotations

import contextlib
import fcntl
import json
import pathlib
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .containerd import Containerd, cache_dir, render
from .node_images import build_pause, import_image
from .processes import Process, Started
from .tools import free_port, wait_for

if TYPE_CHECKING:
    from .controlplane import ControlPlane

BRIDGE = "kvpilot0"
POD_CIDR = "10.245.0.0/24"
NODE_IP = "10.245.0.1"  # the bridge's address: the node's InternalIP and the API server's address
NODE_NAME = "kvpilot-node-0"
READY_TIMEOUT_S = 180
COREDNS_USER = "system:kvpilot:coredns"
NETWORK_POLICIES_USER = "system:kvpilot:kube-network-policies"
NFQUEUE_ID = 100  # the queue kube-network-policies reads the first packet of each connection from
BRIDGE_NF_CALL_IPTABLES = pathlib.Path("/proc/sys/net/bridge/bridge-nf-call-iptables")  # br_netfilter's
# The kubelet's static CPU manager (kubelet-config.yaml: kubeReserved cpu 100m) reserves ceil(100m)
# = 1 CPU, taken by topology from the lowest-numbered: never given to a container of its own.
RESERVED_CPUS = frozenset({0})
NETNS_DIR = pathlib.Path("/run/netns")  # where containerd's CRI mounts each pod's network namespace


def coredns_rbac() -> list[tuple[str, dict]]:
    """(plural, object) of the ClusterRole and binding CoreDNS's deployment manifests
    (coredns/deployment, kubernetes/coredns.yaml.sed) give it, bound to COREDNS_USER."""
    return cluster_role(COREDNS_USER, [
        {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"], "verbs": ["list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}])


def network_policies_rbac() -> list[tuple[str, dict]]:
    """(plural, object) of the ClusterRole and binding kube-network-policies' install.yaml gives
    it (pods, namespaces and NetworkPolicies: list, watch), bound to NETWORK_POLICIES_USER."""
    return cluster_role(NETWORK_POLICIES_USER, [
        {"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["list", "watch"]},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["list", "watch"]}])


def cluster_role(user: str, rules: list[dict]) -> list[tuple[str, dict]]:
    """(plural, object) of a ClusterRole named `user` with `rules`, and its binding to `user`."""
    meta = {"name": user}
    return [("clusterroles", {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                              "metadata": meta, "rules": rules}),
            ("clusterrolebindings", {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                                     "metadata": meta, "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                                   "kind": "ClusterRole", "name": meta["name"]},
                                     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                                   "name": user}]})]


def install() -> None:
    """containerd, runc, the CNI plugins, iptables and conntrack from Debian where missing."""
    subprocess.run(["bash", str(pathlib.Path(__file__).with_name("install-node.sh"))], check=True, timeout=900)


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """Held while a node runs: a second session waits for the first to finish."""
    path = cache_dir() / "node.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def share_netns_dir(path: pathlib.Path = NETNS_DIR) -> None:
    """Makes /run/netns a shared mount of itself, as `ip netns add` and podman do when they find
    it a plain directory. Done before containerd mounts the pods' network namespaces there: one
    of them doing it while the node runs would cover those mounts, and containerd could no longer
    remove them (unlinkat: device or resource busy), every deleted pod left Terminating with its
    CPU request held. Left in place at the end, as they leave it."""
    path.mkdir(parents=True, exist_ok=True)
    points = {line.split()[4] for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines()}
    if str(path) not in points:  # os.path.ismount misses a bind mount of a directory onto itself
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True, timeout=30)
    subprocess.run(["mount", "--make-shared", str(path)], check=True, timeout=30)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@contextlib.contextmanager
def bridge() -> Iterator[str]:
    """The pods' bridge with the node's address on it, made before the API server starts (which
    listens there); the CNI bridge plugin finds it and attaches each pod to it. Yields NODE_IP."""
    ip("link", "delete", BRIDGE, check=False)  # a killed session's
    ip("link", "add", BRIDGE, "type", "bridge")
    try:
        ip("addr", "add", f"{NODE_IP}/{POD_CIDR.split('/')[1]}", "dev", BRIDGE)
        ip("link", "set", BRIDGE, "up")
        yield NODE_IP
    finally:
        ip("link", "delete", BRIDGE, check=False)


class Node(Started):
    """`with Node(control_plane, workdir, images) as node:` runs containerd, the kubelet and
    kube-proxy until the node is Ready. `images` maps a podman image to the names containerd
    gives it (the references the pods use, e.g. docker.io/kvpilot/engine-cpu:0.1.0). Leaving the
    block deletes every pod, stops the processes and removes what they set up."""

    def __init__(self, control_plane: ControlPlane, workdir: pathlib.Path,
                 images: dict[str, tuple[str, ...]] | None = None):
        self.control_plane = control_plane
        self.workdir = pathlib.Path(workdir)
        self.images = images or {}
        self.processes: list[Process] = []
        self.cni_dir = self.workdir / "cni"
        self.kubelet_dir = self.workdir / "kubelet"
        self.containerd: Containerd | None = None
        self.imported: list[str] = []
        self.network_policies_metrics = ""  # host:port of kube-network-policies' /metrics

    @property
    def binary(self) -> pathlib.Path:
        assert self.control_plane.binary is not None
        return self.control_plane.binary

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cni_dir.mkdir(exist_ok=True)
        render("cni.conflist", self.cni_dir / "10-kvpilot.conflist", bridge=BRIDGE, pod_cidr=POD_CIDR,
               gateway=NODE_IP, ipam_dir=str(self.workdir / "ipam"))
        share_netns_dir()
        self.containerd = Containerd(self.workdir, build_pause(self.workdir), self.cni_dir)
        self.containerd.start()
        self._clean_runtime()  # what a killed session left in the kept root
        import_image(self.containerd, self.containerd.sandbox_image, (self.containerd.sandbox_image,))
        for local, names in self.images.items():
            if import_image(self.containerd, local, names):
                self.imported.append(local)
        self._proxy("--cleanup", wait=True)  # a killed session's iptables chains
        remove_kube_chains()
        self._run("kube-network-policies", "--cleanup", wait=True)  # a killed session's nftables table
        self._start_dns()
        self._start_kubelet()
        self._start_proxy()
        self._start_network_policies()

    def _kubeconfig(self, stem: str, common_name: str, organization: str | None = None) -> pathlib.Path:
        return self.control_plane._write_kubeconfig(stem, self.control_plane.authority.issue(
            stem, common_name, organization))

    def _start_dns(self) -> None:
        """CoreDNS (built beside the control plane) on the node's address, as the cluster's DNS
        add-on: Service and pod names under cluster.local, the rest forwarded to the machine's
        resolver. Its identity gets the read access CoreDNS's own manifests grant."""
        self._grant(coredns_rbac())
        kubeconfig = self._kubeconfig("coredns", COREDNS_USER)
        ready_port = free_port()
        corefile = render("Corefile", self.workdir / "Corefile", node_ip=NODE_IP, kubeconfig=str(kubeconfig),
                          ready_port=str(ready_port), health_port=str(free_port()))
        process = Process("coredns", [str(self.binary.parent / "coredns"), "-conf", str(corefile)],
                          self.workdir / "coredns.log")
        self.processes.append(process)

        def ready() -> bool:  # the kubernetes plugin has synced its caches
            process.check()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ready_port}/ready", timeout=2) as reply:
                    return reply.status == 200
            except OSError:
                return False
        wait_for(ready, 60, what="CoreDNS ready")

    def _grant(self, rbac: list[tuple[str, dict]]) -> None:
        for kind, body in rbac:
            with contextlib.suppress(urllib.error.HTTPError):  # 409: a rerun on the same API server
                self.control_plane.api("POST", f"/apis/rbac.authorization.k8s.io/v1/{kind}", body)

    def _start_kubelet(self) -> None:
        ca = self.control_plane.authority
        serving = ca.issue("kubelet-serving", f"system:node:{NODE_NAME}", "system:nodes",
                           server_names=(NODE_IP, NODE_NAME))
        assert self.containerd is not None
        config = render("kubelet-config.yaml", self.workdir / "kubelet-config.yaml", node_ip=NODE_IP,
                        port=str(free_port()), healthz_port=str(free_port()), tls_cert=str(serving.cert),
                        tls_key=str(serving.key), client_ca=str(self.control_plane.ca.cert),
                        runtime_endpoint=self.containerd.endpoint, pod_cidr=POD_CIDR)
        kubeconfig = self._kubeconfig("kubelet", f"system:node:{NODE_NAME}", "system:nodes")
        process = self._run("kubelet", f"--config={config}", f"--kubeconfig={kubeconfig}",
                            f"--root-dir={self.kubelet_dir}", f"--cert-dir={self.workdir / 'kubelet-pki'}",
                            f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}",
                            f"--node-labels=kvpilot.dev/test-node=real", "--v=1")

        def ready() -> bool:
            process.check()
            node = json.loads(self.control_plane.get(f"/api/v1/nodes/{NODE_NAME}", quiet=True) or "{}")
            conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
            return conditions.get("Ready") == "True"
        wait_for(ready, READY_TIMEOUT_S, what=f"the kubelet to make {NODE_NAME} Ready")

    def _proxy_args(self) -> list[str]:
        kubeconfig = self.control_plane.workdir / "kube-proxy.kubeconfig"
        if not kubeconfig.exists():
            kubeconfig = self._kubeconfig("kube-proxy", "system:kube-proxy")
        return [f"--kubeconfig={kubeconfig}", f"--hostname-override={NODE_NAME}", "--proxy-mode=iptables",
                f"--cluster-cidr={POD_CIDR}", f"--healthz-bind-address=127.0.0.1:{free_port()}",
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                "--conntrack-max-per-core=0"]  # leave the machine's conntrack table size alone, as kind does

    def _proxy(self, *args: str, wait: bool = False) -> Process:
        return self._run("kube-proxy", *self._proxy_args(), *args, wait=wait)

    def _start_proxy(self) -> None:
        process = self._proxy()

        def synced() -> bool:  # the rules of the `kubernetes` Service are in place
            process.check()
            rules = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True, timeout=30).stdout
            return "default/kubernetes:https" in rules
        wait_for(synced, 60, what="kube-proxy's rules for the kubernetes Service")

    def _start_network_policies(self) -> None:
        """kube-network-policies with its own identity and install.yaml's read access; ready once
        it has synced its informers, written its nftables table and bound NFQUEUE_ID. Pod-to-pod
        packets on the bridge pass the inet hooks it uses only through br_netfilter, which
        kube-proxy needs as well: bridge-nf-call-iptables is set here where it is off (without
        br_netfilter the node runs, and the NetworkPolicy test says why it fails)."""
        if BRIDGE_NF_CALL_IPTABLES.exists() and BRIDGE_NF_CALL_IPTABLES.read_text().strip() != "1":
            BRIDGE_NF_CALL_IPTABLES.write_text("1")
        self._grant(network_policies_rbac())
        kubeconfig = self._kubeconfig("kube-network-policies", NETWORK_POLICIES_USER)
        self.network_policies_metrics = f"127.0.0.1:{free_port()}"
        process = self._run("kube-network-policies", f"--kubeconfig={kubeconfig}", f"--hostname-override={NODE_NAME}",
                            f"--nfqueue-id={NFQUEUE_ID}", f"--metrics-bind-address={self.network_policies_metrics}",
                            "--v=1")

        def bound() -> bool:  # /proc/net/netfilter/nfnetlink_queue: one line per bound queue, its number first
            process.check()
            queues = pathlib.Path("/proc/net/netfilter/nfnetlink_queue").read_text().split("\n")
            return any(line.split()[:1] == [str(NFQUEUE_ID)] for line in queues)
        wait_for(bound, 60, what=f"kube-network-policies to bind NFQUEUE {NFQUEUE_ID}")

    def _run(self, name: str, *args: str, wait: bool = False) -> Process:
        """Component `name` of the control plane binary; with wait, a one-shot run (--cleanup)
        that has exited when this returns."""
        process = Process(name, [str(self.binary), name, *args], self.workdir / f"{name}.log")
        self.processes.append(process)
        if wait:
            process.proc.wait(60)
            self.processes.remove(process)
        return process

    def _clean_runtime(self) -> None:
        if self.containerd is not None and self.containerd.socket.exists():
            subprocess.run([str(self.binary), "cri-clean", f"--endpoint={self.containerd.endpoint}"],
                           capture_output=True, text=True, timeout=300)

    def _delete_pods(self) -> None:
        """Every pod on the node, deleted through the API server, so the kubelet stops each
        container and tears its volumes and network down."""
        path = f"/api/v1/pods?fieldSelector=spec.nodeName%3D{NODE_NAME}"
        try:
            pods = json.loads(self.control_plane.get(path))["items"]
            for pod in pods:
                meta = pod["metadata"]
                self.control_plane.api("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                       {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 5})
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and json.loads(self.control_plane.get(path))["items"]:
                time.sleep(0.5)
        except OSError:  # the API server is gone: cri-clean below does it
            pass

    def stop(self) -> None:
        """Deletes the pods, stops kube-proxy and the kubelet, removes what remains in containerd,
        stops it, unmounts the kubelet's volumes and removes the iptables chains."""
        if any(p.name == "kubelet" and p.alive() for p in self.processes):
            self._delete_pods()
        while self.processes:
            self.processes.pop().stop()
        self._clean_runtime()
        if self.containerd is not None:
            self.containerd.stop()
        self._unmount(self.kubelet_dir)
        self._unmount(self.workdir / "containerd")
        with contextlib.suppress(Exception):
            if self.control_plane.binary is not None:
                self._proxy("--cleanup", wait=True)
                self._run("kube-network-policies", "--cleanup", wait=True)
        remove_kube_chains()

    @staticmethod
    def _unmount(under: pathlib.Path) -> None:
        """Unmounts whatever is still mounted below `under`, deepest first."""
        top = str(under.resolve())
        mounts = [line.split()[1] for line in pathlib.Path("/proc/self/mounts").read_text().splitlines()]
        # the kubelet bind-mounts its root directory onto itself (to make it shared): that one too
        for point in sorted((m for m in mounts if m == top or m.startswith(top + "/")), key=len, reverse=True):
            subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=30)

    def node(self) -> dict:
        return json.loads(self.control_plane.get(f"/api/v1/nodes/{NODE_NAME}"))


def describe(node: dict) -> str:
    """One line: the node's versions and capacity, for the test log."""
    info, capacity = node["status"]["nodeInfo"], node["status"]["capacity"]
    return (f"node {node['metadata']['name']}: kubelet {info['kubeletVersion']}, {info['containerRuntimeVersion']}, "
            f"{info['osImage']}, kernel {info['kernelVersion']}, cpu {capacity['cpu']}, memory {capacity['memory']}")


def remove_kube_chains() -> None:
    """Removes the KUBE-* chains that `kube-proxy --cleanup` leaves (the kubelet's canary and
    hint chains) from every table, IPv4 and IPv6, with the rules that jump to them. No other
    Kubernetes runs on this machine, so every KUBE-* chain is one of this node's."""
    for save, tool in (("iptables-save", "iptables"), ("ip6tables-save", "ip6tables")):
        dump = subprocess.run([save], capture_output=True, text=True, timeout=30).stdout
        table, chains = "", []
        for line in dump.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":KUBE-"):
                chains.append((table, line[1:].split()[0]))
            elif line.startswith("-A ") and not line.startswith("-A KUBE-") and " -j KUBE-" in line:
                subprocess.run([tool, "-t", table, "-D", *shlex.split(line[3:])], capture_output=True, timeout=30)
        for table, chain in chains:
            subprocess.run([tool, "-t", table, "-F", chain], capture_output=True, timeout=30)
        for table, chain in chains:
            subprocess.run([tool, "-t", table, "-X", chain], capture_output=True, timeout=30)
