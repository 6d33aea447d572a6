"""Leader election on a coordination.k8s.io/v1 Lease (kvpilot.operator.runtime.leader) against the real
API server (tests/kube), with short durations (lease 2 s, renew deadline 1.5 s, retry 0.25 s)
so that expiries happen within a test: the first candidate creates the Lease, a standby waits
out the lease duration of a holder that stopped renewing, a resourceVersion-guarded PUT lets
exactly one of two racing standbys through, a leader steps down when it cannot renew or sees
another holder, a released lease is taken at the next retry, and the probes tell the leader
from the standby. The whole operator (two processes, the leader killed) is in
test_operator_takeover.py."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from kube.tools import free_port

from kvpilot.api.kube import ApiError, AsyncKubeClient, KubeClient, load_configuration
from kvpilot.operator.runtime.leader import LeaderElector, LeaseConfig, lead
from kvpilot.operator.runtime.probes import Probes

FAST = {"lease_duration_s": 2.0, "renew_deadline_s": 1.5, "retry_period_s": 0.25}


def lease_config(cluster, name: str, identity: str) -> LeaseConfig:
    return LeaseConfig(name=name, namespace=cluster.namespace, identity=identity, **FAST)


def client(cluster) -> AsyncKubeClient:
    return AsyncKubeClient.from_environment(str(cluster.kubeconfig), user_agent="kvpilot-test-leader")


def read_lease(cluster, name: str) -> dict:
    return KubeClient.from_environment(str(cluster.kubeconfig)).get(
        f"/apis/coordination.k8s.io/v1/namespaces/{cluster.namespace}/leases/{name}")


def run(coro):
    return asyncio.run(coro)


def usurp(cluster, name: str, holder: str) -> None:
    """Write another holder into the Lease, as a standby does once the leader's renewals
    stalled past the lease duration (retried on 409: the leader renews meanwhile)."""
    kube = KubeClient.from_environment(str(cluster.kubeconfig))
    for _ in range(20):
        lease = read_lease(cluster, name)
        lease["spec"]["holderIdentity"] = holder
        try:
            kube.replace(f"/apis/coordination.k8s.io/v1/namespaces/{cluster.namespace}/leases/{name}", lease)
            return
        except ApiError as e:
            if e.status != 409:
                raise
    raise AssertionError(f"could not write holder {holder} into lease {name}")


def test_durations_that_client_go_refuses_are_refused():
    with pytest.raises(ValueError, match="greater than the renew deadline"):
        LeaseConfig(identity="a", lease_duration_s=10, renew_deadline_s=10)
    with pytest.raises(ValueError, match="1.2 x the retry"):
        LeaseConfig(identity="a", renew_deadline_s=2, retry_period_s=2)
    with pytest.raises(ValueError, match="POD_NAME"):
        LeaseConfig(identity="")
    assert LeaseConfig(identity="a").lease_duration_s == 15.0  # kube-controller-manager's defaults


def test_the_first_candidate_creates_the_lease_and_the_second_waits(cluster):
    async def go() -> tuple[bool, bool, str]:
        a, b = (LeaderElector(client(cluster), lease_config(cluster, "first", i)) for i in ("pod-a", "pod-b"))
        await asyncio.wait_for(a.acquire(), 10)
        return a.is_leader, await b.try_acquire_or_renew(), b.holder
    assert run(go()) == (True, False, "pod-a")
    spec = read_lease(cluster, "first")["spec"]
    assert spec["holderIdentity"] == "pod-a" and spec["leaseDurationSeconds"] == 2 and spec["leaseTransitions"] == 0
    assert spec["acquireTime"] == spec["renewTime"] and spec["renewTime"].endswith("Z")


def test_a_standby_takes_over_only_once_the_holder_stopped_renewing_for_the_lease_duration(cluster):
    async def go() -> float:
        a, b = (LeaderElector(client(cluster), lease_config(cluster, "expiry", i)) for i in ("pod-a", "pod-b"))
        await asyncio.wait_for(a.acquire(), 10)  # and then never renews: a killed leader
        start = time.monotonic()
        await asyncio.wait_for(b.acquire(), 10)
        return time.monotonic() - start
    waited = run(go())
    assert 2.0 <= waited < 2.0 + 1.5, waited  # the lease duration, plus at most one jittered retry
    spec = read_lease(cluster, "expiry")["spec"]
    assert spec["holderIdentity"] == "pod-b" and spec["leaseTransitions"] == 1
    assert spec["acquireTime"] == spec["renewTime"]


def test_a_renewing_leader_keeps_the_lease(cluster):
    async def go() -> tuple[bool, list[bool], str, str]:
        a, b = (LeaderElector(client(cluster), lease_config(cluster, "renewed", i)) for i in ("pod-a", "pod-b"))
        await asyncio.wait_for(a.acquire(), 10)
        first = read_lease(cluster, "renewed")["spec"]["renewTime"]
        holding = asyncio.create_task(a.hold())
        tries = []
        for _ in range(6):  # 3 s: past the lease duration
            tries.append(await b.try_acquire_or_renew())
            await asyncio.sleep(0.5)
        holding.cancel()
        return a.is_leader, tries, first, read_lease(cluster, "renewed")["spec"]["renewTime"]
    leader, tries, first, last = run(go())
    assert leader and not any(tries) and last > first


def test_of_two_standbys_racing_for_an_expired_lease_the_resource_version_lets_one_through(cluster):
    """b reads the Lease, c takes it meanwhile, b's PUT carries the resourceVersion b read: 409."""
    class Gated(AsyncKubeClient):
        def __init__(self, inner: AsyncKubeClient, gate: asyncio.Event):
            super().__init__(inner.client)
            self.gate = gate

        async def replace(self, path, obj):
            await self.gate.wait()
            return await super().replace(path, obj)

    async def go() -> tuple[bool, bool, str]:
        gate = asyncio.Event()
        a = LeaderElector(client(cluster), lease_config(cluster, "race", "pod-a"))
        b = LeaderElector(Gated(client(cluster), gate), lease_config(cluster, "race", "pod-b"))
        c = LeaderElector(client(cluster), lease_config(cluster, "race", "pod-c"))
        await asyncio.wait_for(a.acquire(), 10)
        await b.try_acquire_or_renew(), await c.try_acquire_or_renew()  # both observe a's record
        await asyncio.sleep(2.1)  # a's lease expires for both
        b_try = asyncio.create_task(b.try_acquire_or_renew())
        await asyncio.sleep(0.3)  # b has read the Lease and waits at its PUT
        c_won = await c.try_acquire_or_renew()
        gate.set()
        return c_won, await b_try, read_lease(cluster, "race")["spec"]["holderIdentity"]
    assert run(go()) == (True, False, "pod-c")


