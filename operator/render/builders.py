"""Pure builders of an InferenceService's children: ConfigMap, Deployment, Service, PodMonitor.

Each takes the resource's name and namespace and its parsed spec and returns a plain dict manifest;
no cluster access. The handlers add ownerReferences (kopf.adopt) and apply them."""
from __future__ import annotations

import base64
import json
import math
import secrets
import shlex
from dataclasses import dataclass
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kvpilot.api.spec import EngineSpec, InferenceServiceSpec
from kvpilot.api.vllm import VLLM_CUDA_IMAGE
from kvpilot.engine.settings.env import KVPILOT_API_KEY, VLLM_CACHE_ROOT, VLLM_TORCH_PROFILER_DIR
from kvpilot.operator.render.engine_args import ADMIN_TOKEN_ENV, API_KEY_ENV, config_hash, engine_command, render_engine_args
from kvpilot.operator.render.vllm_pod import CONFIG_DIR, VLLM_CPU_ENV_SET, vllm_cpu_config, vllm_cpu_env, vllm_cpu_program, vllm_on_cpu

HASH_ANNOTATION = "kvpilot.dev/config-hash"
ISVC_LABEL = "kvpilot.dev/inferenceservice"
ROLE_LABEL = "kvpilot.dev/role"  # multi-pod groups: leader (node 0) or worker (operator/render/group_builders.py)
HOME = "/home/kvpilot"
CACHE = f"{HOME}/.cache"  # the pod's writable cache volume; the root filesystem is read-only

# Where each library writes its caches by default ($HOME/.triton, ~/.nv, /tmp/torchinductor_$USER,
# ...), pointed into the cache volume so that the GPU path (Triton kernels, torch.compile) works
# with readOnlyRootFilesystem. The images set the same (images/Containerfile).
CACHE_ENV = {
    "HOME": HOME,
    "XDG_CACHE_HOME": CACHE,
    "HF_HOME": f"{CACHE}/huggingface",
    "TORCH_HOME": f"{CACHE}/torch",
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE}/torchinductor",
    "TRITON_HOME": CACHE,
    "TRITON_CACHE_DIR": f"{CACHE}/triton",
    "CUDA_CACHE_PATH": f"{CACHE}/nv",
    VLLM_CACHE_ROOT: f"{CACHE}/vllm",
}

# Environment variables the operator sets (or reserves) in the engine container; spec.engine.env
# may not set them (operator/validation.py).
PROFILER_DIR_ENV = VLLM_TORCH_PROFILER_DIR
PROFILES_DIR = f"{HOME}/profiles"
OPERATOR_ENV = frozenset({*CACHE_ENV, "TMPDIR", API_KEY_ENV, KVPILOT_API_KEY, ADMIN_TOKEN_ENV, PROFILER_DIR_ENV,
                          *VLLM_CPU_ENV_SET})
ADMIN_TOKEN_KEY = "token"


@dataclass(frozen=True)
class Images:
    """Default engine images per runtime and device (spec.engine.image overrides them); runtime vllm:
    kvpilot's vLLM CPU image on CPU nodes, the official one on GPUs (both at kvpilot.api.vllm's pin)."""

    kvpilot: str = "kvpilot/engine-cpu:0.1.0"  # make images; the chart sets engineImages.kvpilot
    vllm: str = VLLM_CUDA_IMAGE                # the chart's engineImages.vllm
    vllm_cpu: str = "kvpilot/engine-vllm-cpu:0.1.0"  # make images; the chart's engineImages.vllmCpu

    def for_runtime(self, runtime: str, gpu: bool = False) -> str:
        """The image for `runtime` on a GPU node (gpu) or a CPU node."""
        if runtime == "vllm" and not gpu:
            return self.vllm_cpu
        return getattr(self, runtime)


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select InferenceService `name`'s engine pods (the Deployment's matchLabels)."""
    return {"app.kubernetes.io/name": "kvpilot-engine", "app.kubernetes.io/instance": name}


def child_labels(name: str, spec: InferenceServiceSpec) -> dict[str, str]:
    """Every child's labels: the selector ones, managed-by (the operator's watches filter on it), owner and model."""
    return {**selector_labels(name), "app.kubernetes.io/managed-by": "kvpilot-operator",
            "app.kubernetes.io/component": "engine", ISVC_LABEL: name,
            "kvpilot.dev/model": _label_value(spec.model.display_name)}


def serving_labels(name: str, spec: InferenceServiceSpec) -> dict[str, str]:
    """The pods that serve the API: every engine pod, or with parallelism.nnodes > 1 node 0 of each group
    (the leader; the other nodes run headless). The client Service and the PodMonitor select these."""
    return {**selector_labels(name), ROLE_LABEL: "leader"} if spec.nnodes > 1 else selector_labels(name)


def selector_string(name: str) -> str:
    """The pods' label selector as the scale subresource wants it (k=v,k=v)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def configmap_name(name: str) -> str:
    """The engine ConfigMap's name (NAME-engine)."""
    return f"{name}-engine"


