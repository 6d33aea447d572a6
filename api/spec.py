"""The InferenceService spec as frozen dataclasses, with the CRD's defaults.

The API server applies the CRD defaults before the operator sees a resource; the operator
applies the same ones again so it behaves the same on a cluster that skipped them (and in
unit tests that build specs by hand). tests/operator checks both sets of defaults agree.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvpilot.api.vllm import VLLM_CPU_DEFAULT_BLOCK_SIZE
from kvpilot.engine.settings import crd_defaults, deploy_defaults

_DEFAULTS = crd_defaults()
_ENGINE_BLOCK_SIZE: int = deploy_defaults()["block_size"]  # the engine's, and vLLM's on GPUs


@dataclass(frozen=True)
class ModelSpec:
    """spec.model: source (builtin://NAME or an absolute path in the pod), name (the served model
    name clients send, vLLM's --served-model-name) and volumeClaim (a PVC mounted read-only at
    /models that holds a path source)."""
    source: str
    name: str = ""
    volumeClaim: str = ""

    @property
    def display_name(self) -> str:
        """model.name, or the last part of the source (builtin://smollm2 -> smollm2)."""
        return self.name or self.source.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class SecretRef:
    """A key of a Secret in the InferenceService's namespace (spec.engine.apiKeySecret)."""
    name: str
    key: str = "api-key"


@dataclass(frozen=True)
class EngineSpec:
    """spec.engine: the runtime (kvpilot or upstream vllm), its image, and the engine settings that
    render as `vllm serve` flags (camelCase of vLLM's flag names); the tuner writes these."""
    runtime: str = "kvpilot"
    image: str = ""
    imagePullPolicy: str = "IfNotPresent"
    # The engine settings: field names and defaults from kvpilot.engine.settings (deploy_defaults:
    # the engine's, with maxModelLen fixed at 2048 and the budget derived from it).
    maxModelLen: int = _DEFAULTS["max_model_len"]
    maxNumSeqs: int = _DEFAULTS["max_num_seqs"]
    maxNumBatchedTokens: int = _DEFAULTS["max_num_batched_tokens"]
    performanceMode: str | None = _DEFAULTS["performance_mode"]  # None: no flag (vLLM before 0.17 lacks it)
    gpuMemoryUtilization: float = _DEFAULTS["gpu_memory_utilization"]
    kvCacheMemoryBytes: int | None = _DEFAULTS["kv_cache_memory_bytes"]  # None: sized from gpuMemoryUtilization
    enableChunkedPrefill: bool = _DEFAULTS["enable_chunked_prefill"]
    enablePrefixCaching: bool = _DEFAULTS["enable_prefix_caching"]
    tensorParallelSize: int = _DEFAULTS["tensor_parallel_size"]
    pipelineParallelSize: int = _DEFAULTS["pipeline_parallel_size"]
    blockSize: int | None = _DEFAULTS["block_size"]  # None: default_block_size (InferenceServiceSpec fills it)
    swapSpace: float = _DEFAULTS["swap_space"]
    preemptionMode: str = _DEFAULTS["preemption_mode"]
    dtype: str = _DEFAULTS["dtype"]
    seed: int = _DEFAULTS["seed"]
    port: int = _DEFAULTS["port"]
    showHiddenMetricsForVersion: str = _DEFAULTS["show_hidden_metrics_for_version"]  # "" renders no flag
    enableAutoToolChoice: bool = _DEFAULTS["enable_auto_tool_choice"]
    toolCallParser: str | None = _DEFAULTS["tool_call_parser"]  # None: no flag
    structuredOutputsConfig: str | None = _DEFAULTS["structured_outputs_config"]  # JSON; None: no flag
    apiKeySecret: SecretRef | None = None
    profiling: bool = False
    extraArgs: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def world_size(self) -> int:
        """Engine ranks: tensorParallelSize x pipelineParallelSize (vLLM's world size)."""
        return self.tensorParallelSize * self.pipelineParallelSize


@dataclass(frozen=True)
class ResourcesSpec:
    """spec.resources, per engine pod: cpu and memory as Kubernetes quantities, gpu (request
    gpuResourceName, one per rank of the pod) and the nodeSelector as sorted (key, value) pairs."""
    cpu: str = "2"
    memory: str = "8Gi"
    gpu: bool = False
    gpuResourceName: str = "nvidia.com/gpu"
    nodeSelector: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ParallelismSpec:
    """How many pods one engine spans (one group per replica).

    nnodes is vLLM's `--nnodes` and a LeaderWorkerSet's `size`: the engine's world of
    tensorParallelSize x pipelineParallelSize ranks is divided evenly over nnodes pods, each
    with spec.resources (resources are per pod). 1 runs the whole engine in one pod.
    """
    nnodes: int = 1


@dataclass(frozen=True)
class SLOSpec:
    """spec.slo: 95th-percentile limits on time to first token, inter-token latency and end-to-end
    latency (milliseconds; e2e 0: none) and the most preemptions per minute per replica."""
    ttftP95Ms: float = 2000
    itlP95Ms: float = 200
    e2eP95Ms: float = 0
    maxPreemptionsPerMin: float = 0


@dataclass(frozen=True)
class TuningSpec:
    """spec.tuning. mode once: one study, its winner deployed, done; continuous: after the
    study the tuner watches live traffic every watchSeconds and starts a new study (of
    retuneTrials) when the SLOs break for breachWindows windows in a row or the workload's
    shape moves by more than shiftRatio, at most maxStudiesPerHour and never within
    cooldownSeconds of the last (kvpilot.tuner.watch). pinned: spec.engine keys the tuner
    never changes."""
    enabled: bool = False
    maxTrials: int = 20
    trialSeconds: int = 120
    workload: str = "synthetic"
    objective: str = "throughput"
    mode: str = "once"
    watchSeconds: int = 60
    breachWindows: int = 3
    shiftRatio: float = 2.0
    cooldownSeconds: int = 600
    maxStudiesPerHour: int = 2
    retuneTrials: int = 6
    pinned: tuple[str, ...] = ()


@dataclass(frozen=True)
class InferenceServiceSpec:
    """The spec of one InferenceService (kvpilot.dev custom resource), its CRD defaults applied."""
    model: ModelSpec
    replicas: int = 1
    engine: EngineSpec = field(default_factory=EngineSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    slo: SLOSpec = field(default_factory=SLOSpec)
    tuning: TuningSpec = field(default_factory=TuningSpec)

    def __post_init__(self) -> None:
        if self.engine.blockSize is None:  # the CRD gives no default: it depends on runtime and devices
            block_size = default_block_size(self.engine.runtime, self.resources.gpu)
            object.__setattr__(self, "engine", replace(self.engine, blockSize=block_size))

    @property
    def nnodes(self) -> int:
        """Pods per engine group (spec.parallelism.nnodes; vLLM's --nnodes)."""
        return self.parallelism.nnodes

    @property
    def ranks_per_pod(self) -> int:
        """Engine ranks (tensor x pipeline) each pod of a group runs: world_size / nnodes.
        The CRD's CEL rule and the operator's validation refuse specs where it is not whole."""
        return self.engine.world_size // self.nnodes

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> "InferenceServiceSpec":
        """Parse spec (a dict from the API) with defaults; raises ValueError on a wrong shape."""
        model = spec.get("model")
        if not isinstance(model, Mapping) or not model.get("source"):
            raise ValueError("spec.model.source is required")
        engine = dict(spec.get("engine") or {})
        if engine.get("apiKeySecret"):
            engine["apiKeySecret"] = SecretRef(**_known(SecretRef, engine["apiKeySecret"]))
        engine["extraArgs"] = tuple(str(a) for a in engine.get("extraArgs") or ())
        engine["env"] = tuple((e["name"], str(e.get("value", ""))) for e in engine.get("env") or ())
        resources = dict(spec.get("resources") or {})
        resources["nodeSelector"] = tuple(sorted((resources.get("nodeSelector") or {}).items()))
        return cls(
            model=ModelSpec(**_known(ModelSpec, model)),
            replicas=int(spec.get("replicas", 1)),
            engine=EngineSpec(**_known(EngineSpec, engine)),
            resources=ResourcesSpec(**_known(ResourcesSpec, resources)),
            parallelism=ParallelismSpec(nnodes=int((spec.get("parallelism") or {}).get("nnodes", 1))),
            slo=SLOSpec(**_known(SLOSpec, spec.get("slo") or {})),
            tuning=TuningSpec(**{**_known(TuningSpec, spec.get("tuning") or {}),
                                 "pinned": tuple(str(p) for p in (spec.get("tuning") or {}).get("pinned") or ())}),
        )


def default_block_size(runtime: str, gpu: bool) -> int:
    """spec.engine.blockSize where the spec leaves it out, in tokens: vLLM's CPU default (128, a
    multiple of the 32 its CPU attention needs) for runtime vllm without GPUs, else 16 (the
    engine's default, and vLLM's on GPUs). Source: vLLM's CpuPlatform.check_and_update_config."""
    return VLLM_CPU_DEFAULT_BLOCK_SIZE if runtime == "vllm" and not gpu else _ENGINE_BLOCK_SIZE


def _known(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of values that cls has as fields (the API server prunes the rest anyway)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in values.items() if k in names}


def service_url(name: str, namespace: str, spec: InferenceServiceSpec) -> str:
    """The in-cluster OpenAI base URL of an InferenceService: its Service (named after it, in its
    namespace) by cluster DNS, on the engine's port. The operator writes it to status.url; the
    tuner loads it, even before that status is written."""
    return f"http://{name}.{namespace}.svc:{spec.engine.port}/v1"
