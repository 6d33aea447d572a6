"""The names of the environment variables kvpilot reads or sets, once: its own (KVPILOT_*) and the
vLLM ones it reads as vLLM does or sets for a vLLM engine (VLLM_*). Each constant is the
variable's name, so a misspelt one fails at import instead of reading an unset variable; the
comment says what it holds, its unit and default, and who reads it. The code reads them from
here (`from kvpilot.engine.settings.env import KVPILOT_TP_TIMEOUT_S`); tests/engine/
test_env_names_once.py fails on a name spelled as a literal anywhere else in the product code.

Two modules keep literal copies because they run without kvpilot importable, and that test holds
them equal to these: operator/render/vllm_cpu_launch.py (run by a vLLM image's own python3 -I)
and api/vllm.py (read with runpy.run_path by the installer and the image build).

Standard library only (it imports nothing), like the rest of kvpilot.engine.settings, so the
engine, the operator, the tuner, the benchmarks and the CLI all read it.
Sources for the VLLM_* ones: vLLM `vllm/envs.py` and its CPU installation guide.
"""

from __future__ import annotations

# --- kvpilot serve (the engine) ---------------------------------------------------------------
KVPILOT_ADMIN_TOKEN = "KVPILOT_ADMIN_TOKEN"  # the /admin routes' token (>= 16 chars; --enable-admin-routes)
KVPILOT_TP_TIMEOUT_S = "KVPILOT_TP_TIMEOUT_S"  # s a blocked collective or transfer may take (60)
KVPILOT_PP_MICRO_BATCHES = "KVPILOT_PP_MICRO_BATCHES"  # pipeline micro-batches per step (default pp)
KVPILOT_PP_MIN_MICRO_BATCH_TOKENS = "KVPILOT_PP_MIN_MICRO_BATCH_TOKENS"  # tokens a micro-batch needs (128)
KVPILOT_RENDEZVOUS_TIMEOUT_S = "KVPILOT_RENDEZVOUS_TIMEOUT_S"  # s every node waits for the others (600)
KVPILOT_NODE_TIMEOUT_S = "KVPILOT_NODE_TIMEOUT_S"  # s of heartbeat silence after which a node is gone (5)
KVPILOT_CPU_KERNELS = "KVPILOT_CPU_KERNELS"  # "0": the torch path, no C kernel (default "1")
KVPILOT_DECODE_STACK = "KVPILOT_DECODE_STACK"  # "0": no fused CPU decode stack (default "1")
KVPILOT_GGUF_ACTIVATIONS = "KVPILOT_GGUF_ACTIVATIONS"  # GGUF matmul activations: q8_1 (default) or float32
KVPILOT_ADAPTIVE_THREADS = "KVPILOT_ADAPTIVE_THREADS"  # "0": no adapting of decode thread counts ("1")
KVPILOT_BUILTIN_MODELS_DIR = "KVPILOT_BUILTIN_MODELS_DIR"  # builtin models converted ahead (images set it)
KVPILOT_CACHE_DIR = "KVPILOT_CACHE_DIR"  # the model cache (default $XDG_CACHE_HOME/kvpilot)