def admin_secret_name(name: str) -> str:
    """The admin-token Secret's name (NAME-admin-token; build_admin_secret)."""
    return f"{name}-admin-token"


def child_object(api_version: str, kind: str, name: str, namespace: str, isvc: InferenceServiceSpec,
                 *, object_name: str | None = None, **fields: Any) -> dict[str, Any]:
    """A manifest for a child of InferenceService `name` (spec `isvc`): apiVersion, kind, metadata
    (object_name, default `name`; the child labels) and the given top-level fields (spec, data, ...)."""
    metadata = {"name": object_name or name, "namespace": namespace, "labels": child_labels(name, isvc)}
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **fields}


def build_admin_secret(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The Secret holding a fresh random token for the engine's control routes (/admin/*, profiling), created
    once and never rewritten (the engine reads it from its environment, the tuner from the API); never logged."""
    token = secrets.token_urlsafe(32)
    return child_object("v1", "Secret", name, namespace, spec, object_name=admin_secret_name(name),
                        type="Opaque", data={ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode()})


def build_configmap(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The rendered engine configuration, for people and the tuner to read."""
    command = engine_command(spec)
    data = {
        "model": spec.model.source,
        "runtime": spec.engine.runtime,
        "engine-args.json": json.dumps(render_engine_args(spec.engine)),
        "command": shlex.join(command),
    }
    if vllm_on_cpu(spec):
        data.update(vllm_cpu_config())
    return child_object("v1", "ConfigMap", name, namespace, spec, object_name=configmap_name(name), data=data)


def _engine_env(name: str, engine: EngineSpec) -> list[dict[str, Any]]:
    """The engine container's environment: the user's, then the operator's own values."""
    # spec.engine.env first: validation refuses the names the operator sets, and where a
    # name repeats the kubelet keeps the last, so the operator's values would win anyway.
    env = [{"name": k, "value": v} for k, v in engine.env]
    env += [{"name": k, "value": v} for k, v in CACHE_ENV.items()] + [{"name": "TMPDIR", "value": "/tmp"}]
    if engine.apiKeySecret is not None:
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": engine.apiKeySecret.name, "key": engine.apiKeySecret.key}}})
    if engine.runtime == "kvpilot":  # upstream vLLM has no admin routes
        env.append({"name": ADMIN_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
            "name": admin_secret_name(name), "key": ADMIN_TOKEN_KEY}}})
    if engine.profiling:
        env.append({"name": PROFILER_DIR_ENV, "value": PROFILES_DIR})
    return env


def _mounts_and_volumes(name: str, spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """The engine container's volume mounts and the pod's volumes, in matching order."""
    engine = spec.engine
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE},
              {"name": "shm", "mountPath": "/dev/shm"}, {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        # NCCL and torch's shared-memory tensors need /dev/shm; it grows with the ranks.
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib(spec.ranks_per_pod)}Gi"}},
        {"name": "config", "configMap": {"name": configmap_name(name)}},
    ]
    if engine.profiling:  # traces go to a size-capped volume, not the pod's disk
        mounts.append({"name": "profiles", "mountPath": PROFILES_DIR})
        volumes.append({"name": "profiles", "emptyDir": {"sizeLimit": "2Gi"}})
    if spec.model.volumeClaim:
        mounts.append({"name": "models", "mountPath": "/models", "readOnly": True})
        volumes.append({"name": "models", "persistentVolumeClaim": {
            "claimName": spec.model.volumeClaim, "readOnly": True}})
    return mounts, volumes


def build_pod_template(name: str, spec: InferenceServiceSpec, images: Images) -> dict[str, Any]:
    """The engine pod template, without the config-hash annotation."""
    engine, res = spec.engine, spec.resources
    command = engine_command(spec)
    limits: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    requests = dict(limits)
    if res.gpu:
        limits[res.gpuResourceName] = requests[res.gpuResourceName] = spec.ranks_per_pod  # this pod's ranks
    else:
        requests["cpu"], limits["cpu"] = cpu_request_and_limit(res.cpu)
    env = _engine_env(name, engine)
    program, args = command[:2], command[2:]
    if vllm_on_cpu(spec):  # the launcher sets vLLM's CPU variables, then execs `vllm serve ...`
        env += vllm_cpu_env(spec)
        program, args = vllm_cpu_program(), command
    mounts, volumes = _mounts_and_volumes(name, spec)
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    # Loading weights takes minutes, and vLLM compiles the model (inductor: ~100 s for SmolLM2 on 2
    # CPUs): the startup probe holds the others off until then (kvpilot: 10 min, vLLM: 30 min).
    startup_failures = 360 if engine.runtime == "vllm" else 120
    container = {
        "name": "engine",
        "image": engine.image or images.for_runtime(engine.runtime, res.gpu),
        "imagePullPolicy": engine.imagePullPolicy,
        "command": program,
        "args": args,
        "ports": [{"name": "http", "containerPort": engine.port, "protocol": "TCP"}],
        "env": env,
        "resources": {"requests": requests, "limits": limits},
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": startup_failures},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        # No docker-link variables (NAME_PORT=tcp://..., one set per Service in the namespace): a
        # Service named e.g. `vllm` would set VLLM_PORT and friends, which engines read as settings
        # (vLLM documents the clash); the engine finds nothing through them.
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                            "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
        "volumes": volumes,
    }
    if res.nodeSelector:
        pod_spec["nodeSelector"] = dict(res.nodeSelector)
    return {
        "metadata": {
            "labels": child_labels(name, spec),
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(engine.port),
                            "prometheus.io/path": "/metrics"},
        },
        "spec": pod_spec,
    }


