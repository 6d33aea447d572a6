"""The Helm chart (helm lint/template, kubernetes-validate) and the Grafana dashboard (JSON
schema, promtool over every expression). The example manifest against the CRD, as the API
server validates it, is in test_crd_api_server.py; `helm install` in test_operator_e2e.py."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from kube.tools import BIN, ROOT, tool

CHART = ROOT / "charts" / "kvpilot"
CRD = ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml"
DASHBOARD = CHART / "dashboards" / "kvpilot.json"


def helm(*args: str) -> str:
    result = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


def render(*sets: str) -> list[dict]:
    args = ["template", "kv", str(CHART), "--namespace", "kvpilot-system", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args)) if d]


def test_helm_lint_strict_passes():
    helm("lint", "--strict", str(CHART))


@pytest.mark.parametrize("sets", [(), ("watch.clusterWide=true",), ("watch.namespaces={a,b}", "peering=kvpilot"),
                                  ("replicaCount=1", "leaderElection.enabled=false", "metrics.enabled=false")])
def test_rendered_manifests_pass_kubernetes_validate_strict(sets, tmp_path):
    docs = render(*sets)
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert {d["kind"] for d in docs} >= {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ConfigMap"}


def test_namespaced_mode_grants_only_roles_in_the_watched_namespaces():
    docs = render("watch.namespaces={team-a,team-b}")
    roles = [d for d in docs if d["kind"] == "Role" and not d["metadata"]["name"].endswith("-leader-election")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    cluster_rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert {res for r in cluster_rules for res in r["resources"]} == {"customresourcedefinitions", "namespaces"}
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in cluster_rules)
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


def test_cluster_wide_mode_uses_a_cluster_role_and_watches_everything():
    docs = render("watch.clusterWide=true")
    # the one Role: the Lease in the release namespace (issue 42)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Role"] == ["kv-kvpilot-leader-election"]
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "kv-kvpilot")
    assert any("inferenceservices/status" in r["resources"] for r in role["rules"])
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args


def deployment_of(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment")


def test_two_replicas_elect_a_leader_on_a_lease_with_a_disruption_budget_and_spread_over_nodes():
    """issue 42: two replicas, one reconciling (a Lease named after the release, in its
    namespace, that only the release's ServiceAccount may read and renew), a PDB of
    minAvailable 1, pods that prefer different nodes, and both probes."""
    docs = render("watch.namespaces={team-a}")
    deployment = deployment_of(docs)
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1,
                                                                                         "maxUnavailable": 0}}
    assert {"--leader-elect", "--leader-election-lease=kv-kvpilot", "--leader-elect-lease-duration=15",
            "--leader-elect-renew-deadline=10", "--leader-elect-retry-period=2"} <= set(container["args"])
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "healthz"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == pod["metadata"]["labels"]
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 1 and pdb["metadata"]["namespace"] == "kvpilot-system"
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kv-kvpilot-leader-election"]
    assert role["metadata"]["namespace"] == "kvpilot-system"  # the release's, not a watched one
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["kv-kvpilot"],
         "verbs": ["get", "update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]}]
    binding = next(d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == role["metadata"]["name"])
    assert binding["subjects"][0]["name"] == pod["spec"]["serviceAccountName"]


def test_one_replica_has_no_disruption_budget_and_replicas_without_an_election_are_refused():
    assert not [d for d in render("replicaCount=1") if d["kind"] == "PodDisruptionBudget"]  # a drain must evict it
    single = render("replicaCount=1", "leaderElection.enabled=false")
    assert deployment_of(single)["spec"]["strategy"] == {"type": "Recreate"}
    assert "--leader-elect" not in deployment_of(single)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [d for d in single if d["metadata"]["name"].endswith("-leader-election")]
    refused = subprocess.run([tool("helm"), "template", "kv", str(CHART), "--set", "leaderElection.enabled=false"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "replicaCount > 1 needs leaderElection.enabled" in refused.stderr


def test_chart_ships_the_repository_crd_and_the_dashboard_for_the_sidecar():
    assert (CHART / "crds" / CRD.name).read_text() == CRD.read_text()
    docs = render("podMonitor.enabled=true")
    dashboard = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"))
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kvpilot.json"]) == json.loads(DASHBOARD.read_text())
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kvpilot-engine"}
    assert not [d for d in render() if d["kind"] == "PodMonitor"]


def test_chart_ships_vllms_dashboards_unchanged_one_configmap_each():
    """dashboards/vllm/ holds vLLM's generated dashboards byte for byte (SOURCE.md); their
    queries are checked against a live server in tests/server/test_server_vllm_dashboards.py."""
    vllm = sorted((CHART / "dashboards" / "vllm").glob("*.json"))
    assert [p.name for p in vllm] == ["vllm_instances.json", "vllm_kv_cache.json", "vllm_overview.json",
                                      "vllm_service_status.json"]
    maps = {d["metadata"]["name"]: d for d in render() if d["kind"] == "ConfigMap"}
    for path in vllm:
        shipped = maps[f"kv-kvpilot-dashboard-{path.stem.replace('_', '-')}"]
        assert shipped["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert shipped["data"][path.name] == path.read_text().rstrip("\n")
    assert not [d for d in render("dashboard.vllm=false") if "-dashboard-vllm" in d["metadata"]["name"]]


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_has_the_panels_and_variables_and_slo_lines_from_kvpilot_slo():
    """Grafana's own schema is checked in test_dashboard_grafana_schema.py; here, the content."""
    dashboard = load_dashboard()
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dashboard["panels"])
    cells = [(p["title"], x, y) for p in dashboard["panels"] for g in [p["gridPos"]]
             for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])]
    taken: dict[tuple[int, int], str] = {}
    for title, x, y in cells:  # no two panels share a grid cell
        assert taken.setdefault((x, y), title) == title, (title, taken[(x, y)], x, y)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "isvc"} <= variables
    assert not [v for v in dashboard["templating"]["list"] if v["type"] == "textbox"]  # no hand-set SLOs
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", ()))  # a row has none
    for metric in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                   "vllm:e2e_request_latency_seconds_bucket", "vllm:generation_tokens_total",
                   "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:num_preemptions_total", "vllm:request_queue_time_seconds_bucket",
                   "vllm:prefix_cache_hits_total", "kvpilot:engine_config_info", "kvpilot_tuning_trial",
                   "kvpilot_tuning_best_goodput_rps", "kvpilot_tuning_trials_total", "kvpilot_tuning_settings_info",
                   # issue 50: continuous tuning's watch windows
                   "kvpilot_tuning_slo_attainment", "kvpilot_tuning_slo_breached_windows",
                   "kvpilot_workload_arrival_rate_rps", "kvpilot_workload_prompt_tokens",
                   "kvpilot_workload_output_tokens", "kvpilot_tuning_retunes_total", "kvpilot_tuning_watching",
                   # issue 42: the operator's own, in a row of their own
                   "kvpilot_operator_is_leader", "kvpilot_operator_reconcile_duration_seconds_bucket",
                   "kvpilot_operator_inferenceservice_condition", "kvpilot_operator_rollout_age_seconds",
                   "kvpilot_operator_tuning_phase", "kvpilot_operator_tuning_trial"):
        assert metric in exprs, metric
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == ["Operator"]
    below = [p for p in dashboard["panels"] if p["gridPos"]["y"] > rows[0]["gridPos"]["y"]]
    assert not rows[0]["collapsed"] and not rows[0]["panels"]  # its panels follow it, shown
    assert below and all("kvpilot_operator_" in t["expr"] for p in below for t in p["targets"])
    slo = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ()) if t.get("legendFormat") == "SLO"]
    assert len(slo) == 3 and all(e.startswith("max(kvpilot_slo_") for e in slo), slo
    annotations = [a["target"]["expr"] for a in dashboard["annotations"]["list"] if "target" in a]
    assert any("kvpilot:engine_config_info" in e for e in annotations)  # engine rollouts
    assert any("kvpilot_tuning_trial" in e for e in annotations)


def substitute(expr: str) -> str:
    """Grafana's variables replaced by values Prometheus accepts."""
    values = {"$__rate_interval": "1m", "$namespace": "default", "$isvc": "smollm2"}
    for name, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def test_every_dashboard_expression_passes_promtool_check_rules(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is installed by scripts/install-tools.sh"
    rules = [{"record": f"dashboard:panel{p['id']}_{t['refId']}", "expr": substitute(t["expr"])}
             for p in load_dashboard()["panels"] for t in p.get("targets", ())]
    rules += [{"record": f"dashboard:annotation{i}", "expr": substitute(a["target"]["expr"])}
              for i, a in enumerate(load_dashboard()["annotations"]["list"]) if "target" in a]
    variables = [v for v in load_dashboard()["templating"]["list"] if v["type"] == "query"]
    for v in variables:
        query = re.fullmatch(r"label_values\((.*), *\w+\)", v["query"]["query"])
        assert query, v["query"]
        rules.append({"record": f"dashboard:var_{v['name']}", "expr": substitute(query.group(1))})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
    bad = tmp_path / "bad.yaml"  # promtool really parses: a broken expression fails
    bad.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum(rate(x[1m])"}]}]}))
    assert subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True).returncode != 0
