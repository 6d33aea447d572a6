"""docs/guide.md, run: every `sh` line and the `python` block, in order, against the real API
server (tests/kube) with the real `helm install`/`helm uninstall` (Helm 4), the operator the
chart installs run as its ServiceAccount, and the engine the pod would run. What is mirrored
rather than run as written (port-forward: the kwok node runs no container) is listed at the
end of the guide."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from kube.cluster import Cluster
from kube.release import Release
from kube.tools import ROOT, Kubectl, Operator, free_port, tool, wait_for

pytestmark = pytest.mark.slow
GUIDE = ROOT / "docs" / "guide.md"


def blocks(text: str) -> Iterator[tuple[str, str]]:
    """(language, body) of each fenced block, in order."""
    for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.S | re.M):
        yield m.group(1), m.group(2)


class Guide:
    """Runs the guide's commands; `outputs` keeps each command's stdout by its text."""

    def __init__(self, cluster, workdir):
        # the guide works in the `default` namespace, as a user's fresh cluster would
        self.cluster = Cluster(cluster.control_plane, "default", workdir)
        self.kubectl, self.workdir = Kubectl(self.cluster.kubeconfig), workdir
        self.operator: Operator | None = None
        self.engine: subprocess.Popen | None = None
        self.port = free_port()
        self.outputs: dict[str, str] = {}
        (workdir / "examples").symlink_to(ROOT / "examples")  # the guide's paths are the repository's

    def helm(self, argv: list[str]) -> str:
        """`helm ...` as written, with the Helm 4 built beside the API server."""
        return subprocess.run([tool("helm"), *argv[1:]], capture_output=True, text=True, check=True, timeout=300,
                              env={**self.kubectl.env, "PATH": "/usr/bin:/bin"}).stdout

    def start_operator(self, argv: list[str]) -> None:
        """What the chart's operator Deployment runs, with its ServiceAccount's token (the
        kwok node runs no container): the chart's command line, watching `default`."""
        namespace = argv[argv.index("--namespace") + 1]
        (self.workdir / "release").mkdir(exist_ok=True)
        release = Release(Cluster(self.cluster.control_plane, namespace, self.workdir / "release"), argv[2])
        kubeconfig = release.operator_kubeconfig(self.workdir / "release" / "kubeconfig")
        self.operator = Operator(kubeconfig, self.workdir / "operator.log", "default")
        self.operator.start()

    def run(self, line: str) -> str:
        argv = shlex.split(line)
        target = None
        if ">" in argv:
            argv, target = argv[:argv.index(">")], argv[argv.index(">") + 1]
        if argv[:2] == ["helm", "install"]:
            out = self.helm(argv)
            self.start_operator(argv)
        elif argv[:2] == ["helm", "uninstall"]:
            if self.operator is not None:
                self.operator.stop()
            out = self.helm(argv)
        elif argv[:2] == ["kubectl", "port-forward"]:
            out = self.start_engine(argv[2].split("/", 1)[1])
        elif argv[0] == "kubectl":
            out = self.kubectl(*argv[1:], cwd=self.workdir).stdout
        elif argv[0] == "curl":  # through bash, for "$(cat api-key.txt)"
            out = subprocess.run(["bash", "-c", line.replace("localhost:8000", f"127.0.0.1:{self.port}")],
                                 capture_output=True, text=True, check=True, timeout=120, cwd=self.workdir).stdout
        elif argv[0] == "openssl":
            out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60, cwd=self.workdir).stdout
        else:
            raise AssertionError(f"the guide runs a command the test does not know: {line}")
        if target:
            (self.workdir / target).write_text(out)
        self.outputs[line] = out
        return out

    def start_engine(self, service: str) -> str:
        """The engine the Service's pod runs: status.appliedEngineArgs, on a local port."""
        obj = wait_for(lambda: (o := self.kubectl.json("get", "isvc", service)).get("status", {}).get("readyReplicas")
                       and o, what=f"{service} ready")
        if self.engine is not None:  # a second port-forward: the pod of the new rollout
            self.engine.terminate()
            self.engine.wait(30)
        args = obj["status"]["appliedEngineArgs"]
        assert args[:2] == ["kvpilot", "serve"]
        args = args[2:]
        args[args.index("--port") + 1] = str(self.port)
        # The pod sizes its KV cache from its memory limit; here the machine is shared: a small cache.
        cmd = [sys.executable, "-m", "kvpilot.cli.main", "serve", *args, "--host", "127.0.0.1",
               "--num-gpu-blocks-override", "160"]
        self.engine = subprocess.Popen(cmd, stdout=(self.workdir / "engine.log").open("w"), stderr=subprocess.STDOUT,
                                       env={**os.environ, **self.secret_env(service)})

        def healthy() -> bool:
            assert self.engine is not None and self.engine.poll() is None, (self.workdir / "engine.log").read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(healthy, timeout=300, what="the engine's /health")
        return f"Forwarding from 127.0.0.1:8000 -> {self.port}"

    def secret_env(self, service: str) -> dict[str, str]:
        """The pod's Secret-backed variables (the admin token, an API key), read from the
        Secrets as the kubelet would; the other variables point at the pod's own volumes."""
        container = self.kubectl.json("get", "deployment", service)["spec"]["template"]["spec"]["containers"][0]
        env = {}
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                data = self.kubectl.json("get", "secret", ref["name"])["data"]
                env[var["name"]] = base64.b64decode(data[ref["key"]]).decode()
        return env

    def run_python(self, code: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code.replace("localhost:8000", f"127.0.0.1:{self.port}"), {})  # noqa: S102  (the guide's own code)
        return out.getvalue()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.terminate()
            self.engine.wait(30)
        if self.operator is not None:
            self.operator.stop()