def cpu_request_and_limit(cpu: str) -> tuple[str, str]:
    """The CPU engine container's (request, limit) for spec.resources.cpu, a Kubernetes quantity.

    Whole CPUs ("1", "2000m") are both, as memory is: the pod is Guaranteed, and a kubelet with
    the static CPU manager policy gives its container CPUs of its own (an exclusive cpuset, which
    the engine binds its threads to). A fraction ("500m", "1.5") is the request and the next
    whole CPU the limit: the pod is Burstable and runs in the node's shared pool, weighted by its
    request; the engine runs ceil(cpu) threads (the CFS quota rounded up, engine/cpu/threads.py),
    so a quota of exactly that many CPUs never throttles them partway through a step, as a quota
    of 0.5 CPU would throttle its one thread for half of every 100 ms period. GPU pods keep
    spec.resources.cpu as both (build_pod_template): Guaranteed whatever the fraction.
    Sources: the Kubernetes documentation, "Control CPU Management Policies on the Node" (only
    Guaranteed pods with integer CPU requests get exclusive CPUs), "Configure Quality of Service
    for Pods", "Resource Management for Pods and Containers" (a limit is a CFS quota per 100 ms)."""
    cpus = parse_quantity(cpu)
    if cpus == cpus.to_integral_value():
        return cpu, cpu
    return cpu, str(math.ceil(cpus))


def shm_gib(world_size: int) -> int:
    """/dev/shm size: 1 GiB for one rank, 2 GiB more per extra rank."""
    return 1 + 2 * (world_size - 1)


def build_deployment(name: str, namespace: str, spec: InferenceServiceSpec,
                     images: Images = Images()) -> dict[str, Any]:
    """The engine Deployment. Its pod template carries a hash of the whole engine configuration
    (template and ConfigMap), so every engine change rolls out new pods."""
    template = build_pod_template(name, spec, images)
    digest = config_hash({"template": template,
                          "config": build_configmap(name, namespace, spec)["data"]})
    template["metadata"]["annotations"][HASH_ANNOTATION] = digest
    # Accelerators are scarce: replace pods in place rather than surge past the quota.
    strategy = {"type": "RollingUpdate", "rollingUpdate": ({"maxSurge": 0, "maxUnavailable": 1} if spec.resources.gpu
                                                           else {"maxSurge": 1, "maxUnavailable": 0})}
    deployment = child_object("apps/v1", "Deployment", name, namespace, spec, spec={
        "replicas": spec.replicas,
        "selector": {"matchLabels": selector_labels(name)},
        "strategy": strategy,
        "progressDeadlineSeconds": 900,
        "template": template,
    })
    deployment["metadata"]["annotations"] = {HASH_ANNOTATION: digest}
    return deployment


def build_service(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The ClusterIP Service NAME, port spec.engine.port, in front of the serving pods (serving_labels)."""
    return child_object("v1", "Service", name, namespace, spec, spec={
        "type": "ClusterIP",
        "selector": serving_labels(name, spec),
        "ports": [{"name": "http", "port": spec.engine.port, "targetPort": "http", "protocol": "TCP"}],
    })


def build_podmonitor(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """A Prometheus Operator PodMonitor; only created when its CRD exists in the cluster."""
    return child_object("monitoring.coreos.com/v1", "PodMonitor", name, namespace, spec, spec={
        "selector": {"matchLabels": serving_labels(name, spec)},
        # The dashboard selects engines by this label (app_kubernetes_io_instance).
        "podTargetLabels": ["app.kubernetes.io/instance"],
        "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
    })


def _label_value(text: str) -> str:
    """A valid label value: at most 63 of [A-Za-z0-9._-], alphanumeric at both ends."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in text)[:63]
    return cleaned.strip("._-") or "model"
