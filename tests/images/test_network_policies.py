"""The NetworkPolicy the operator puts in front of an engine (operator/render/network.py), enforced on
the real node by kube-network-policies (tests/kube/node.py; the CNI bridge alone enforces
none). The chart's operator runs in a namespace of its own and watches a second one, where
examples/inferenceservice-smollm2.yaml runs the engine pod. The operator's pod, which also runs
the tuner (the chart's `--tuner`), reaches the engine's port and its admin routes; a pod of the
operator's namespace without the operator's labels does not (its connections time out) while it
reaches the operator's own port; the same pod does once it carries the label the policy admits
Prometheus by."""
from __future__ import annotations

import base64
import json

import pytest
import yaml
from kube.cluster import Cluster
from kube.node import BRIDGE_NF_CALL_IPTABLES
from kube.pods import POD_START_TIMEOUT_S, RESTRICTED_CONTAINER, RESTRICTED_POD, wait_rolled_out
from kube.release import Release
from kube.tools import ROOT, Kubectl, wait_for

from kvpilot.operator.render.builders import ADMIN_TOKEN_KEY, admin_secret_name

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "examples" / "inferenceservice-smollm2.yaml"
PROMETHEUS_LABEL = ("app.kubernetes.io/name", "prometheus")  # the chart's networkPolicy.prometheus peer
CONNECT_TIMEOUT_S = 5
# GETs every URL of argv[2:] at once with the bearer token argv[1] ("" for none) and prints
# {url: the HTTP status, or the error's name: TimeoutError where the policy drops the SYN}
PROBE = f"""
import concurrent.futures, json, sys, urllib.error, urllib.request
def get(url):
    headers = {{"Authorization": "Bearer " + sys.argv[1]}} if sys.argv[1] else {{}}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout={CONNECT_TIMEOUT_S}) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return type(getattr(e, "reason", e)).__name__
with concurrent.futures.ThreadPoolExecutor(len(sys.argv) - 2) as pool:
    print(json.dumps(dict(zip(sys.argv[2:], pool.map(get, sys.argv[2:])))))
"""


def probe(kubectl: Kubectl, target: str, token: str, urls: list[str]) -> dict[str, int | str]:
    """{url: status or error name} of GETs sent from inside `target` (deployment/NAME, pod/NAME)."""
    out = kubectl("exec", target, "--", "python3", "-c", PROBE, token, *urls, timeout=60).stdout
    return json.loads(out.strip().splitlines()[-1])


def answered(results: dict[str, int | str]) -> dict[str, int | str] | None:
    """`results` when every GET answered 200, else None."""
    return results if set(results.values()) == {200} else None


def refused(results: dict[str, int | str], urls: list[str]) -> dict[str, int | str] | None:
    """`results` when the GET of every one of `urls` timed out (its SYN dropped), else None."""
    return results if all(results[url] == "TimeoutError" for url in urls) else None


def visitor_pod(image: str) -> dict:
    """A pod without labels from the operator image (python3 and nothing else), idle until deleted."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "visitor"},
            "spec": {"automountServiceAccountToken": False, "enableServiceLinks": False,
                     "terminationGracePeriodSeconds": 0, "securityContext": RESTRICTED_POD,
                     "containers": [{"name": "idle", "image": image, "imagePullPolicy": "IfNotPresent",
                                     "command": ["sleep", "infinity"], "securityContext": RESTRICTED_CONTAINER}]}}


def test_engine_admits_the_operator_tuner_and_prometheus_and_drops_other_pods(node, images, tmp_path, capsys):
    bridged = BRIDGE_NF_CALL_IPTABLES.read_text().strip() if BRIDGE_NF_CALL_IPTABLES.exists() else "missing"
    assert bridged == "1", f"{BRIDGE_NF_CALL_IPTABLES}: {bridged} (br_netfilter): bridged pod traffic skips netfilter"
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    for workdir in ("engine", "operator"):  # each namespace's kubeconfig
        (tmp_path / workdir).mkdir()
    with Cluster(node, "netpol-engine", tmp_path / "engine") as engines, \
            Cluster(node, "netpol-operator", tmp_path / "operator") as operators:
        kubectl, engine_kubectl = Kubectl(operators.kubeconfig), Kubectl(engines.kubeconfig)
        release = Release(operators, "np", f"--set=watch.namespaces={{{engines.namespace}}}").install()
        try:
            kubectl("apply", "-f", "-", stdin=json.dumps(visitor_pod(images["operator"])))
            engine_kubectl.apply(EXAMPLE)
            wait_rolled_out(engine_kubectl, name, POD_START_TIMEOUT_S)
            policy = engine_kubectl.json("get", "networkpolicy", name)
            engine_ip = engine_kubectl.json("get", "pods", "-l", f"app.kubernetes.io/instance={name}")["items"][0][
                "status"]["podIP"]
            port = engine_kubectl.json("get", "service", name)["spec"]["ports"][0]["port"]
            token = base64.b64decode(engine_kubectl.json("get", "secret", admin_secret_name(name))["data"][
                ADMIN_TOKEN_KEY]).decode()
            urls = [f"http://{host}:{port}{path}" for host in (f"{name}.{engines.namespace}.svc", engine_ip)
                    for path in ("/health", "/admin/scheduler_config")]
            operator = kubectl.json("get", "deployment", release.service_account)
            operator_pod = kubectl.json("get", "pods", "-l", ",".join(
                f"{k}={v}" for k, v in operator["spec"]["selector"]["matchLabels"].items()))["items"][0]
            container = operator["spec"]["template"]["spec"]["containers"][0]
            healthz = next(p["containerPort"] for p in container["ports"] if p["name"] == "healthz")
            operator_url = f"http://{operator_pod['status']['podIP']}:{healthz}/healthz"  # no policy selects it
            wait_for(lambda: kubectl.json("get", "pod", "visitor")["status"]["phase"] == "Running", POD_START_TIMEOUT_S,
                     what="the visitor pod running")

            from_operator = wait_for(lambda: answered(probe(kubectl, f"deployment/{release.service_account}",
                                                            token, urls)), 60, what="the operator reaching the engine")
            # the enforcer learns pods and policies from the API server: refused once it has them
            from_visitor = wait_for(lambda: refused(probe(kubectl, "pod/visitor", token, [*urls, operator_url]), urls),
                                    60, what="the visitor refused")
            kubectl("label", "pod", "visitor", "=".join(PROMETHEUS_LABEL))
            from_prometheus = wait_for(lambda: answered(probe(kubectl, "pod/visitor", token, urls)), 60,
                                       what="the visitor labelled as Prometheus reaching the engine")
            engine_kubectl("delete", "isvc", name, "--wait=true", timeout=120)
        finally:
            release.uninstall()
    assert "--tuner" in container["args"]  # the operator's peer is the tuner's
    peers = policy["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operators.namespace}},
            "podSelector": {"matchLabels": operator["spec"]["selector"]["matchLabels"]}} in peers, peers
    assert {"namespaceSelector": {}, "podSelector": {"matchLabels": dict([PROMETHEUS_LABEL])}} in peers, peers
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": port}]
    # neither the engine's port nor its admin routes, through the Service or to the pod; the operator's port is open
    assert from_visitor == {**dict.fromkeys(urls, "TimeoutError"), operator_url: 200}, from_visitor
    with capsys.disabled():
        print(f"\n[network policy] engine {engines.namespace}/{name}, port {port}, operator in {operators.namespace}: "
              f"from the operator's pod {from_operator}; from an unlabelled pod of its namespace {from_visitor}; "
              f"from that pod labelled {'='.join(PROMETHEUS_LABEL)} {from_prometheus}")
