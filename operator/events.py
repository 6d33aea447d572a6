"""Kubernetes Events about an InferenceService, from Kopf's handlers or from the resync loop.

kopf.event() works only inside a Kopf handler: it puts the event on a queue found through a
context variable that Kopf sets for handlers, and raises LookupError anywhere else. The
operator-wide resync loop is not a handler, so there the Event is written directly, as Kopf
writes it (core/v1 Event, involvedObject = the resource, source.component "kopf").
Source: Kubernetes API reference, Event v1; Kopf docs, "Events"."""
from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import kopf

from kvpilot.api.kube import AsyncKubeClient

SOURCE = "kopf"  # the component Kopf's own events name, so both kinds read alike


def build_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> dict[str, Any]:
    """A core/v1 Event about `body` (an InferenceService), timestamped now."""
    meta = body["metadata"]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": body.get("apiVersion", ""), "kind": body.get("kind", ""),
                               "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid", "")},
            "type": type_, "reason": reason, "message": message[:1024], "source": {"component": SOURCE},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1, "reportingComponent": SOURCE}


async def announce(kube: AsyncKubeClient, body: Mapping[str, Any], in_handler: bool, type_: str, reason: str,
                   message: str) -> None:
    """Posts an Event: through Kopf inside a handler, directly from the resync loop."""
    if in_handler:
        kopf.event(body, type=type_, reason=reason, message=message)
    else:
        await kube.create(build_event(body, type_, reason, message))
