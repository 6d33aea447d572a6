"""The operator's probe endpoints, served from the first second of the process (a standby
runs no Kopf, so Kopf's own liveness endpoint would not exist there):

    /healthz        200 while the process's event loop answers (the kubelet's liveness probe)
    /readyz         200 on the leader once Kopf has started, and on a standby whose lease
                    reads reach the API server; 503 otherwise. The body says which role:
                    "ok: leader" / "ok: standby, lease NS/NAME held by POD"; ?verbose lists
                    each check as the API server's /readyz?verbose does ([+]ping ok ...)
    /readyz/leader  200 only on the replica that reconciles, 503 "standby: ..." elsewhere

Why a standby is Ready: as controller-runtime's standby managers are. The Deployment's
rolling update waits for new pods to be Ready, and a new pod is a standby until the old
leader goes, so a NotReady standby would stall every `helm upgrade`; and the
PodDisruptionBudget (minAvailable 1) counts Ready pods, so with only the leader Ready a node
drain could never evict it. Which replica leads is in the Lease (`kubectl get lease`), in
kvpilot_operator_is_leader, in /readyz's body and in /readyz/leader.
"""
from __future__ import annotations

import asyncio
import time
import urllib.parse

from aiohttp import web

from kvpilot.operator.runtime.leader import LeaderElector


class Probes:
    """elector: None when the operator runs without leader election (it then always leads)."""

    def __init__(self, elector: LeaderElector | None, kopf_ready: asyncio.Event) -> None:
        self.elector, self.kopf_ready = elector, kopf_ready
        self._runner: web.AppRunner | None = None

    @property
    def holds_lease(self) -> bool:
        """Whether this replica may reconcile: it holds the lease, or runs without election."""
        return self.elector is None or self.elector.is_leader

    @property
    def leading(self) -> bool:
        """Whether this replica reconciles now: it holds the lease (or needs none) and Kopf runs."""
        return self.holds_lease and self.kopf_ready.is_set()

    def role(self) -> str:
        """"leader", or "standby, lease NS/NAME held by POD" (the holder as last read, or nobody)."""
        if self.holds_lease:
            return "leader"
        config = self.elector.config
        return f"standby, lease {config.namespace}/{config.name} held by {self.elector.holder or 'nobody'}"

    def checks(self) -> list[tuple[str, bool, str]]:
        """(name, passed, detail) per readiness check."""
        found = [("ping", True, "ok")]
        if self.elector is not None:
            contact = self.elector.last_contact
            fresh = contact is not None and time.monotonic() - contact < self.elector.config.lease_duration_s
            found.append(("lease", fresh, self.role() if fresh else "no answer from the API server about the lease"))
        if self.holds_lease:
            found.append(("operator", self.kopf_ready.is_set(), "reconciling" if self.kopf_ready.is_set()
                          else "starting"))
        return found

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: 200 "ok" whenever the event loop gets to answer."""
        return web.Response(text="ok")

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: 200 when every check passes, else 503 naming the failed ones; ?verbose lists each
        check as the API server's /readyz?verbose does."""
        checks = self.checks()
        ok = all(passed for _, passed, _ in checks)
        if "verbose" in request.query:
            lines = [f"[{'+' if passed else '-'}]{name} {'ok' if passed else 'failed'}: {detail}"
                     for name, passed, detail in checks]
            text = "\n".join([*lines, f"readyz check {'passed' if ok else 'failed'}"]) + "\n"
        else:
            text = f"ok: {self.role()}" if ok else "not ready: " + "; ".join(
                f"{name}: {detail}" for name, passed, detail in checks if not passed)
        return web.Response(status=200 if ok else 503, text=text)

    async def leader(self, request: web.Request) -> web.Response:
        """/readyz/leader: 200 "leader" only while this replica reconciles, else 503 with its role."""
        if self.leading:
            return web.Response(text="leader")
        return web.Response(status=503, text="leader, starting" if self.holds_lease
                            else self.role())

    async def start(self, url: str) -> None:
        """Serve at url's host and port; url's path is the liveness path (default /healthz)."""
        parsed = urllib.parse.urlparse(url)
        app = web.Application()
        app.router.add_get(parsed.path or "/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/readyz/leader", self.leader)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, parsed.hostname or "0.0.0.0", parsed.port or 8080).start()

    async def stop(self) -> None:
        """Stops serving the probes (a no-op when they were never started)."""
        if self._runner is not None:
            await self._runner.cleanup()