def test_every_command_of_the_user_guide_works(cluster, tmp_path):
    text = GUIDE.read_text()
    guide = Guide(cluster, tmp_path)
    python_out = ""
    try:
        for language, body in blocks(text):
            if language == "sh":
                for line in body.splitlines():
                    if line.strip() and not line.startswith("#"):
                        guide.run(line)
                        check_after(guide, line)
            elif language == "python":
                python_out = guide.run_python(body)
    finally:
        guide.close()
    out = guide.outputs
    assert python_out.strip(), "the openai client got no text back"
    ran = " ".join(out)
    for step in ("helm install", "kubectl get isvc", "kubectl describe isvc smollm2", "port-forward",
                 "/v1/chat/completions", "status.tuning", "qwen-vllm", "kvpilot-dashboard", "helm uninstall"):
        assert step in ran, step


def check_after(guide: Guide, line: str) -> None:
    """What each command must have done (so that a guide that drifts from the product fails)."""
    kubectl, out = guide.kubectl, guide.outputs[line]
    if line.startswith("helm install"):
        assert kubectl.json("get", "role", "kvpilot", "-n", "default")["rules"]
        assert "STATUS: deployed" in out
    elif line == "kubectl get isvc":
        wait_for(lambda: "True" in kubectl("get", "isvc", "smollm2").stdout, what="smollm2 Ready")
        sample = re.search(r"```text\n(NAME.*?)\n(smollm2.*?)\n```", GUIDE.read_text(), re.S)
        got = kubectl("get", "isvc").stdout.splitlines()
        assert got[0].split() == sample.group(1).split()
        assert got[1].split()[:4] == sample.group(2).split()[:4]
    elif line.startswith("kubectl describe"):
        assert "Ready" in out and "Created" in out
    elif "-w '%{http_code}'" in line:  # no key: refused
        assert out == "401"
    elif "/v1/models" in line:
        assert [m["id"] for m in json.loads(out)["data"]] == ["smollm2-135m-instruct"]
    elif "/v1/chat/completions" in line:
        assert json.loads(out)["choices"][0]["message"]["content"]
    elif "create secret generic smollm2-api-key" in line:
        data = kubectl.json("get", "secret", "smollm2-api-key")["data"]
        assert base64.b64decode(data["api-key"]).decode() == (guide.workdir / "api-key.txt").read_text()
    elif "apiKeySecret" in line:  # the rollout: the pod template gets the key from the Secret, not a flag
        def key_ref() -> dict | None:
            spec = kubectl.json("get", "deployment", "smollm2")["spec"]["template"]["spec"]["containers"][0]
            refs = [v["valueFrom"]["secretKeyRef"] for v in spec.get("env", []) if v["name"] == "VLLM_API_KEY"]
            return refs[0] if refs else None
        assert wait_for(key_ref, what="VLLM_API_KEY in the pod template") == {"name": "smollm2-api-key", "key": "api-key"}
        key = (guide.workdir / "api-key.txt").read_text().strip()
        assert not any(key in a for a in kubectl.json("get", "isvc", "smollm2")["status"]["appliedEngineArgs"])
    elif '"enabled": true' in line:
        assert kubectl.json("get", "isvc", "smollm2")["spec"]["tuning"]["enabled"] is True
    elif '"enabled": false' in line:
        assert kubectl.json("get", "isvc", "smollm2")["spec"]["tuning"]["enabled"] is False
    elif "qwen-vllm -o jsonpath" in line:
        assert json.loads(out) == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"}
        container = kubectl.json("get", "deployment", "qwen-vllm")["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["vllm", "serve"] and container["args"][0] == "/models/Qwen2.5-7B-Instruct"
    elif "kvpilot-dashboard" in line:
        dashboard = json.loads((guide.workdir / "kvpilot-dashboard.json").read_text())
        assert dashboard == json.loads((ROOT / "charts" / "kvpilot" / "dashboards" / "kvpilot.json").read_text())
    elif line.startswith("kubectl delete isvc"):
        wait_for(lambda: kubectl("get", "isvc", "smollm2", check=False).returncode != 0, what="smollm2 deleted")
    elif line.startswith("helm uninstall"):
        assert 'release "kvpilot" uninstalled' in out
        assert kubectl("get", "deployment", "kvpilot", "-n", "kvpilot-system", check=False).returncode != 0
        assert kubectl("get", "role", "kvpilot", "-n", "default", check=False).returncode != 0


def test_the_guide_explains_every_failed_reason_the_operator_sets():
    source = "".join(p.read_text() for p in sorted((ROOT / "operator").glob("*.py")))
    reasons = set(re.findall(r'InvalidSpec\("(\w+)"', source)) | set(re.findall(r'else "(\w+)"\n', source))
    section = GUIDE.read_text().split("## 7. When it says Failed", 1)[1].split("\n## ", 1)[0]
    table = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert "InvalidSpec" in reasons and len(reasons) >= 6
    assert table == reasons


def test_readme_links_the_guide():
    assert "docs/guide.md" in (ROOT / "README.md").read_text()
