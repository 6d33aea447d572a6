"""The operator's per-process state: what its environment tells it (OperatorConfig, set by the
Helm chart) and what its handlers share (Context, kept in Kopf's memo)."""
from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.api.kube import AsyncKubeClient

from kvpilot.operator.render.builders import Images
from kvpilot.operator.render.network import NetworkPolicyConfig
from kvpilot.operator.policy import Policy
from kvpilot.engine.settings.env import (
    KVPILOT_ENGINE_IMAGE, KVPILOT_RESYNC_SECONDS, KVPILOT_VLLM_CPU_IMAGE, KVPILOT_VLLM_IMAGE,
    KVPILOT_WATCH_TIMEOUT_SECONDS,
)


RECONCILE_SLOTS = 64  # twice the API client's threads (kvpilot.api.kube.WORKERS), so they stay busy


@dataclass
class OperatorConfig:
    """What the operator is told by its environment (the Helm chart sets these)."""

    images: Images = field(default_factory=Images)
    resync_seconds: float = 300.0
    watch_timeout_seconds: int = 300  # the API server's ?timeoutSeconds= takes an integer only
    podmonitor_check_seconds: float = 300.0
    network: NetworkPolicyConfig = field(default_factory=NetworkPolicyConfig)
    policy: Policy = field(default_factory=Policy)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "OperatorConfig":
        """Reads the chart's variables: KVPILOT_ENGINE_IMAGE / _VLLM_IMAGE / _VLLM_CPU_IMAGE (engine
        images), KVPILOT_RESYNC_SECONDS (s), KVPILOT_WATCH_TIMEOUT_SECONDS (whole s), the NetworkPolicy
        and Policy variables; unset ones keep the defaults. Raises ValueError on a non-numeric duration
        (and json.JSONDecodeError, a ValueError, on bad KVPILOT_OPERATOR_LABELS / _PROMETHEUS_PEER)."""
        images = Images(kvpilot=env.get(KVPILOT_ENGINE_IMAGE, Images.kvpilot),
                        vllm=env.get(KVPILOT_VLLM_IMAGE, Images.vllm),
                        vllm_cpu=env.get(KVPILOT_VLLM_CPU_IMAGE, Images.vllm_cpu))
        return cls(images=images,
                   resync_seconds=float(env.get(KVPILOT_RESYNC_SECONDS, 300)),
                   watch_timeout_seconds=int(env.get(KVPILOT_WATCH_TIMEOUT_SECONDS, 300)),
                   network=NetworkPolicyConfig.from_env(env), policy=Policy.from_env(env))


@dataclass
class Context:
    """Per-process state shared by the handlers (kept in Kopf's memo)."""

    kube: AsyncKubeClient
    config: OperatorConfig
    # (namespace, name) -> the resource as the watch last delivered it: the resync loop's
    # scope, and the owner a child Deployment's event refreshes, without a GET of each
    known: dict[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)
    # (namespace, name) -> time.monotonic() of its last complete reconcile (the resync skips
    # a resource reconciled within its interval)
    reconciled_at: dict[tuple[str, str], float] = field(default_factory=dict)
    # (namespace, name) -> metadata.generation its last complete reconcile acted on (a child's
    # watch repairs drift only once the current generation is reconciled: operator/child_watch.py)
    reconciled_generation: dict[tuple[str, str], Any] = field(default_factory=dict)
    # (namespace, name) -> the child Deployment as its watch last delivered it: the freshest
    # state the status can be computed from (a reconcile's own read or write of it may be
    # overtaken by the rollout while the reconcile's other requests wait)
    deployments: dict[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)
    # one status computation and write at a time per resource: the last writer then computes
    # from the freshest state, instead of an older computation landing after a newer one
    # reconciles running at once (the rest wait their turn): at 1,000 InferenceServices created
    # together, a thousand reconciles each holding its resource, rendered children and
    # responses made most of the operator's peak memory, and more of them in flight than the
    # API client has threads only queue their requests (issue 42)
    reconcile_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(RECONCILE_SLOTS))
    status_locks: defaultdict[tuple[str, str], asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))
    # (namespace, name) -> the newest generation a status refresh waits for its lock with
    # (refresh_status coalesces on it)
    status_waiting: dict[tuple[str, str], int] = field(default_factory=dict)
    _podmonitors: bool | None = None
    _podmonitors_at: float = 0.0

    async def podmonitors_available(self) -> bool:
        """Whether the monitoring.coreos.com PodMonitor CRD exists (re-checked now and then)."""
        now = time.monotonic()
        if self._podmonitors is None or now - self._podmonitors_at > self.config.podmonitor_check_seconds:
            self._podmonitors = await self.kube.has_resource("monitoring.coreos.com", "v1", "podmonitors")
            self._podmonitors_at = now
        return self._podmonitors
