"""Turns a Kubernetes pod spec (what the operator's builders or the chart render) into a
`podman run` command line that runs its first container the way the kubelet would: the same
user, read-only root filesystem, dropped capabilities, no privilege escalation, the same
command and environment, and only the volumes the pod mounts.

How each Kubernetes field maps (Kubernetes API reference, PodSpec / Container / Volume):
- securityContext.runAsUser/runAsGroup -> --user U:G; readOnlyRootFilesystem -> --read-only
  (with --read-only-tmpfs=false: podman would otherwise add writable /tmp, /var/tmp and /run,
  which a pod does not have); capabilities.drop [ALL] -> --cap-drop ALL;
  allowPrivilegeEscalation: false -> --security-opt no-new-privileges.
- command replaces the image's ENTRYPOINT, args its CMD.
- emptyDir -> a fresh host directory, mode 0777 as the kubelet creates it, group-owned by
  fsGroup with the setgid bit where the pod sets one; emptyDir medium Memory -> a tmpfs of
  sizeLimit;
  configMap -> a directory of its keys as files, read-only.
- env value -> -e NAME=VALUE; valueFrom (Secrets, fieldRef) -> -e NAME, its value passed in
  podman's environment, so that no secret is on a command line.
- resources.limits cpu/memory -> --cpus/--memory.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any

UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity_bytes(quantity: str) -> int:
    """'4Gi' -> 4294967296 (Kubernetes resource quantity, binary or decimal suffix)."""
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity))
    if not m or (m.group(2) and m.group(2) not in UNITS):
        raise ValueError(f"unsupported quantity {quantity!r}")
    return int(float(m.group(1)) * UNITS.get(m.group(2), 1))


def cpus(quantity: str) -> float:
    """'500m' -> 0.5, '2' -> 2.0."""
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


@dataclass
class PodmanRun:
    """`argv` is podman's arguments after `run` up to and including the image; `command` the
    container's arguments after the image; `env` the values of the -e NAME entries;
    `volumes` the host directory behind each mount path (emptyDir and configMap)."""

    argv: list[str]
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    volumes: dict[str, pathlib.Path] = field(default_factory=dict)


def podman_run(pod: dict[str, Any], image: str, workdir: pathlib.Path, ports: dict[int, int],
               configmaps: dict[str, dict[str, str]] | None = None,
               value_from: dict[str, str] | None = None) -> PodmanRun:
    """The podman arguments for `pod`'s first container. ports maps containerPort -> host port
    (published on 127.0.0.1); configmaps gives the data of each configMap volume by name;
    value_from gives the value of each env entry with valueFrom. Raises ValueError on a volume
    kind or a field this mapping does not know (so a pod spec that grows one fails the test)."""
    container = pod["containers"][0]
    pod_sc, sc = pod.get("securityContext", {}), container.get("securityContext", {})
    argv = ["--name", f"kvpilot-test-{os.getpid()}-{container['name']}"]
    user, group = sc.get("runAsUser", pod_sc.get("runAsUser")), sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    if user is not None:
        argv += ["--user", f"{user}:{group if group is not None else user}"]
    if sc.get("readOnlyRootFilesystem"):
        argv += ["--read-only", "--read-only-tmpfs=false"]
    for cap in sc.get("capabilities", {}).get("drop", []):
        argv += ["--cap-drop", cap]
    if sc.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt", "no-new-privileges"]
    limits = container.get("resources", {}).get("limits", {})
    if "cpu" in limits:
        argv += ["--cpus", str(cpus(limits["cpu"]))]
    if "memory" in limits:
        argv += ["--memory", str(quantity_bytes(limits["memory"]))]
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            argv += ["-e", f"{var['name']}={var['value']}"]
        else:
            env[var["name"]] = (value_from or {})[var["name"]]
            argv += ["-e", var["name"]]
    volumes = _mounts(pod, container, workdir, fs_group=pod_sc.get("fsGroup"), configmaps=configmaps or {})
    for path, (kind, source, options) in volumes.items():
        if kind == "tmpfs":
            argv += ["--mount", f"type=tmpfs,destination={path}{options}"]
        else:
            argv += ["-v", f"{source}:{path}:{options}"]
    for port in container.get("ports", []):
        argv += ["-p", f"127.0.0.1:{ports[port['containerPort']]}:{port['containerPort']}"]
    if "command" in container:
        argv += ["--entrypoint", json.dumps(container["command"])]
    return PodmanRun(argv + [image], list(container.get("args", [])), env,
                     {p: s for p, (k, s, _) in volumes.items() if k != "tmpfs"})


def _mounts(pod: dict[str, Any], container: dict[str, Any], workdir: pathlib.Path, fs_group: int | None,
            configmaps: dict[str, dict[str, str]]) -> dict[str, tuple[str, Any, str]]:
    """mountPath -> (kind, host source, options) for each of the container's volumeMounts."""
    by_name = {v["name"]: v for v in pod.get("volumes", [])}
    mounts: dict[str, tuple[str, Any, str]] = {}
    for mount in container.get("volumeMounts", []):
        volume, path = by_name[mount["name"]], mount["mountPath"]
        mode = "ro" if mount.get("readOnly") else "rw"
        host = workdir / "volumes" / mount["name"]
        if "emptyDir" in volume and volume["emptyDir"].get("medium") == "Memory":
            size = volume["emptyDir"].get("sizeLimit")
            mounts[path] = ("tmpfs", None, f",tmpfs-size={quantity_bytes(size)}" if size else "")
        elif "emptyDir" in volume:
            host.mkdir(parents=True)
            host.chmod(0o777)  # the kubelet creates emptyDir directories world-writable
            if fs_group is not None:
                os.chown(host, -1, fs_group)
                host.chmod(0o2777)
            mounts[path] = ("dir", host, mode)
        elif "configMap" in volume:
            host.mkdir(parents=True)
            for key, value in configmaps[volume["configMap"]["name"]].items():
                (host / key).write_text(value)
            mounts[path] = ("dir", host, "ro")
        else:
            raise ValueError(f"volume {mount['name']!r}: {sorted(volume)} is not mapped to podman")
    return mounts
