"""Leader election on a coordination.k8s.io/v1 Lease, so that of the chart's operator replicas
exactly one reconciles and another takes over when it dies.

Why a Lease and not Kopf's peering: Kopf coordinates replicas through KopfPeering objects
in which every replica writes its priority; the highest runs and the others pause, but
replicas of equal priority all pause ("freeze") with a warning, and distinct priorities per
pod are something a Deployment's identical pod template cannot give. A Lease is what
kube-controller-manager, kube-scheduler and every controller-runtime manager use: one object
whose holderIdentity is the leader, renewed every retryPeriod; whoever sees it unrenewed for
leaseDurationSeconds takes it with a PUT guarded by resourceVersion, so of two racing
standbys the API server lets exactly one through (409 Conflict for the other).

Why not `kubernetes.leaderelection` (the `kubernetes` client has a LeaseLock since v21): it
runs on threads with blocking sleeps that cannot be cancelled, takes its credentials from the
process-wide default client, never releases the lease on shutdown and does not count
leaseTransitions. The loop below is client-go's (tools/leaderelection), on asyncio and on our
own client:

- standby: every retryPeriod x (1 + 1.2 x random) it reads the Lease; it takes it when the
  holder is empty, is itself (a restarted container of the same pod), or has not renewed for
  the Lease's leaseDurationSeconds measured on this process's own monotonic clock from when
  it last saw the record change (no trust in another machine's wall clock);
- leader: renews every retryPeriod; when no renewal succeeds within renewDeadline, or another
  holder shows up, leadership is lost and the process must stop reconciling at once;
- release: on a clean shutdown the leader writes an empty holder (leaseDurationSeconds 1),
  so a standby takes over within one retryPeriod instead of a leaseDuration.

Defaults as kube-controller-manager's: leaseDuration 15 s, renewDeadline 10 s, retryPeriod 2 s.
Source: k8s.io/client-go/tools/leaderelection (leaderelection.go, resourcelock/leaselock.go).
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.api.kube import ApiError, AsyncKubeClient, object_path
from kvpilot.engine.settings.env import KVPILOT_OPERATOR_NAMESPACE

JITTER = 1.2  # client-go's JitterFactor for the standby's retries
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
logger = logging.getLogger("kvpilot.operator.runtime.leader")


@dataclass(frozen=True)
class LeaseConfig:
    """Which Lease, who we are, and client-go's three durations (seconds)."""

    name: str = "kvpilot-operator"
    namespace: str = "default"
    identity: str = ""
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("leader election needs an identity: set POD_NAME (the chart does) or --leader-election-id")
        if min(self.lease_duration_s, self.renew_deadline_s, self.retry_period_s) <= 0:
            raise ValueError("leader election durations must be > 0")
        if self.lease_duration_s <= self.renew_deadline_s:
            raise ValueError(f"lease duration ({self.lease_duration_s} s) must be greater than the renew deadline "
                             f"({self.renew_deadline_s} s): a standby could take the lease while the leader still works")
        if self.renew_deadline_s <= JITTER * self.retry_period_s:
            raise ValueError(f"renew deadline ({self.renew_deadline_s} s) must be greater than {JITTER} x the retry "
                             f"period ({self.retry_period_s} s): the leader needs more than one try to renew")

    @property
    def path(self) -> str:
        """The Lease's API path (/apis/coordination.k8s.io/v1/namespaces/NS/leases/NAME)."""
        return object_path("coordination.k8s.io/v1", "leases", self.namespace, self.name)


def default_identity(env: dict[str, str] | os._Environ = os.environ) -> str:
    """POD_NAME (the chart sets it from metadata.name), else hostname_uuid as controller-runtime
    does, so that two processes on one machine never share an identity."""
    return env.get("POD_NAME") or f"{socket.gethostname()}_{uuid.uuid4()}"