def test_a_leader_that_cannot_reach_the_api_server_steps_down_within_the_renew_deadline(cluster):
    async def go() -> tuple[float, bool]:
        a = LeaderElector(client(cluster), lease_config(cluster, "cut-off", "pod-a"))
        await asyncio.wait_for(a.acquire(), 10)
        dead = load_configuration(str(cluster.kubeconfig))
        dead.host = f"https://127.0.0.1:{free_port()}"  # nothing listens: every renewal fails
        a.kube = AsyncKubeClient(KubeClient(dead))
        start = time.monotonic()
        await asyncio.wait_for(a.hold(), 10)
        return time.monotonic() - start, a.is_leader
    took, leader = run(go())
    assert not leader and took < 0.25 + 1.5 + 0.5, took  # one retry period, then the renew deadline


def test_a_leader_that_sees_another_holder_steps_down_at_once(cluster):
    async def go() -> tuple[float, bool]:
        a = LeaderElector(client(cluster), lease_config(cluster, "usurped", "pod-a"))
        await asyncio.wait_for(a.acquire(), 10)
        holding = asyncio.create_task(a.hold())
        await asyncio.to_thread(usurp, cluster, "usurped", "pod-z")
        start = time.monotonic()
        await asyncio.wait_for(holding, 5)
        return time.monotonic() - start, a.is_leader
    took, leader = run(go())
    assert not leader and took < 0.25 + 0.5, took


