"""The in-cluster tuner's engine API key: read from the Secret spec.engine.apiKeySecret names
(Kubernetes Secret `data` is base64, API reference "Secret v1 core"), never a flag or a log line."""
from __future__ import annotations

import base64

import pytest

from kvpilot.api.spec import InferenceServiceSpec
from kvpilot.tuner.cluster.session import engine_api_key


class Secrets:
    """KubeClient.get over a dict of Secrets, recording the paths asked for."""

    def __init__(self, secrets: dict[str, dict]):
        self.secrets, self.paths = secrets, []

    def get(self, path: str):
        self.paths.append(path)
        return self.secrets.get(path.rsplit("/", 1)[1])


def spec(ref: dict | None) -> InferenceServiceSpec:
    engine = {"apiKeySecret": ref} if ref else {}
    return InferenceServiceSpec.from_dict({"model": {"source": "smollm2-135m-instruct"}, "engine": engine})


def secret(**data: str) -> dict:
    return {"data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def test_the_key_comes_from_the_named_secret_and_key_in_the_resource_namespace():
    kube = Secrets({"k": secret(token="s3cret-key\n")})
    # the key file's newline (`kubectl create secret --from-file`) is not part of the key, as in the engine
    assert engine_api_key(kube, "team-a", spec({"name": "k", "key": "token"}), None) == "s3cret-key"
    assert kube.paths == ["/api/v1/namespaces/team-a/secrets/k"]


def test_a_flag_wins_and_no_secret_means_no_key_and_no_read():
    kube = Secrets({})
    assert engine_api_key(kube, "ns", spec({"name": "k"}), "from-flag") == "from-flag"
    assert engine_api_key(kube, "ns", spec(None), None) is None
    assert kube.paths == []


@pytest.mark.parametrize("secrets, what", [({}, "does not exist"), ({"k": secret(other="hidden")}, "has no key 'api-key'"),
                                           ({"k": {"data": {"api-key": "%%%"}}}, "not base64")])
def test_a_missing_secret_or_key_stops_with_the_name_and_never_the_data(secrets, what):
    with pytest.raises(SystemExit) as stop:
        engine_api_key(Secrets(secrets), "ns", spec({"name": "k"}), None)
    message = str(stop.value)
    assert what in message and "ns/k" in message
    assert "hidden" not in message and base64.b64encode(b"hidden").decode() not in message
