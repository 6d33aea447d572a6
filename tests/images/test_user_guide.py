"""docs/guide.md, run: every `sh` line and the `python` block, in order and as written, on a
real node (tests/kube/node.py: the kubelet, containerd, a CNI bridge and kube-proxy) under a
real API server: `helm install` (Helm 4) starts the operator pod from the operator image, the
operator's Deployment starts the engine pod from the engine image, `kubectl port-forward
svc/...` forwards through the kubelet to that pod, and curl and the `openai` client call it.
The only change to a line is the local port of `port-forward` (a free one, not 8000)."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import shlex
import subprocess
from collections.abc import Iterator

import httpx
import pytest
import yaml
from kube.cluster import Cluster
from kube.pods import POD_START_TIMEOUT_S, wait_rolled_out
from kube.tools import ROOT, Kubectl, free_port, tool, wait_for

pytestmark = pytest.mark.slow
GUIDE = ROOT / "docs" / "guide.md"


def blocks(text: str) -> Iterator[tuple[str, str]]:
    """(language, body) of each fenced block, in order."""
    for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.S | re.M):
        yield m.group(1), m.group(2)


class Guide:
    """Runs the guide's commands; `outputs` keeps each command's stdout by its text."""

    def __init__(self, control_plane, workdir):
        # the guide works in the `default` namespace, as a user's fresh cluster would
        self.cluster = Cluster(control_plane, "default", workdir)
        self.kubectl, self.workdir = Kubectl(self.cluster.kubeconfig), workdir
        self.forward: subprocess.Popen | None = None
        self.port = free_port()
        self.outputs: dict[str, str] = {}
        (workdir / "examples").symlink_to(ROOT / "examples")  # the guide's paths are the repository's

    def helm(self, argv: list[str]) -> str:
        """`helm ...` as written, with the Helm 4 built beside the API server."""
        return subprocess.run([tool("helm"), *argv[1:]], capture_output=True, text=True, check=True, timeout=300,
                              env={**self.kubectl.env, "PATH": "/usr/bin:/bin"}).stdout

    def run(self, line: str) -> str:
        argv = shlex.split(line)
        target = None
        if ">" in argv:
            argv, target = argv[:argv.index(">")], argv[argv.index(">") + 1]
        if argv[0] == "helm":
            out = self.helm(argv)
        elif argv[:2] == ["kubectl", "port-forward"]:
            out = self.port_forward(argv)
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

    def port_forward(self, argv: list[str]) -> str:
        """`kubectl port-forward svc/NAME LOCAL:REMOTE`, run as written but for LOCAL (a free
        port), in the background as a user's terminal would keep it, once the Service's pods
        are all of the Deployment's current rollout and Ready. A second one replaces the first."""
        name = argv[2].split("/", 1)[1]
        remote = argv[3].split(":", 1)[1]
        wait_rolled_out(self.kubectl, name, POD_START_TIMEOUT_S)
        self.stop_forward()
        log = self.workdir / f"port-forward-{len(self.outputs)}.log"
        self.forward = subprocess.Popen([tool("kubectl"), *argv[1:3], f"{self.port}:{remote}"], env=self.kubectl.env,
                                        stdout=log.open("w"), stderr=subprocess.STDOUT)

        def forwarding() -> bool:
            assert self.forward is not None and self.forward.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(forwarding, 120, what=f"port-forward to svc/{name}")
        return log.read_text()

    def run_python(self, code: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code.replace("localhost:8000", f"127.0.0.1:{self.port}"), {})  # noqa: S102  (the guide's own code)
        return out.getvalue()

    def stop_forward(self) -> None:
        if self.forward is not None:
            self.forward.terminate()
            self.forward.wait(30)
            self.forward = None

    def close(self) -> None:
        self.stop_forward()


def test_every_command_of_the_user_guide_works(node, tmp_path):
    text = GUIDE.read_text()
    guide = Guide(node, tmp_path)
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
                 "/v1/chat/completions", "status.tuning", "smollm2-vllm", "qwen-vllm", "smollm2-pipeline", "kvpilot-dashboard",
                 "helm uninstall"):
        assert step in ran, step