def test_a_released_lease_is_taken_at_the_next_retry(cluster):
    async def go() -> tuple[bool, float, str]:
        a, b = (LeaderElector(client(cluster), lease_config(cluster, "released", i)) for i in ("pod-a", "pod-b"))
        await asyncio.wait_for(a.acquire(), 10)
        await b.try_acquire_or_renew()
        released = await a.release()
        start = time.monotonic()
        await asyncio.wait_for(b.acquire(), 10)
        return released, time.monotonic() - start, read_lease(cluster, "released")["spec"]["holderIdentity"]
    released, took, holder = run(go())
    assert released and holder == "pod-b" and took < 0.5, took


def test_lead_runs_the_work_only_while_leading_and_calls_on_lost_when_the_lease_goes(cluster):
    async def go() -> tuple[bool, bool, list[str], bool]:
        a, b = (LeaderElector(client(cluster), lease_config(cluster, "lead", i)) for i in ("pod-a", "pod-b"))
        await asyncio.wait_for(a.acquire(), 10)
        log: list[str] = []

        async def work() -> None:
            log.append("started")
            try:
                await asyncio.Event().wait()
            finally:
                log.append("cancelled")
        b_lead = asyncio.create_task(lead(b, work, on_lost=lambda: log.append("lost")))
        await asyncio.sleep(1.0)
        started_as_standby = bool(log)
        await a.release()  # b leads at its next retry
        await asyncio.sleep(1.0)
        leading = b.is_leader
        await asyncio.to_thread(usurp, cluster, "lead", "pod-z")
        ended_cleanly = await asyncio.wait_for(b_lead, 5)
        return started_as_standby, leading, log, ended_cleanly
    assert run(go()) == (False, True, ["started", "lost", "cancelled"], False)


def test_the_probes_tell_the_leader_from_the_standby_and_both_are_ready(cluster):
    async def get(port: int, path: str) -> tuple[int, str]:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}{path}") as r:
            return r.status, await r.text()

    async def go() -> dict:
        a, b = (LeaderElector(client(cluster), lease_config(cluster, "probes", i)) for i in ("pod-a", "pod-b"))
        kopf_a, kopf_b = asyncio.Event(), asyncio.Event()
        probes = {"a": Probes(a, kopf_a), "b": Probes(b, kopf_b)}
        ports = {"a": free_port(), "b": free_port()}
        for k, p in probes.items():
            await p.start(f"http://127.0.0.1:{ports[k]}/healthz")
        seen = {"b before any lease read": await get(ports["b"], "/readyz")}
        await asyncio.wait_for(a.acquire(), 10)
        await b.try_acquire_or_renew()
        seen["a starting"] = await get(ports["a"], "/readyz")
        kopf_a.set()  # Kopf's ready flag: the startup handlers ran
        for k in ("a", "b"):
            seen[f"{k} healthz"] = await get(ports[k], "/healthz")
            seen[f"{k} readyz"] = await get(ports[k], "/readyz")
            seen[f"{k} leader"] = await get(ports[k], "/readyz/leader")
        seen["b verbose"] = await get(ports["b"], "/readyz?verbose")
        for p in probes.values():
            await p.stop()
        return seen
    seen = run(go())
    assert seen["b before any lease read"][0] == 503
    assert seen["a starting"] == (503, "not ready: operator: starting")
    assert seen["a healthz"] == seen["b healthz"] == (200, "ok")
    assert seen["a readyz"] == (200, "ok: leader") and seen["a leader"] == (200, "leader")
    standby = f"standby, lease {cluster.namespace}/probes held by pod-a"
    assert seen["b readyz"] == (200, f"ok: {standby}") and seen["b leader"] == (503, standby)
    assert seen["b verbose"] == (200, f"[+]ping ok: ok\n[+]lease ok: {standby}\nreadyz check passed\n")
