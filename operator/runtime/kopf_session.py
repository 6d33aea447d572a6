"""Kopf's own connection to the API server (its watches, its annotation patches, the Events it
posts), with a bounded connection pool.

Kopf's built-in session opens as many connections as it has requests in flight
(aiohttp.TCPConnector(limit=0) in kopf/_cogs/clients/auth.py). At 1,000 InferenceServices
created at once it had about a thousand TLS connections open at the peak, 62 MB of the
operator's memory (issue 42's benchmark, `bench_operator.py --memray`). Here the same
credentials (kopf.login_via_client: in-cluster service account, else the kubeconfig) go into
a session whose pool holds KOPF_CONNECTIONS; a request beyond it waits for a free connection.
Each watch holds one connection for its life, so the pool leaves room for them.

Source: Kopf docs, "Authentication" (custom login handlers, kopf.AiohttpSession);
aiohttp docs, TCPConnector(limit=)."""
from __future__ import annotations

from typing import Any

import aiohttp
import kopf

KOPF_CONNECTIONS = 64  # the pool: ~10 long-lived watches, the rest for patches and Events


@kopf.on.login()
async def login(logger: kopf.Logger, settings: kopf.OperatorSettings, **kwargs: Any) -> kopf.AiohttpSession | None:
    """The credentials Kopf would find itself, in a session with a bounded pool. Raises
    kopf.LoginError (from kopf.login_via_client) when there are none."""
    info = kopf.login_via_client(logger=logger, settings=settings, **kwargs)
    if info is None:
        return None
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=KOPF_CONNECTIONS, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(), proxy=info.proxy_url, trust_env=info.trust_env)
    return kopf.AiohttpSession(server=info.server, default_namespace=info.default_namespace,
                               expiration=info.expiration, priority=info.priority, aiohttp_session=session)
