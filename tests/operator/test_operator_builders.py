"""The pure builders, spec parsing, validation and status: no cluster."""
from __future__ import annotations

import dataclasses

import pytest
import yaml
from kube.tools import ROOT

from kvpilot.operator.render.builders import (HASH_ANNOTATION, build_configmap, build_deployment, build_podmonitor,
                                       build_service, shm_gib)
from kvpilot.operator.render.engine_args import engine_command, render_engine_args
from kvpilot.api.models import BUILTIN_MODELS
from kvpilot.api.spec import EngineSpec, InferenceServiceSpec
from kvpilot.operator.status import deployment_conditions, merge_conditions
from kvpilot.operator.validation import InvalidSpec, validate

SMOLLM = {"source": "builtin://smollm2-135m-instruct"}


def spec(**engine) -> InferenceServiceSpec:
    return InferenceServiceSpec.from_dict({"model": SMOLLM, "engine": engine})


@pytest.mark.parametrize("runtime, gpu, block_size", [
    ("kvpilot", False, "16"), ("kvpilot", True, "16"), ("vllm", True, "16"),
    ("vllm", False, "128"),  # vLLM's CPU default (its CPU attention takes multiples of 32)
])
def test_an_unset_block_size_renders_the_runtimes_default_on_the_devices(runtime, gpu, block_size):
    model = SMOLLM if not gpu else {"source": "/models/smollm2"}
    parsed = InferenceServiceSpec.from_dict({"model": model, "engine": {"runtime": runtime}, "resources": {"gpu": gpu}})
    command = engine_command(parsed)
    assert command[command.index("--block-size") + 1] == block_size
    validate(parsed)  # the filled default is one the runtime takes
    given = InferenceServiceSpec.from_dict({"model": model, "engine": {"runtime": runtime, "blockSize": 64},
                                            "resources": {"gpu": gpu}})
    assert engine_command(given)[engine_command(given).index("--block-size") + 1] == "64"


def test_engine_args_render_in_vllm_serve_flag_form():
    args = render_engine_args(EngineSpec(maxNumBatchedTokens=512, enableChunkedPrefill=False,
                                         enablePrefixCaching=True, gpuMemoryUtilization=0.85, swapSpace=2.5))
    pairs = dict(zip(args, args[1:]))
    assert pairs["--max-num-batched-tokens"] == "512"
    assert pairs["--gpu-memory-utilization"] == "0.85" and pairs["--swap-space"] == "2.5"
    assert "--no-enable-chunked-prefill" in args and "--enable-chunked-prefill" not in args
    assert "--enable-prefix-caching" in args and "--api-key" not in args


def test_runtime_picks_the_program_and_keeps_the_flags():
    ours = InferenceServiceSpec.from_dict({"model": {"source": "/models/llama"}})
    theirs = InferenceServiceSpec.from_dict({"model": {"source": "/models/llama"}, "engine": {"runtime": "vllm"}})
    assert engine_command(ours)[:3] == ["kvpilot", "serve", "/models/llama"]
    assert engine_command(theirs)[:3] == ["vllm", "serve", "/models/llama"]
    # the same flags, less the admin routes (kvpilot's) and the two vLLM removed with its V0 engine,
    # but the unset block size: vLLM's CPU default there
    removed = {"--enable-admin-routes", "--swap-space", "4", "--preemption-mode", "recompute"}
    kept = [a for a in engine_command(ours)[3:] if a not in removed]
    kept[kept.index("--block-size") + 1] = "128"
    assert kept == engine_command(theirs)[3:]
    assert not {"--swap-space", "--preemption-mode"} & set(engine_command(theirs))


def test_api_key_comes_from_the_secret_and_never_appears_in_args():
    s = InferenceServiceSpec.from_dict({"model": SMOLLM, "engine": {"apiKeySecret": {"name": "keys"}}})
    container = build_deployment("a", "ns", s)["spec"]["template"]["spec"]["containers"][0]
    assert not any("api-key" in a or "API_KEY" in a for a in container["args"])
    env = {e["name"]: e for e in container["env"]}
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}


def test_every_engine_change_changes_the_configuration_hash():
    base = build_deployment("a", "ns", spec())
    digest = base["spec"]["template"]["metadata"]["annotations"][HASH_ANNOTATION]
    assert base["metadata"]["annotations"][HASH_ANNOTATION] == digest
    for change in ({"maxNumBatchedTokens": 4096}, {"maxNumSeqs": 32}, {"enableChunkedPrefill": False, "maxNumBatchedTokens": 4096},
                   {"image": "other:1"}, {"extraArgs": ["--disable-log-stats"]}, {"blockSize": 32}):
        other = build_deployment("a", "ns", spec(**change))
        assert other["spec"]["template"]["metadata"]["annotations"][HASH_ANNOTATION] != digest, change
    assert build_deployment("a", "ns", spec())["metadata"]["annotations"][HASH_ANNOTATION] == digest


