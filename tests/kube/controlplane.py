"""A real Kubernetes control plane for the tests: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, each its own process of the binary that
controlplane/ builds from Go modules (`make controlplane`), plus kwok for fake nodes.

The API server runs with the flags controller-runtime's envtest gives it (secure port on
127.0.0.1, RBAC, a service-account key pair, client-certificate authentication), and with
ServiceAccount admission on, so the controller manager creates each namespace's token
controller objects as a cluster would. Source: sigs.k8s.io/controller-runtime
pkg/internal/testing/controlplane, and kubeadm's static pod manifests for the controller
manager and the scheduler."""
from __future__ import annotations

import base64
import json
import pathlib
import ssl
import subprocess
import time
import urllib.request
from typing import Any

import yaml

from .certs import Authority, Pair
from .processes import Process, Started
from .tools import free_port, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVICE_CIDR = "10.0.0.0/24"
START_TIMEOUT_S = 180  # a loaded 2-core machine takes tens of seconds to bring etcd and the API server up


def build() -> pathlib.Path:
    """The control plane binary, built by `make controlplane` when missing (minutes cold)."""
    out = subprocess.run(["make", "-s", "controlplane"], cwd=ROOT, check=True, stdout=subprocess.PIPE,
                         text=True).stdout
    return pathlib.Path(out.strip().splitlines()[-1])


