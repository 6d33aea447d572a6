"""Fidelity of the emulated API server for resource quantities, object names and label values:
each test names the Kubernetes documentation whose behaviour it checks."""
from __future__ import annotations

import pathlib

import httpx
import pytest
import yaml

from cluster.quantity import QuantityError, canonical

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEP = "/apis/apps/v1/namespaces/default/deployments"
SVC = "/api/v1/namespaces/default/services"
CM = "/api/v1/namespaces/default/configmaps"
ISVC = "/apis/kvpilot.dev/v1alpha1/namespaces/default/inferenceservices"


@pytest.fixture
def api(cluster):
    with httpx.Client(base_url=cluster.url, timeout=10) as client:
        yield client


def deployment(name: str, resources: dict, size_limit: object = "1Gi") -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {
                         "containers": [{"name": "c", "image": "i", "resources": resources}],
                         "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": size_limit}}]}}}}


@pytest.mark.parametrize("given, stored", [
    # The examples of the API reference's "Quantity" page: 1.5 -> "1500m", 1.5Gi -> "1536Mi".
    ("1.5", "1500m"), ("1.5Gi", "1536Mi"),
    # The canonical-form rules (no fraction, largest suffix, suffix family kept):
    ("0.5", "500m"), (6, "6"), ("6", "6"), ("1000m", "1"), ("2000", "2k"), ("1024Mi", "1Gi"), ("8Gi", "8Gi"),
    ("512Ki", "512Ki"), ("1e3", "1e3"), ("0", "0"), (0.25, "250m"),
    # Binary values below 1024 are written in decimal; precision below 1n rounds up.
    ("0.5Ki", "512"), ("0.0000000001", "1n"),
])
def test_quantities_are_stored_in_canonical_form(given, stored):
    assert canonical(given) == stored


@pytest.mark.parametrize("bad", ["lots", "1.5x", "", " 1", True])
def test_malformed_quantities_are_refused(bad):
    with pytest.raises(QuantityError):
        canonical(bad)


def test_api_server_rewrites_pod_template_quantities_in_canonical_form(api):
    """A Deployment written with cpu "0.5", a GPU count 6 and sizeLimit "1024Mi" reads back
    as "500m", "6" and "1Gi" (Quantity is serialized in canonical form, as a string)."""
    limits = {"cpu": "0.5", "memory": "1.5Gi", "nvidia.com/gpu": 6}
    created = api.post(DEP, json=deployment("q", {"requests": dict(limits), "limits": limits}, "1024Mi"))
    assert created.status_code == 201
    spec = api.get(f"{DEP}/q").json()["spec"]["template"]["spec"]
    assert spec["containers"][0]["resources"]["limits"] == {"cpu": "500m", "memory": "1536Mi", "nvidia.com/gpu": "6"}
    assert spec["containers"][0]["resources"]["requests"]["cpu"] == "500m"
    assert spec["volumes"][0]["emptyDir"]["sizeLimit"] == "1Gi"
    refused = api.post(DEP, json=deployment("bad-q", {"limits": {"cpu": "lots"}}))
    assert refused.status_code == 422
    assert "spec.template.spec.containers[0].resources.limits[cpu]" in refused.json()["message"]


def test_service_names_are_dns_1035_labels_and_other_names_dns_subdomains(api):
    """"Object Names and IDs": Services take an RFC 1035 label (<= 63, starts with a letter),
    most other kinds a DNS subdomain (<= 253, dots allowed)."""
    service = {"apiVersion": "v1", "kind": "Service",
               "spec": {"selector": {"a": "b"}, "ports": [{"port": 80}]}}
    long_name = "s" * 64
    refused = api.post(SVC, json={**service, "metadata": {"name": long_name}})
    assert refused.status_code == 422
    assert refused.json()["message"].startswith(f'Service "{long_name}" is invalid: metadata.name: Invalid value')
    assert "must be no more than 63 characters" in refused.json()["message"]
    for bad in ("1st", "a.b", "Upper"):
        response = api.post(SVC, json={**service, "metadata": {"name": bad}})
        assert response.status_code == 422 and "DNS-1035 label" in response.json()["message"], bad
    assert api.post(SVC, json={**service, "metadata": {"name": "s" * 63}}).status_code == 201
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "data": {}}
    assert api.post(CM, json={**configmap, "metadata": {"name": "a.b-" + "c" * 70}}).status_code == 201
    assert api.post(CM, json={**configmap, "metadata": {"name": "a_b"}}).status_code == 422


def test_label_values_are_at_most_63_characters(api):
    """"Labels and Selectors": a value is at most 63 characters, alphanumeric at both ends."""
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "data": {}}
    too_long = api.post(CM, json={**configmap, "metadata": {"name": "l1", "labels": {"k": "v" * 64}}})
    assert too_long.status_code == 422 and "must be no more than 63 characters" in too_long.json()["message"]
    assert api.post(CM, json={**configmap, "metadata": {"name": "l2", "labels": {"k": "-v"}}}).status_code == 422
    assert api.post(CM, json={**configmap, "metadata": {"name": "l3", "labels": {"k": "v" * 63, "e": ""}}}).status_code == 201


def test_crd_cel_rule_on_metadata_name_refuses_names_children_could_not_carry(api):
    """CRD validation rules at the root see self.metadata.name ("Validation rules" in
    "Extend the Kubernetes API with CustomResourceDefinitions")."""
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml").read_text())
    assert api.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd).status_code == 201
    example = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    for bad in ("n" * 57, "1st-model", "my.model"):
        response = api.post(ISVC, json={**example, "metadata": {"name": bad}})
        assert response.status_code == 422, bad
        assert "metadata.name must be a DNS-1035 label of at most 56 characters" in response.json()["message"]
    assert api.post(ISVC, json={**example, "metadata": {"name": "n" * 56}}).status_code == 201