def check_after(guide: Guide, line: str) -> None:
    """What each command must have done (so that a guide that drifts from the product fails)."""
    kubectl, out = guide.kubectl, guide.outputs[line]
    if line.startswith("helm install"):
        assert kubectl.json("get", "role", "kvpilot", "-n", "default")["rules"]
        assert "STATUS: deployed" in out
    elif line.startswith("kubectl get deployment kvpilot"):  # the operator pod, from the operator image
        def all_available() -> bool:  # the chart's replicas (two by default: a leader and a standby)
            deployment = kubectl.json("get", "deployment", "kvpilot", "-n", "kvpilot-system")
            return deployment["status"].get("availableReplicas") == deployment["spec"]["replicas"]

        wait_for(all_available, POD_START_TIMEOUT_S, what="the operator's pods Ready")
        pod = kubectl.json("get", "pods", "-n", "kvpilot-system", "-l", "app.kubernetes.io/name=kvpilot")["items"][0]
        assert pod["spec"]["containers"][0]["image"].startswith("kvpilot/operator:")
        assert pod["status"]["podIP"].startswith("10.245.0."), "a pod on the real node's bridge"
    elif line.startswith("kubectl apply -f examples/"):  # the operator creates its Deployment a moment later
        doc = yaml.safe_load((ROOT / line.split()[-1]).read_text())
        name = doc["metadata"]["name"]
        kind = "statefulset" if doc["spec"].get("parallelism", {}).get("nnodes", 1) > 1 else "deployment"
        wait_for(lambda: kubectl("get", kind, name, check=False).returncode == 0, 60,
                 what=f"the operator's {kind} {name}")
    elif line == "kubectl get isvc smollm2-pipeline":  # one engine over two pods: Ready once both joined
        obj = wait_for(lambda: (o := kubectl.json("get", "isvc", "smollm2-pipeline")).get("status", {}).get(
            "readyReplicas") == 1 and o, POD_START_TIMEOUT_S, what="smollm2-pipeline's group Ready")
        assert obj["status"]["groupSize"] == 2 and obj["status"]["replicaSummary"] == "1/1"
        endpoints = kubectl.json("get", "endpoints", "smollm2-pipeline")
        assert [a["targetRef"]["name"] for s in endpoints["subsets"] for a in s["addresses"]] == ["smollm2-pipeline-0"]
        log = kubectl("logs", "smollm2-pipeline-0-1").stdout  # node 1 joined node 0 as a headless node
        assert log.strip(), "node 1 logged nothing"
    elif line.startswith("kubectl get pods -l kvpilot.dev/inferenceservice=smollm2-pipeline"):
        assert "smollm2-pipeline-0 " in out and "smollm2-pipeline-0-1 " in out, out
    elif line == "kubectl get isvc":
        wait_for(lambda: "True" in kubectl("get", "isvc", "smollm2").stdout, POD_START_TIMEOUT_S,
                 what="smollm2 Ready (its engine pod answering the readiness probe)")
        # the Service's virtual IP answers from the node (kube-proxy's rules, the pod's endpoint)
        cluster_ip = kubectl.json("get", "service", "smollm2")["spec"]["clusterIP"]
        assert httpx.get(f"http://{cluster_ip}:8000/health", timeout=10).status_code == 200
        # and the URL column's name resolves to it inside the cluster (CoreDNS), as pods see it
        resolved = kubectl("exec", "deployment/kvpilot", "-n", "kvpilot-system", "--", "python3", "-c",
                           "import socket; print(socket.gethostbyname('smollm2.default.svc'))").stdout.strip()
        assert resolved == cluster_ip
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
        log = kubectl("logs", "deployment/smollm2").stdout  # the engine in the pod answered it
        assert "/v1/chat/completions" in log, log[-3000:]
        # the example's cpu: 500m is the request, the next whole CPU the limit: Burstable, one thread
        pod = kubectl.json("get", "pods", "-l", "app.kubernetes.io/instance=smollm2")["items"][0]
        assert pod["status"]["qosClass"] == "Burstable" and pod["spec"]["containers"][0]["resources"] == {
            "requests": {"cpu": "500m", "memory": "4Gi"}, "limits": {"cpu": "1", "memory": "4Gi"}}
        assert "CPU threads: 1 per rank" in log, log[-3000:]
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
    elif "smollm2-vllm -o jsonpath" in line:  # vLLM on CPU: `vllm serve` of the baked model, through the launcher
        args = json.loads(out)
        assert args[:3] == ["vllm", "serve", "/opt/kvpilot/models/smollm2-135m-instruct"], args
        assert "--swap-space" not in args and "--preemption-mode" not in args
        container = kubectl.json("get", "deployment", "smollm2-vllm")["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["python3", "-I", "/etc/kvpilot/vllm_cpu_launch.py"]
        assert container["image"].startswith("kvpilot/engine-vllm-cpu:")
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