def kubeconfig(server: str, ca: Pair, user: Pair | str, namespace: str = "default") -> dict[str, Any]:
    """A kubeconfig with the certificates inline (so it can be copied anywhere); `user` is a
    client certificate or a bearer token (a service account's)."""
    def inline(path: pathlib.Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()
    credentials = {"token": user} if isinstance(user, str) else {
        "client-certificate-data": inline(user.cert), "client-key-data": inline(user.key)}
    return {"apiVersion": "v1", "kind": "Config", "current-context": "kvpilot-test",
            "clusters": [{"name": "kvpilot-test", "cluster": {
                "server": server, "certificate-authority-data": inline(ca.cert)}}],
            "users": [{"name": "user", "user": credentials}],
            "contexts": [{"name": "kvpilot-test", "context": {
                "cluster": "kvpilot-test", "user": "user", "namespace": namespace}}]}


class ControlPlane(Started):
    """`with ControlPlane(workdir) as cp:` runs the control plane; `cp.kubeconfig` is the
    admin's kubeconfig (a system:masters client certificate), `cp.version` the API server's
    /version. Leaving the block stops every process it started."""

    def __init__(self, workdir: pathlib.Path, binary: pathlib.Path | None = None, kwok: bool = True,
                 audit: bool = False, address: str = "127.0.0.1", service_cidr: str = SERVICE_CIDR,
                 disable_qps_limits: bool = False):
        """kwok: run kwok and one fake node (pods become Running and Ready with no container);
        audit: write one audit event per request to `audit_log` (the operator benchmark's count);
        address: where the API server listens and what it advertises (the `kubernetes`
        Service's endpoint): loopback, unless pods of a real node (tests/kube/node.py) must
        reach it. service_cidr: the Services' ClusterIP range (a /24 holds 254 Services; the
        1,000-InferenceService benchmark needs a /20: "failed to allocate a serviceIP: range is full").
        disable_qps_limits: the controller manager's and the scheduler's clients unthrottled, as
        `kwokctl create cluster --disable-qps-limits` runs them for scale tests (--kube-api-qps
        5000, --kube-api-burst 10000; their defaults are 20/30 and 50/100 requests per second,
        which pace the rollouts of 1,000 Deployments; kwok's own client has no limit)."""
        self.workdir = pathlib.Path(workdir)
        self.service_cidr = service_cidr
        self.address = address
        self.binary = binary
        self.with_kwok = kwok
        self.client_limits = ["--kube-api-qps=5000", "--kube-api-burst=10000"] if disable_qps_limits else []
        self.audit_log = self.workdir / "audit.log" if audit else None
        self.processes: list[Process] = []
        self.port = free_port()
        self.url = f"https://{address}:{self.port}"
        self.version: dict[str, Any] = {}

    @property
    def bin_dir(self) -> pathlib.Path:
        """The folder with kubectl and helm at the server's version."""
        assert self.binary is not None
        return self.binary.parent

    def _start(self) -> None:
        self.binary = self.binary or build()
        pki = self.workdir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        ca = Authority(pki)
        serving = ca.issue("apiserver", "kube-apiserver", server_names=tuple(dict.fromkeys((
            "127.0.0.1", "localhost", self.address, "10.0.0.1", "10.0.2.2", "kubernetes", "kubernetes.default",
            "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"))))
        service_account = ca.service_account_keys()
        self.authority, self.ca = ca, ca.pair
        self.admin = ca.issue("admin", "kubernetes-admin", "system:masters")
        # the API server's client certificate for kubelets (logs, exec, port-forward), as kubeadm's
        # apiserver-kubelet-client; the kubelet authorizes it through a SubjectAccessReview
        self.kubelet_client = ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                       "system:masters")
        self.kubeconfig = self._write_kubeconfig("admin", self.admin)
        etcd_url = self._start_etcd()
        self._start_apiserver(etcd_url, serving, service_account)
        self._start_controller_manager(ca, service_account)
        self._start_scheduler(ca)
        if self.with_kwok:
            from .nodes import start_kwok
            start_kwok(self)

    def _write_kubeconfig(self, stem: str, user: Pair) -> pathlib.Path:
        path = self.workdir / f"{stem}.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig(self.url, self.ca, user)))
        path.chmod(0o600)
        return path

    def _run(self, name: str, *args: str, binary: pathlib.Path | None = None) -> Process:
        """Starts component `name` (a subcommand of the control plane binary, or `binary`)."""
        argv = [str(binary), *args] if binary else [str(self.binary), name, *args]
        process = Process(name, argv, self.workdir / f"{name}.log")
        self.processes.append(process)
        return process

    def _start_etcd(self) -> str:
        url = f"http://127.0.0.1:{free_port()}"
        self._run("etcd", f"--data-dir={self.workdir / 'etcd'}", f"--listen-client-url={url}",
                  f"--listen-peer-url=http://127.0.0.1:{free_port()}", "--unsafe-no-fsync")
        return url

    def _start_apiserver(self, etcd_url: str, serving: Pair, service_account: Pair) -> None:
        process = self._run(
            "kube-apiserver", f"--etcd-servers={etcd_url}", f"--cert-dir={self.workdir / 'apiserver'}",
            f"--bind-address={self.address}", f"--advertise-address={self.address}", f"--secure-port={self.port}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            # kubeadm's: the Node authorizer and NodeRestriction admission for kubelets' own requests
            f"--client-ca-file={self.ca.cert}", "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            "--enable-admission-plugins=NodeRestriction",
            f"--kubelet-client-certificate={self.kubelet_client.cert}",
            f"--kubelet-client-key={self.kubelet_client.key}", f"--kubelet-certificate-authority={self.ca.cert}",
            "--kubelet-preferred-address-types=InternalIP",
            # the front-proxy CA that the controller manager and scheduler read (kubeadm's flags)
            f"--requestheader-client-ca-file={self.ca.cert}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--service-cluster-ip-range={self.service_cidr}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={service_account.cert}",
            f"--service-account-signing-key-file={service_account.key}", *self._audit_flags())

        self._wait_ready(process)
        self.version = json.loads(self.get("/version"))

    def _wait_ready(self, process: Process) -> None:
        def ready() -> bool:
            process.check()
            return self.get("/readyz", quiet=True) == "ok"
        wait_for(ready, START_TIMEOUT_S, what="the API server's /readyz")

    def restart_apiserver(self) -> float:
        """Stops kube-apiserver (SIGTERM: it drains and exits, as when its static pod is
        replaced) and starts it again with the same flags, port and certificates; returns
        when its /readyz answers ok, with the seconds it did not serve. Every client (the
        controllers, kwok, an operator) sees its connections and watches closed and reconnects."""
        old = next(p for p in self.processes if p.name == "kube-apiserver")
        start = time.monotonic()
        old.stop()
        new = Process(old.name, old.argv, old.log)
        self.processes[self.processes.index(old)] = new
        self._wait_ready(new)
        return time.monotonic() - start

    def _audit_flags(self) -> list[str]:
        if self.audit_log is None:
            return []
        return [f"--audit-policy-file={pathlib.Path(__file__).with_name('audit-policy.yaml')}",
                f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
                          "--audit-log-maxsize=4096"]  # MB; unset rotates at 100 MB (lumberjack), mid-benchmark at 1,000

    def _start_controller_manager(self, ca: Authority, service_account: Pair) -> None:
        config = self._write_kubeconfig("controller-manager",
                                        ca.issue("controller-manager", "system:kube-controller-manager"))
        self._run("kube-controller-manager", f"--kubeconfig={config}", f"--authentication-kubeconfig={config}",
                  f"--authorization-kubeconfig={config}", "--bind-address=127.0.0.1",
                  f"--secure-port={free_port()}", f"--cert-dir={self.workdir / 'controller-manager'}",
                  "--leader-elect=false", "--use-service-account-credentials=true",
                  f"--service-account-private-key-file={service_account.key}", f"--root-ca-file={self.ca.cert}",
                  f"--service-cluster-ip-range={self.service_cidr}", "--controllers=*,-nodeipam", *self.client_limits)

    def _start_scheduler(self, ca: Authority) -> None:
        config = self._write_kubeconfig("scheduler", ca.issue("scheduler", "system:kube-scheduler"))
        self._run("kube-scheduler", f"--kubeconfig={config}", f"--authentication-kubeconfig={config}",
                  f"--authorization-kubeconfig={config}", "--bind-address=127.0.0.1",
                  f"--secure-port={free_port()}", "--leader-elect=false", *self.client_limits)

    def get(self, path: str, quiet: bool = False) -> str:
        """GET path from the API server as the admin; with quiet, '' when it fails."""
        try:
            return self.api("GET", path)
        except OSError:
            if quiet:
                return ""
            raise

    def api(self, method: str, path: str, body: dict[str, Any] | None = None,
            content_type: str = "application/json", accept: str = "application/json") -> str:
        """One request to the API server as the admin; the response body (accept: e.g. metadata
        only, "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1").
        Raises urllib.error.HTTPError (an OSError) on an error status."""
        context = ssl.create_default_context(cafile=str(self.ca.cert))
        context.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": content_type, "Accept": accept})
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.read().decode()

    def audit_events(self) -> list[dict[str, Any]]:
        """Every request the API server has answered so far, as audit events (audit=True)."""
        assert self.audit_log is not None, "started without audit=True"
        if not self.audit_log.exists():
            return []
        return [json.loads(line) for line in self.audit_log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        """Stops every component, newest first (the API server before etcd)."""
        while self.processes:
            self.processes.pop().stop()

    def logs(self) -> str:
        """The tails of the components' logs, for a failing test's report."""
        return "\n".join(f"--- {p.log}\n{p.log.read_text(errors='replace')[-2000:]}"
                         for p in self.processes if p.log.exists())

