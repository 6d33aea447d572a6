"""Kopf's connection to the API server comes from our login handler (kvpilot.operator.runtime.kopf_session):
the credentials Kopf itself would find, in a session whose connection pool is bounded (Kopf's
own is unbounded: a thousand TLS connections at issue 42's peak). The running operator logs in
through it in every operator end-to-end test."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import kopf
import kubernetes.config.kube_config
import yaml

from kvpilot.operator import handlers  # noqa: F401  (registers the handlers, the login among them)
from kvpilot.operator.runtime.kopf_session import KOPF_CONNECTIONS, login


def test_the_login_keeps_kopfs_credentials_and_bounds_the_pool(tmp_path, monkeypatch):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://10.1.2.3:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    async def main() -> kopf.AiohttpSession:
        context = await login(logger=logging.getLogger("test"), settings=kopf.OperatorSettings())
        await context.aiohttp_session.close()
        return context

    context = asyncio.run(main())
    assert isinstance(context, kopf.AiohttpSession)
    assert context.server == "https://10.1.2.3:6443"
    assert context.aiohttp_session.headers["Authorization"] == "Bearer t0ken"


def test_the_pool_is_bounded(monkeypatch, tmp_path):
    captured = {}
    real = aiohttp.TCPConnector

    def connector(**kwargs):
        captured.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(aiohttp, "TCPConnector", connector)
    test_the_login_keeps_kopfs_credentials_and_bounds_the_pool(tmp_path, monkeypatch)
    assert captured["limit"] == KOPF_CONNECTIONS > 0


def test_kopf_uses_this_login_and_not_its_own():
    registry = kopf.get_default_registry()
    names = [h.fn.__name__ for h in registry._activities.get_all_handlers()
             if h.activity.value == "authentication" and not h._fallback]  # Kopf's own: fallbacks only
    assert names == ["login"], names