# --- vLLM's, read by kvpilot serve as vLLM reads them, or set for a vLLM engine ----------------
VLLM_API_KEY = "VLLM_API_KEY"  # the OpenAI API's bearer key (vllm serve --api-key reads it too)
VLLM_HTTP_TIMEOUT_KEEP_ALIVE = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"  # s an idle HTTP connection stays open (5)
VLLM_TORCH_PROFILER_DIR = "VLLM_TORCH_PROFILER_DIR"  # where /start_profile writes traces (unset: off)
VLLM_CPU_KVCACHE_SPACE = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache on CPU (kvpilot's default 4)
VLLM_CPU_OMP_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # CPUs per rank, '|'-separated, or auto / nobind
VLLM_CPU_NUM_OF_RESERVED_CPU = "VLLM_CPU_NUM_OF_RESERVED_CPU"  # CPUs kept out of the engine's threads
VLLM_CACHE_ROOT = "VLLM_CACHE_ROOT"  # vLLM's caches (the operator points it into the cache volume)
VLLM_LOG_STATS_INTERVAL = "VLLM_LOG_STATS_INTERVAL"  # s between vLLM's stats log lines (the tuner: 1)

# --- the operator (the chart sets them) --------------------------------------------------------
KVPILOT_OPERATOR_NAMESPACE = "KVPILOT_OPERATOR_NAMESPACE"  # the operator's namespace
KVPILOT_NAMESPACES = "KVPILOT_NAMESPACES"  # comma-separated namespaces to watch (unset: all)
KVPILOT_LIVENESS = "KVPILOT_LIVENESS"  # the probes' URL (kvpilot operator --liveness)
KVPILOT_LEADER_ELECT = "KVPILOT_LEADER_ELECT"  # "1": reconcile only while holding the Lease
KVPILOT_TUNER = "KVPILOT_TUNER"  # "1": also run the SLO tuner daemon
KVPILOT_METRICS_PORT = "KVPILOT_METRICS_PORT"  # the operator's /metrics port (unset or 0: off)
KVPILOT_RESYNC_SECONDS = "KVPILOT_RESYNC_SECONDS"  # s over which the resync visits every resource (300)
KVPILOT_WATCH_TIMEOUT_SECONDS = "KVPILOT_WATCH_TIMEOUT_SECONDS"  # whole s a watch request lasts (300)
KVPILOT_ENGINE_IMAGE = "KVPILOT_ENGINE_IMAGE"  # the kvpilot engine image (runtime kvpilot)
KVPILOT_VLLM_IMAGE = "KVPILOT_VLLM_IMAGE"  # the vLLM image on GPU nodes (runtime vllm)
KVPILOT_VLLM_CPU_IMAGE = "KVPILOT_VLLM_CPU_IMAGE"  # the vLLM CPU image (runtime vllm on CPU nodes)
KVPILOT_NETWORK_POLICY = "KVPILOT_NETWORK_POLICY"  # render engine NetworkPolicies (true; false/0/no: off)
KVPILOT_OPERATOR_LABELS = "KVPILOT_OPERATOR_LABELS"  # JSON: the operator pods' labels (NetworkPolicy peer)
KVPILOT_PROMETHEUS_PEER = "KVPILOT_PROMETHEUS_PEER"  # JSON: the NetworkPolicy peer that scrapes engines
KVPILOT_ALLOWED_IMAGE_PREFIXES = "KVPILOT_ALLOWED_IMAGE_PREFIXES"  # comma-separated (unset: any image)
KVPILOT_ALLOWED_NODE_SELECTORS = "KVPILOT_ALLOWED_NODE_SELECTORS"  # comma-separated key=value (unset: any)
KVPILOT_ALLOWED_GPU_RESOURCES = "KVPILOT_ALLOWED_GPU_RESOURCES"  # comma-separated (unset: any)
KVPILOT_API_KEY = "KVPILOT_API_KEY"  # reserved in engine pods: spec.engine.env may not set it
# set in a vLLM CPU engine pod for its launcher (the downward API, and the ranks the pod runs)
KVPILOT_CPU_LIMIT_MILLICORES = "KVPILOT_CPU_LIMIT_MILLICORES"  # the container's limits.cpu in 1m
KVPILOT_MEMORY_LIMIT_BYTES = "KVPILOT_MEMORY_LIMIT_BYTES"  # the container's limits.memory in bytes
KVPILOT_RANKS_PER_POD = "KVPILOT_RANKS_PER_POD"  # tensor x pipeline parallel ranks in this pod

# --- the in-cluster tuner daemon ---------------------------------------------------------------
KVPILOT_TUNER_ARGS = "KVPILOT_TUNER_ARGS"  # extra `kvpilot tune` flags (shell words) for every session
KVPILOT_PROMETHEUS_URL = "KVPILOT_PROMETHEUS_URL"  # Prometheus' URL (--prometheus-url unless the args give one)

# Every name above, for the test that no other module spells one.
NAMES: frozenset[str] = frozenset(value for key, value in dict(globals()).items()
                                  if key.isupper() and isinstance(value, str) and key == value)