def test_deployment_is_probed_hardened_and_scrapable():
    d = build_deployment("a", "ns", spec())
    pod = d["spec"]["template"]
    container = pod["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", "/home/kvpilot/.cache", "/dev/shm"} <= mounts
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert d["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_gpus_follow_the_parallel_sizes_and_shm_grows_with_them():
    s = InferenceServiceSpec.from_dict({"model": SMOLLM, "engine": {"tensorParallelSize": 3, "pipelineParallelSize": 2},
                                        "resources": {"gpu": True}})
    pod = build_deployment("a", "ns", s)["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 6
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{shm_gib(6)}Gi"} and shm_gib(6) > shm_gib(1)
    cpu_only = build_deployment("a", "ns", spec())["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu_only["resources"]["limits"]


def qos_class(resources: dict) -> str:
    """The pod's QoS class for its one container, by the rule of Kubernetes' "Configure Quality of
    Service for Pods": Guaranteed when CPU and memory each have a limit and a request equal to it."""
    requests, limits = resources["requests"], resources["limits"]
    if all(r in limits and requests.get(r) == limits[r] for r in ("cpu", "memory")):
        return "Guaranteed"
    return "Burstable" if requests or limits else "BestEffort"


@pytest.mark.parametrize("cpu, request_cpu, limit_cpu", [
    ("1", "1", "1"), ("2000m", "2000m", "2000m"), ("4", "4", "4"),
    ("500m", "500m", "1"), ("0.5", "0.5", "1"), ("1.5", "1.5", "2"), ("2500m", "2500m", "3"), ("1001m", "1001m", "2"),
])
def test_whole_cpus_are_request_and_limit_and_a_fraction_takes_the_next_whole_cpu_as_limit(cpu, request_cpu, limit_cpu):
    """Whole CPUs make the pod Guaranteed (the static CPU manager's exclusive cores); a fraction
    stays Burstable with a quota of ceil(cpu) CPUs, the engine's thread count."""
    s = InferenceServiceSpec.from_dict({"model": SMOLLM, "resources": {"cpu": cpu, "memory": "4Gi"}})
    resources = build_deployment("a", "ns", s)["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"] == {"cpu": request_cpu, "memory": "4Gi"}
    assert resources["limits"] == {"cpu": limit_cpu, "memory": "4Gi"}
    assert qos_class(resources) == ("Guaranteed" if request_cpu == limit_cpu else "Burstable")


def test_gpu_pods_keep_their_cpu_as_request_and_limit():
    """A GPU pod stays Guaranteed with a fractional CPU: its engine computes on the accelerator."""
    s = InferenceServiceSpec.from_dict({"model": SMOLLM, "resources": {"cpu": "500m", "memory": "4Gi", "gpu": True}})
    resources = build_deployment("a", "ns", s)["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"] == {"cpu": "500m", "memory": "4Gi", "nvidia.com/gpu": 1}
    assert qos_class(resources) == "Guaranteed"


def test_service_configmap_and_podmonitor_select_the_engine_pods():
    s = spec()
    labels = build_deployment("a", "ns", s)["spec"]["template"]["metadata"]["labels"]
    svc = build_service("a", "ns", s)
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert build_podmonitor("a", "ns", s)["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert build_configmap("a", "ns", s)["data"]["command"].startswith("kvpilot serve builtin://smollm2-135m-instruct")


@pytest.mark.parametrize("engine, model, reason", [
    ({"tensorParallelSize": 2}, SMOLLM, "InvalidParallelism"),
    ({"pipelineParallelSize": 31}, SMOLLM, "InvalidParallelism"),
    ({}, {"source": "builtin://gpt-17"}, "UnknownModel"),
    ({"maxModelLen": 16384, "maxNumBatchedTokens": 16384}, SMOLLM, "ModelLenTooLong"),
    ({"runtime": "vllm"}, {**SMOLLM, "gpu": True}, "UnsupportedModel"),
    ({"runtime": "vllm", "preemptionMode": "swap"}, SMOLLM, "UnsupportedByVLLM"),
    ({"runtime": "vllm", "swapSpace": 8}, SMOLLM, "UnsupportedByVLLM"),
    ({"runtime": "vllm", "blockSize": 16}, SMOLLM, "UnsupportedByVLLM"),  # on CPU: vLLM's CPU attention takes 32k
    ({"maxNumSeqs": 256, "maxNumBatchedTokens": 128}, SMOLLM, "InvalidEngineArgs"),
    ({"enableChunkedPrefill": False, "maxNumBatchedTokens": 1024}, SMOLLM, "InvalidEngineArgs"),
    ({"extraArgs": ["--max-num-seqs=8"]}, SMOLLM, "ConflictingArgs"),
])
def test_specs_that_cannot_run_are_refused_with_a_reason(engine, model, reason):
    model = dict(model)
    resources = {"gpu": True} if model.pop("gpu", False) else {}
    with pytest.raises(InvalidSpec) as refused:
        validate(InferenceServiceSpec.from_dict({"model": model, "engine": engine, "resources": resources}))
    assert refused.value.reason == reason


@pytest.mark.parametrize("engine, nnodes, runs", [
    ({}, 1, True), ({"pipelineParallelSize": 2}, 2, True), ({"tensorParallelSize": 3}, 3, True),
    ({"pipelineParallelSize": 2}, 3, False), ({}, 2, False), ({"tensorParallelSize": 3, "pipelineParallelSize": 2}, 4, False),
])
def test_nnodes_must_divide_the_engines_ranks(engine, nnodes, runs):
    s = InferenceServiceSpec.from_dict({"model": SMOLLM, "engine": engine, "parallelism": {"nnodes": nnodes}})
    assert s.nnodes == nnodes
    if runs:
        validate(s)
        assert s.ranks_per_pod * nnodes == s.engine.world_size
        return
    with pytest.raises(InvalidSpec) as refused:
        validate(s)
    assert refused.value.reason == "InvalidParallelism" and "parallelism.nnodes" in refused.value.message


def test_valid_parallel_sizes_pass():
    validate(spec(tensorParallelSize=3, pipelineParallelSize=30))
    shape = BUILTIN_MODELS["smollm2-135m-instruct"]
    assert shape.kv_cache_bytes_per_token("bfloat16") == 2 * 30 * 3 * 64 * 2


def _crd_schema() -> dict:
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_python_defaults_match_the_crd_defaults():
    props = _crd_schema()["properties"]["spec"]["properties"]
    defaults = InferenceServiceSpec.from_dict({"model": SMOLLM})
    for section in ("engine", "resources", "parallelism", "slo", "tuning"):
        ours = getattr(defaults, section)
        for name, field_schema in props[section]["properties"].items():
            if "default" in field_schema:
                assert getattr(ours, name) == field_schema["default"], f"{section}.{name}"
        assert {f.name for f in dataclasses.fields(ours)} >= {
            n for n, f in props[section]["properties"].items() if f.get("type") != "object" or n == "apiKeySecret"}


def test_every_crd_field_has_a_description():
    def walk(schema: dict, path: str):
        for name, sub in (schema.get("properties") or {}).items():
            if f"{path}.{name}" == ".metadata":  # the API server allows only `type: object` there
                assert sub == {"type": "object"}
                continue
            assert sub.get("description"), f"{path}.{name} has no description"
            walk(sub, f"{path}.{name}")
        if isinstance(schema.get("items"), dict):
            walk(schema["items"], path + "[]")
    walk(_crd_schema(), "")


def test_conditions_keep_their_transition_time_until_status_changes():
    dep = {"metadata": {"generation": 1}, "spec": {"template": {"metadata": {"annotations": {HASH_ANNOTATION: "h"}}}},
           "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}}
    ready, replicas, ready_count = deployment_conditions(dep, 1, "h", 3)
    assert {c["type"]: c["status"] for c in ready}["Ready"] == "True" and (replicas, ready_count) == (1, 1)
    first = merge_conditions(None, ready, "t1")
    again = merge_conditions(first, ready, "t2")
    assert all(c["lastTransitionTime"] == "t1" for c in again)
    stale, _, _ = deployment_conditions(dep, 1, "new-hash", 4)
    changed = {c["type"]: c for c in merge_conditions(again, stale, "t3")}
    assert changed["Ready"]["status"] == "False" and changed["Ready"]["lastTransitionTime"] == "t3"
    assert changed["Progressing"]["reason"] == "RollingOut"
    assert changed["Failed"]["lastTransitionTime"] == "t1"


def test_pods_that_never_become_ready_are_degraded():
    dep = {"metadata": {"generation": 2}, "spec": {"template": {"metadata": {"annotations": {HASH_ANNOTATION: "h"}}}},
           "status": {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 0}}
    conditions = {c["type"]: c for c in deployment_conditions(dep, 2, "h", 1)[0]}
    assert conditions["Degraded"]["status"] == "True" and conditions["Degraded"]["reason"] == "ReplicasUnavailable"
    assert conditions["Ready"]["status"] == "False"


def test_served_model_name_comes_from_spec_model_name():
    """Clients, the tuner's requests and its model_name metric selectors use spec.model.name:
    the engine must serve under it (`--served-model-name`), whatever the source."""
    named = InferenceServiceSpec.from_dict({"model": {"source": "builtin://smollm2-135m-instruct", "name": "chat"}})
    args = build_deployment("a", "ns", named)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["builtin://smollm2-135m-instruct", "--served-model-name", "chat"]
    unnamed = InferenceServiceSpec.from_dict({"model": {"source": "/models/llama-3"}, "engine": {"runtime": "vllm"}})
    assert engine_command(unnamed)[3:5] == ["--served-model-name", "llama-3"]
    with pytest.raises(InvalidSpec, match="--served-model-name"):
        validate(spec(extraArgs=["--served-model-name", "other"]))


def test_served_model_name_reaches_the_engines_parser():
    from kvpilot.engine.entrypoints.serve import make_parser

    named = InferenceServiceSpec.from_dict({"model": {"source": "builtin://smollm2-135m-instruct", "name": "chat"}})
    parsed = make_parser().parse_args(engine_command(named)[2:])
    assert parsed.served_model_name == "chat"


def test_every_library_cache_points_into_the_writable_cache_volume():
    """The root filesystem is read-only: Triton ($HOME/.triton), torch.compile
    (/tmp/torchinductor_$USER), Hugging Face, CUDA's JIT cache and vLLM must write under the
    `cache` emptyDir."""
    pod = build_deployment("a", "ns", spec())["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    cache_mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "cache")
    assert {"emptyDir": {}} == {k: v for k, v in next(v for v in pod["volumes"] if v["name"] == "cache").items()
                                if k != "name"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    for name in ("TRITON_CACHE_DIR", "TRITON_HOME", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME", "TORCH_HOME",
                 "XDG_CACHE_HOME", "CUDA_CACHE_PATH", "VLLM_CACHE_ROOT"):
        assert env[name] == cache_mount or env[name].startswith(cache_mount + "/"), name
    assert env["HOME"] == cache_mount.rsplit("/", 1)[0]


def test_drift_compares_quantities_by_value():
    """The API server stores cpu "0.5" as "500m" and a GPU count 6 as "6": not drift."""
    from kvpilot.operator.drift import covers

    desired = {"resources": {"limits": {"cpu": "0.5", "memory": "1.5Gi", "nvidia.com/gpu": 6}},
               "volumes": [{"emptyDir": {"sizeLimit": "1024Mi"}}], "replicas": 1}
    stored = {"resources": {"limits": {"cpu": "500m", "memory": "1536Mi", "nvidia.com/gpu": "6"}},
              "volumes": [{"emptyDir": {"sizeLimit": "1Gi", "medium": "Memory"}}], "replicas": 1}
    assert covers(stored, desired)
    assert not covers({**stored, "resources": {"limits": {**stored["resources"]["limits"], "cpu": "600m"}}}, desired)
    assert not covers({**stored, "replicas": "1"}, desired)  # only quantities compare by value


def test_runtime_vllm_passes_vllms_newest_knobs_through_and_kvpilot_parses_them():
    """performanceMode, kvCacheMemoryBytes and maxModelLen -1 (vLLM's auto) render as vLLM's
    flags for both runtimes; the same words parse with `kvpilot serve`'s parser; unset, the
    performance mode renders nothing (vLLM images before 0.17 do not know the flag)."""
    from kvpilot.engine.settings.cli_args import explicit_dests

    engine = {"runtime": "vllm", "performanceMode": "throughput", "kvCacheMemoryBytes": 2 << 30, "maxModelLen": -1}
    command = engine_command(InferenceServiceSpec.from_dict({"model": {"source": "/models/llama"}, "engine": engine}))
    pairs = dict(zip(command, command[1:]))
    assert command[:2] == ["vllm", "serve"]
    assert pairs["--performance-mode"] == "throughput" and pairs["--kv-cache-memory-bytes"] == str(2 << 30)
    assert pairs["--max-model-len"] == "-1"
    given = explicit_dests(command[3:])
    assert (given["performance_mode"], given["kv_cache_memory_bytes"], given["max_model_len"]) == (
        "throughput", 2 << 30, -1)
    plain = render_engine_args(EngineSpec())
    assert "--performance-mode" not in plain and "--kv-cache-memory-bytes" not in plain
    validate(spec(maxModelLen=-1, kvCacheMemoryBytes=1 << 20, performanceMode="interactivity"))
    for bad in ({"maxModelLen": 8}, {"kvCacheMemoryBytes": 0}, {"performanceMode": "fast"}):
        with pytest.raises(InvalidSpec):
            validate(spec(**bad))