def default_namespace(env: dict[str, str] | os._Environ = os.environ) -> str:
    """KVPILOT_OPERATOR_NAMESPACE (the chart sets it), else the pod's service account
    namespace, else "default"."""
    if env.get(KVPILOT_OPERATOR_NAMESPACE):
        return env[KVPILOT_OPERATOR_NAMESPACE]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def micro_time(when: datetime.datetime | None = None) -> str:
    """A metav1.MicroTime as the API server writes it: RFC 3339, microseconds, UTC."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """One candidate for one Lease. `await acquire()` returns once this process leads;
    `await hold()` renews until leadership is lost and then returns; `await release()`
    hands the lease back. `is_leader`, `holder` and `last_contact` feed the probes and metrics."""

    def __init__(self, kube: AsyncKubeClient, config: LeaseConfig,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.kube, self.config = kube, config
        self.is_leader = False
        self.holder = ""  # the holderIdentity last read
        self.last_contact: float | None = None  # monotonic time of the last answer from the API server
        self._observed: tuple[Any, ...] | None = None  # (holder, renewTime, leaseDurationSeconds, transitions)
        self._observed_at = 0.0
        self._on_change = on_change

    def _set_leader(self, leader: bool) -> None:
        if leader != self.is_leader:
            self.is_leader = leader
            if self._on_change is not None:
                self._on_change(leader)

    def _observe(self, spec: dict[str, Any]) -> None:
        record = (spec.get("holderIdentity") or "", spec.get("renewTime"), spec.get("leaseDurationSeconds"),
                  spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        self.holder = record[0]

    def _lease(self, spec: dict[str, Any], resource_version: str | None = None) -> dict[str, Any]:
        metadata = {"name": self.config.name, "namespace": self.config.namespace}
        if resource_version:
            metadata["resourceVersion"] = resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}

    async def try_acquire_or_renew(self) -> bool:
        """One round of client-go's tryAcquireOrRenew: True when this process holds the lease
        afterwards. Raises ApiError (other than the 409 of a lost race) and connection errors."""
        now = micro_time()
        lease = await self.kube.get(self.config.path)
        self.last_contact = time.monotonic()
        if lease is None:
            spec = {"holderIdentity": self.config.identity, "leaseDurationSeconds": round(self.config.lease_duration_s),
                    "acquireTime": now, "renewTime": now, "leaseTransitions": 0}
            try:
                created = await self.kube.create(self._lease(spec))
            except ApiError as e:
                if e.status == 409:  # another candidate created it first
                    return False
                raise
            self._observe(created["spec"])
            return True
        spec = dict(lease.get("spec") or {})
        self._observe(spec)
        holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or self.config.lease_duration_s)
        if holder and holder != self.config.identity and time.monotonic() < self._observed_at + duration:
            return False  # held by another, renewed within its lease duration as we measure it
        if holder != self.config.identity:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        spec.update(holderIdentity=self.config.identity, leaseDurationSeconds=round(self.config.lease_duration_s),
                    renewTime=now)
        try:
            updated = await self.kube.replace(self.config.path,
                                              self._lease(spec, lease["metadata"].get("resourceVersion")))
        except ApiError as e:
            if e.status == 409:  # the Lease changed since we read it: someone else won this round
                return False
            raise
        self._observe(updated["spec"])
        return True

    async def _attempt(self, timeout: float | None = None) -> bool:
        try:
            return await asyncio.wait_for(self.try_acquire_or_renew(), timeout)
        except Exception as e:  # noqa: BLE001  (ApiError, timeouts, urllib3's connection errors: retried)
            logger.warning(f"lease {self.config.namespace}/{self.config.name}: {type(e).__name__}: {e}")
            return False

    async def acquire(self) -> None:
        """Wait as a standby until this process holds the lease (cancel to stop waiting)."""
        logger.info(f"{self.config.identity} is a candidate for lease {self.config.namespace}/{self.config.name}")
        while not await self._attempt(self.config.renew_deadline_s):
            await asyncio.sleep(self.config.retry_period_s * (1 + JITTER * random.random()))
        logger.info(f"{self.config.identity} acquired lease {self.config.namespace}/{self.config.name}")
        self._set_leader(True)

    async def hold(self) -> None:
        """Renew every retryPeriod; return when leadership is lost: no renewal succeeded within
        renewDeadline, or the Lease names another holder."""
        while True:
            await asyncio.sleep(self.config.retry_period_s)
            deadline = time.monotonic() + self.config.renew_deadline_s
            while not await self._attempt(max(0.0, deadline - time.monotonic())):
                if self.holder and self.holder != self.config.identity:
                    logger.error(f"lease {self.config.namespace}/{self.config.name} is now held by {self.holder}")
                    self._set_leader(False)
                    return
                if time.monotonic() + self.config.retry_period_s >= deadline:
                    logger.error(f"could not renew lease {self.config.namespace}/{self.config.name} within "
                                 f"{self.config.renew_deadline_s:g} s")
                    self._set_leader(False)
                    return
                await asyncio.sleep(self.config.retry_period_s)

    async def release(self) -> bool:
        """Give the lease back (empty holder, leaseDurationSeconds 1) if we hold it, so that a
        standby takes over at its next retry. True when released."""
        if not self.is_leader:
            return False
        self._set_leader(False)
        try:
            lease = await self.kube.get(self.config.path)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.config.identity:
                return False
            now = micro_time()
            spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1, "acquireTime": now,
                    "renewTime": now}
            await self.kube.replace(self.config.path, self._lease(spec, lease["metadata"].get("resourceVersion")))
        except Exception as e:  # noqa: BLE001  (shutting down: the lease then expires by itself)
            logger.warning(f"could not release lease {self.config.namespace}/{self.config.name}: {e}")
            return False
        logger.info(f"{self.config.identity} released lease {self.config.namespace}/{self.config.name}")
        return True


def exit_lost() -> None:
    """What controller-runtime does when leadership is lost: exit at once, non-zero, so the
    kubelet restarts the container as a standby, and no handler writes another byte."""
    logger.critical("leader election lost: exiting")
    logging.shutdown()
    os._exit(1)


async def lead(elector: LeaderElector, work: Callable[[], Awaitable[None]],
               on_lost: Callable[[], None] = exit_lost) -> bool:
    """Wait for the lease, then run `work()` (the Kopf operator) while renewing it. Returns
    True when the work ended by itself (e.g. SIGTERM stopped Kopf), having released the lease;
    calls on_lost() and returns False when leadership is lost first (work is cancelled)."""
    await elector.acquire()
    worker = asyncio.create_task(work(), name="leader work")
    holder = asyncio.create_task(elector.hold(), name="lease renewal")
    done, _ = await asyncio.wait({worker, holder}, return_when=asyncio.FIRST_COMPLETED)
    if holder in done and not worker.done():
        on_lost()
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        return False
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    await elector.release()
    worker.result()  # re-raise what stopped the work, if anything did
    return True
