"""The in-cluster tuner: a Kopf daemon per InferenceService whose `spec.tuning.enabled` is
true and whose tuning is not Done. It runs the same session as `kvpilot tune --namespace
--name` (kvpilot.tuner.cluster.session) on a thread, posts an event per trial, and stops
between trials when the operator shuts down; the study lives in the resource's ConfigMap,
so the next operator process resumes it.

Load it next to the operator's handlers in one Kopf process:

    kopf run -m kvpilot.operator.handlers -m kvpilot.tuner.cluster.daemon --namespace NS

Configuration (the operator Deployment's environment):
    KVPILOT_TUNER_ARGS      more `kvpilot tune` flags, e.g. "--num-requests 32 --target-url URL"
    KVPILOT_PROMETHEUS_URL  measure through this Prometheus (default: scrape the engine)
To tune again after Done, set spec.tuning.enabled to false (the daemon clears
status.tuning), then back to true. With spec.tuning.mode continuous the daemon does not end
after the study: it watches the live traffic and re-tunes (`kvpilot.tuner.cluster.continuous`)
until the mode or tuning.enabled changes; Kopf stops it when `wants_tuning` no longer holds.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

import kopf

from kvpilot.api.crd import GROUP, PLURAL, VERSION
from kvpilot.tuner import cli
from kvpilot.tuner.cluster.session import run_cluster
from kvpilot.api.kube import KubeClient
from kvpilot.tuner.search.loop import TuningStopped
from kvpilot.engine.settings.env import KVPILOT_PROMETHEUS_URL, KVPILOT_TUNER_ARGS


def wants_tuning(spec: kopf.Spec, status: kopf.Status, **_: Any) -> bool:
    """Tuning on and not Done; with spec.tuning.mode continuous, also after Done (a resource
    switched from once to continuous starts watching)."""
    tuning = spec.get("tuning") or {}
    if not tuning.get("enabled"):
        return False
    return tuning.get("mode") == "continuous" or (status.get("tuning") or {}).get("phase") != "Done"


def session_args(namespace: str, name: str, env: dict[str, str] | os._Environ = os.environ) -> list[str]:
    """The `kvpilot tune` flags for one resource: its identity, then KVPILOT_TUNER_ARGS,
    then --prometheus-url from KVPILOT_PROMETHEUS_URL unless the args name one."""
    extra = shlex.split(env.get(KVPILOT_TUNER_ARGS, ""))
    argv = ["--namespace", namespace, "--name", name, *extra]
    if env.get(KVPILOT_PROMETHEUS_URL) and "--prometheus-url" not in extra:
        argv += ["--prometheus-url", env[KVPILOT_PROMETHEUS_URL]]
    return argv


@kopf.daemon(GROUP, VERSION, PLURAL, id="tuner", when=wants_tuning, cancellation_timeout=5.0)
def tune(namespace: str, name: str, body: kopf.Body, stopped: kopf.DaemonStopped, logger: kopf.Logger,
         **_: Any) -> None:
    """Runs the tuning session for one resource to its end (or until the operator stops)."""
    a = cli.parse(session_args(namespace, name))
    kube = KubeClient.from_environment(a.kubeconfig, user_agent="kvpilot-tuner")
    try:
        run_cluster(a, kube, stop=lambda: bool(stopped),
                    on_event=lambda reason, message, type="Normal": kopf.event(body, type=type, reason=reason,
                                                                             message=message))
    except TuningStopped as e:
        logger.info(f"tuning of {namespace}/{name} paused: {e}")
    except SystemExit as e:  # run_cluster's refusals (e.g. tuning turned off) carry their reason
        kopf.event(body, type="Warning", reason="TuningFailed", message=str(e))
    finally:
        kube.close()


@kopf.on.field(GROUP, VERSION, PLURAL, field="spec.tuning.enabled", id="tuner-reset")
def reset(old: Any, new: Any, namespace: str, name: str, **_: Any) -> None:
    """Tuning switched off: clear status.tuning so that switching it on starts afresh."""
    if old and not new:
        kube = KubeClient.from_environment(os.environ.get("KUBECONFIG") or None, user_agent="kvpilot-tuner")
        try:
            kube.patch_status(namespace, name, {"tuning": None})
        finally:
            kube.close()
