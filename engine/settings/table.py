"""Every engine setting, once: its `vllm serve` flag, its InferenceService field, type,
default, bounds, whether it can change on a running engine, and the rules between settings.

Torch-free (imports only the standard library), so that the operator, the tuner and the CRD
generator read the same table the engine does. Derived from it:
- `kvpilot serve`'s flags (`cli_args.py` beside this file) and `EngineArgs` validation;
- the live `/admin/scheduler_config` fields (`LIVE_SETTINGS`);
- the operator's rendering and validation of `spec.engine`, and `extraArgs`' owned flags;
- the tuner's flags and `spec.engine` keys;
- the CRD's `spec.engine` schema and CEL rules (`kvpilot crd`).

Defaults are vLLM's (`vllm/engine/arg_utils.py`, `vllm/config`). Three are derived:
`max_model_len` is the model's context length (`auto` / -1: the longest the KV cache holds),
`max_num_seqs` is 256 and `max_num_batched_tokens` 2048 with chunked prefill and
max(max_model_len, 2048) without (so any prompt fits one step); `--performance-mode
throughput` doubles both limits where they are not given, as vLLM 0.17+ does. Where
the deployment cannot see the model (the CRD, the operator, the tuner's base point), it
uses `deploy_default`: a fixed `max_model_len` of 2048, 256 sequences, and the budget
derived from them. `search` is the tuner's default search range of a setting (`SEARCH_RANGES`:
`kvpilot tune`'s flags, `SearchSpace`'s defaults, the in-cluster tuner and the user guide's
table read it).
Rules: see `RULES`; each is a Python check and the same check in CEL (Kubernetes'
x-kubernetes-validations), which tests/engine/test_settings.py evaluates against each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvpilot.engine.settings.rules import NNODES_RULE, RULES, SPEC_RULES, Rule, nnodes_divides, rule_problems
from kvpilot.engine.settings.setting import (
    AUTO_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_SEQS,
    PERFORMANCE_MODES,
    Setting,
    _num,
    default_max_num_batched_tokens,
    human_readable_int,
    human_readable_int_or_auto,
    structured_outputs_config,
)

ATTENTION_BACKENDS = ("torch", "triton")  # kvpilot.engine.attention.BACKENDS (a test checks they agree)

S = Setting
SETTINGS: tuple[Setting, ...] = (
    S("max_model_len", "--max-model-len", int, None, "longest sequence (prompt + output) in tokens; 1k, 1K, "
      "25.6k also parse; auto or -1: the model's context length if the KV cache holds it, else the longest it "
      "holds (default: the model's context length)", crd="maxModelLen", minimum=16, maximum=1048576,
      deploy_default=2048, special=(AUTO_MAX_MODEL_LEN,), parse=human_readable_int_or_auto, metavar="N|auto",
      crd_help="longest sequence (prompt + output) in tokens; -1 (vLLM's auto) is the model's context length "
      "if the KV cache holds it, else the longest it holds. The engine's own default is the model's context "
      "length; the CRD cannot read the model and fills 2048"),
    S("max_num_seqs", "--max-num-seqs", int, None, "most requests running at once. Too many for the KV cache "
      "cause preemptions (default: 256; 512 with --performance-mode throughput)", crd="maxNumSeqs", live=True,
      minimum=1, maximum=4096, deploy_default=DEFAULT_MAX_NUM_SEQS, search=(2, 512),
      crd_help="most requests running at once. Too many for the KV cache cause preemptions"),
    S("max_num_batched_tokens", "--max-num-batched-tokens", int, None, "per-step token budget. Small budgets "
      "favour inter-token latency, large ones time to first token and throughput (default: 2048 with chunked "
      "prefill, else max(max_model_len, 2048); the 2048 doubles with --performance-mode throughput)",
      crd="maxNumBatchedTokens", live=True, minimum=1, maximum=1048576, search=(128, 8192)),
    # issue 33: vLLM 0.17's runtime performance mode
    S("performance_mode", "--performance-mode", str, "balanced", "balanced (the default limits), interactivity "
      "(vLLM: fine-grained CUDA graphs and latency-oriented kernels for small batches; kvpilot's engine has no "
      "CUDA graphs and runs as balanced) or throughput (the default max_num_seqs and max_num_batched_tokens "
      "double where not given)", crd="performanceMode", choices=PERFORMANCE_MODES, deploy_default=None,
      crd_help="the runtime performance mode of vLLM 0.17 and later (unset renders no flag, so older vLLM "
      "images start): balanced, interactivity (vLLM: fine-grained CUDA graphs and latency-oriented kernels for "
      "small batches; kvpilot's engine runs it as balanced) or throughput (the engine's default max_num_seqs and "
      "max_num_batched_tokens double where the command line does not give them; an InferenceService always "
      "gives them, so raise maxNumSeqs and maxNumBatchedTokens instead)"),
    S("gpu_memory_utilization", "--gpu-memory-utilization", float, 0.9, "fraction of device memory for weights, "
      "activations and KV cache", crd="gpuMemoryUtilization", minimum=0, maximum=1, exclusive_minimum=True),
    # issue 33: vLLM 0.11's KV budget in bytes
    S("kv_cache_memory_bytes", "--kv-cache-memory-bytes", int, None, "bytes of KV cache per device (rank), "
      "instead of what gpu_memory_utilization leaves (which it then ignores, as does VLLM_CPU_KVCACHE_SPACE on "
      "CPU); 4G, 512M also parse", crd="kvCacheMemoryBytes", minimum=1, parse=human_readable_int,
      metavar="BYTES",
      crd_help="bytes of KV cache per device (rank), instead of what gpuMemoryUtilization leaves, which it then "
      "ignores (as does VLLM_CPU_KVCACHE_SPACE on CPU). Unset: sized from gpuMemoryUtilization"),
    S("enable_chunked_prefill", "--enable-chunked-prefill", bool, True, "split long prompts to fit the token "
      "budget, decodes first", crd="enableChunkedPrefill", live=True),
    S("enable_prefix_caching", "--enable-prefix-caching", bool, True, "reuse KV blocks of shared prompt prefixes "
      "(on unless turned off, vLLM v1's default)", crd="enablePrefixCaching"),
    S("tensor_parallel_size", "--tensor-parallel-size", int, 1, "devices one layer is split over; must divide "
      "the attention and KV heads", crd="tensorParallelSize", minimum=1, maximum=64, short="-tp"),
    S("pipeline_parallel_size", "--pipeline-parallel-size", int, 1, "stages the layers are split into; must not "
      "exceed the layer count", crd="pipelineParallelSize", minimum=1, maximum=64, short="-pp"),
    # issue 41: one engine over several nodes (pods) without Ray, as `vllm serve` runs it: every node runs
    # the same command but --node-rank; node 0 serves HTTP (engine/distributed/rendezvous.py, engine/executor/headless.py). No CRD field: the operator
    # renders them per pod from spec.parallelism.
    S("nnodes", "--nnodes", int, 1, "nodes (pods) the tensor_parallel_size x pipeline_parallel_size ranks are "
      "spread over, the same number on each; must divide tp x pp. Pipeline stages cross nodes first (rank = "
      "pp_rank x tp + tp_rank, node = rank / (tp x pp / nnodes)). Every node waits up to "
      "$KVPILOT_RENDEZVOUS_TIMEOUT_S (600) for the others to join; a node silent for $KVPILOT_NODE_TIMEOUT_S (5) is "
      "gone: node 0 fails its requests and exits 5", minimum=1, maximum=4096),
    S("node_rank", "--node-rank", int, 0, "this node's rank in [0, nnodes): node 0 runs the scheduler and the "
      "HTTP server; every other node runs its ranks headless (with or without --headless; vLLM needs the flag "
      "there), so one pod template with --node-rank <pod index> serves all nodes", minimum=0, maximum=4095),
    S("master_addr", "--master-addr", str, "127.0.0.1", "node 0's address, which every node connects to for the "
      "rendezvous (node 0 listens on all interfaces)", max_length=253),
    S("master_port", "--master-port", int, 29501, "node 0's rendezvous port (a torch.distributed TCPStore; also "
      "carries the nodes' heartbeats)", minimum=1, maximum=65535),
    # The CRD gives no default: vLLM's own default depends on the device (16 on GPUs, 128 on CPUs, whose
    # attention takes multiples of 32), so the operator fills an absent blockSize by runtime and devices
    # (kvpilot.api.spec.default_block_size); the engine and the tuner keep 16.
    S("block_size", "--block-size", int, 16, "tokens per KV-cache block", crd="blockSize",
      choices=(1, 2, 4, 8, 16, 32, 64, 128), choices_text="a power of two from 1 to 128", crd_default=None,
      crd_help="tokens per KV-cache block. Unset: 16, or vLLM's CPU default of 128 for runtime vllm on CPUs, "
      "whose attention takes multiples of 32"),
    S("swap_space", "--swap-space", float, 4.0, "GiB of host memory for swapped-out KV blocks", crd="swapSpace",
      minimum=0, maximum=1024),
    S("preemption_mode", "--preemption-mode", str, "recompute", "how a preempted request resumes: recompute "
      "(drop its blocks, prefill again) or swap (copy its blocks to host memory and back)", crd="preemptionMode",
      live=True, choices=("recompute", "swap")),
    S("served_model_name", "--served-model-name", str, None, "model name in the API (default: --model)"),
    S("num_gpu_blocks_override", "--num-gpu-blocks-override", int, None, "use exactly this many KV blocks",
      minimum=1),
    S("dtype", "--dtype", str, "auto", "weight and activation data type (auto: bfloat16 on GPUs and on CPUs with "
      "native bf16, float32 on other CPUs)", crd="dtype",
      choices=("auto", "bfloat16", "float16", "half", "float32", "float")),
    S("seed", "--seed", int, 0, "random seed for sampling", crd="seed", minimum=0),
    S("attention_backend", "--attention-backend", str, None, "'torch' (default on CPU) or 'triton' (default "
      "on CUDA)", choices=ATTENTION_BACKENDS),
    S("device", "--device", str, None, "cpu or cuda (default: cuda when available)"),
    S("port", "--port", int, 8000, "the HTTP port the server listens on", crd="port", minimum=1024,
      maximum=65535, server=True),
    S("headless", "--headless", bool, False, "run this node's ranks without the HTTP server (vLLM's flag for "
      "--node-rank > 0, which kvpilot implies there); refused on node 0, which runs the scheduler", server=True),
    S("show_hidden_metrics_for_version", "--show-hidden-metrics-for-version", str, None,
      "also export every Prometheus metric that vLLM has deprecated and hidden since this version (0.8, 0.10, "
      "0.11: all hidden from that release on, not only by the next one as in vLLM), so a dashboard written for "
      "it keeps working while it migrates", crd="showHiddenMetricsForVersion",
      pattern=r"^([0-9]+\.[0-9]+)?$", max_length=16, metavar="X.Y", deploy_default="0.11", server=True,
      crd_help="also export every Prometheus metric that vLLM has deprecated and hidden since this version, so a "
      "dashboard written for it keeps working while it migrates (vLLM's own flag brings back only what the next "
      "release hid). 0.11 brings back vllm:time_per_output_token_seconds; 0.10 (or 0.9) also "
      "vllm:gpu_cache_usage_perc and vllm:gpu_prefix_cache_queries/hits; 0.8 also vllm:num_requests_swapped; "
      "0.12 and later add nothing. An empty string renders no flag"),
    # issue 48: vLLM's ObservabilityConfig metric flags (engine/metrics/options.py)
    S("enable_mfu_metrics", "--enable-mfu-metrics", bool, False, "Enable Model FLOPs Utilization (MFU) metrics: "
      "the vllm:estimated_flops/read_bytes/write_bytes_per_gpu_total counters count each step's estimate",
      server=True),
    S("kv_cache_metrics", "--kv-cache-metrics", bool, False, "Enable KV cache residency metrics (lifetime, idle "
      "time, reuse gaps). Uses sampling to minimize overhead", server=True),
    S("kv_cache_metrics_sample", "--kv-cache-metrics-sample", float, 0.01, "Sampling rate for KV cache metrics "
      "(0.0, 1.0]. Default 0.01 = 1 in 100 blocks", minimum=0, exclusive_minimum=True, maximum=1, server=True),
    S("custom_histogram_buckets", "--custom-histogram-buckets", str, None, "Custom Prometheus histogram bucket "
      "boundaries, as a JSON mapping from bucket-family key to a list of strictly increasing, positive, finite "
      "upper bounds; families not listed keep their defaults. Known families: request_latency, "
      "time_to_first_token, inter_token_latency, iteration_tokens, request_params_n, request_num_preemptions, "
      "request_tokens, kv_cache_residency", metavar="JSON", max_length=4096, server=True),
    # issue 40: tool calls as vLLM serves them (engine/entrypoints/openai/tool_parsers/calls.py); server flags, as in vLLM's
    # frontend. deploy_default None: unset renders no flag (vLLM's --enable-auto-tool-choice has no --no- form)
    S("enable_auto_tool_choice", "--enable-auto-tool-choice", bool, False, "let the model call tools on its own "
      "(tool_choice auto, the default when a request gives tools), found in its text by --tool-call-parser; "
      "without it such a request is a 400 (required and named tool choices need neither flag)",
      crd="enableAutoToolChoice", deploy_default=None, server=True),
    S("tool_call_parser", "--tool-call-parser", str, None, "how tool calls are found in the text for tool_choice "
      "auto: hermes (<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>, vLLM's usual choice for ChatML "
      "models such as the builtin SmolLM2)", crd="toolCallParser", choices=("hermes",), server=True),
    S("structured_outputs_config", "--structured-outputs-config", str, None, "structured-output settings as JSON, "
      "as vLLM's flag takes them: backend (xgrammar; auto picks it) and disable_any_whitespace (true: JSON without free whitespace between "
      "tokens unless a request says otherwise; small models such as the builtin SmolLM2 otherwise tend to loop on "
      "whitespace)", crd="structuredOutputsConfig", parse=structured_outputs_config, metavar="JSON", max_length=1024,
      server=True),
    # issue 48: vLLM's ModelConfig.max_logprobs; the server bounds logprobs, top_logprobs and prompt_logprobs by it
    S("max_logprobs", "--max-logprobs", int, 20, "most logprobs a request may ask for per token (logprobs, "
      "top_logprobs, prompt_logprobs; -1 in a request asks for the whole vocabulary); -1: the vocabulary size",
      minimum=0, special=(-1,), server=True),
    # issue 15: the GGUF's quantized blocks for decode-sized matmuls on CPU (engine/layers/gguf_quant.py);
    # issue 32: on by default for a GGUF model, as vLLM's EngineArgs.create_model_config sets it
    S("quantization", "--quantization", str, None, "how weights are quantized; gguf: keep a GGUF model's Q4_1/Q8_0 "
      "blocks for matmuls of up to 8 tokens on CPU (16 where they run on AMX tiles, 64 with "
      "KVPILOT_GGUF_ACTIVATIONS=float32; elsewhere the dense weights serve), the default for a GGUF model (a builtin alias or a .gguf file) as in vLLM; none: "
      "the dense (dequantized) weights only, so a sequence's tokens do not depend on how many others share "
      "its steps",
      choices=("gguf", "none"), short="-q"),
)
del S

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
BY_CRD: dict[str, Setting] = {s.crd: s for s in SETTINGS if s.crd}
CRD_FIELDS: dict[str, str] = {s.name: s.crd for s in SETTINGS if s.crd}  # name -> spec.engine key
# name -> its path under an InferenceService's spec (SPEC_RULES' spelling): spec.engine's fields, and
# nnodes, which the operator renders per pod from spec.parallelism (no spec.engine field)
SPEC_PATHS: dict[str, str] = {**{name: f"engine.{field}" for name, field in CRD_FIELDS.items()},
                              "nnodes": "parallelism.nnodes"}
LIVE_SETTINGS: tuple[str, ...] = tuple(s.name for s in SETTINGS if s.live)
ENGINE_SETTINGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if not s.server)


SEARCH_RANGES: dict[str, tuple[Any, Any]] = {s.name: s.search for s in SETTINGS if s.search is not None}
# The settings kvpilot's tuner may change (the axes of kvpilot.tuner.search.space.SearchSpace); an
# InferenceService's spec.tuning.pinned names those it must never change, by spec.engine key.
TUNED_SETTINGS: tuple[str, ...] = ("max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization",
                                   "enable_chunked_prefill", "enable_prefix_caching", "block_size",
                                   "tensor_parallel_size", "pipeline_parallel_size", "kv_cache_memory_bytes",
                                   "performance_mode")


def deploy_defaults() -> dict[str, Any]:
    """The defaults the CRD, the operator and the tuner use, with the derived budget resolved
    (balanced performance mode: the CRD fills the limits, so the mode never doubles them)."""
    values = {s.name: s.deployed_default for s in SETTINGS}
    values["max_num_batched_tokens"] = default_max_num_batched_tokens(
        values["enable_chunked_prefill"], values["max_model_len"])
    return values


def crd_defaults() -> dict[str, Any]:
    """spec.engine's defaults as the CRD's schema gives them, by setting name: deploy_defaults(),
    but crd_default where a setting has one (None: the CRD gives no default; block_size, which
    kvpilot.api.spec fills by runtime and devices)."""
    values = deploy_defaults()
    values.update({s.name: s.crd_default for s in SETTINGS if s.has_crd_default})
    return values


def flag_words(name: str, value: Any) -> list[str]:
    """The command-line words that set `name` to `value` (booleans: `--x` / `--no-x`;
    numbers as a person types them). [] for None."""
    setting = BY_NAME[name]
    if value is None:
        return []
    if setting.type is bool:
        return [setting.flag if value else "--no-" + setting.flag[2:]]
    if setting.type is float:
        return [setting.flag, _num(value)]
    return [setting.flag, str(value)]


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value `args` give setting `name` as `--flag VALUE` or `--flag=VALUE` (the last one
    wins, as argparse does), or None when they do not set it."""
    flag, found = BY_NAME[name].flag, None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


# Settings the pinned upstream vLLM (kvpilot.api.vllm) no longer takes (`vllm serve` 0.32 exits 2:
# "unrecognized arguments"), with why: runtime vllm renders no flag for them (the operator refuses
# a value other than the default).
NOT_IN_VLLM: dict[str, str] = {
    "swap_space": "vLLM removed --swap-space with its V0 engine (V1 preempts by recompute only; on CPU the KV "
                  "cache is sized by VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes)",
    "preemption_mode": "vLLM removed --preemption-mode with its V0 engine: V1 always preempts by recompute",
}
RUNTIMES = ("kvpilot", "vllm")


def to_flags(values: Mapping[str, Any], names: tuple[str, ...] | None = None, runtime: str = "kvpilot") -> list[str]:
    """`vllm serve` flags for `values` (snake_case names), in the table's order; only `names` (default:
    every name in values). None renders nothing; runtime "vllm" leaves out NOT_IN_VLLM. ValueError:
    an unknown runtime."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    wanted = set(values if names is None else names)
    if runtime == "vllm":
        wanted -= set(NOT_IN_VLLM)
    words: list[str] = []
    for setting in SETTINGS:
        if setting.name in wanted and setting.name in values:
            words += flag_words(setting.name, values[setting.name])
    return words


def problems(values: Mapping[str, Any], spell: Callable[[str], str] = lambda name: name) -> list[str]:
    """Bounds and choices of every given setting, then the rules, as messages."""
    found = [p for name, value in values.items() if name in BY_NAME
             if (p := BY_NAME[name].problem(value, spell(name)))]
    return found + rule_problems(values, spell)


def resolve_quantization(quantization: str | None, gguf_model: bool, on_cpu: bool) -> str | None:
    """The quantization an engine loads with (None: the dense weights): `quantization` as given,
    "none" meaning the dense weights; unset, "gguf" for a GGUF model (`gguf_model`) on CPU, as
    vLLM's EngineArgs.create_model_config sets `quantization = load_format = "gguf"` for a GGUF
    file (on a GPU the dense weights serve: the GGUF kernel is a CPU kernel). Shared by the
    engine and the tuner's memory model."""
    if quantization == "none":
        return None
    if quantization is None:
        return "gguf" if gguf_model and on_cpu else None
    return quantization


def check(values: Mapping[str, Any]) -> None:
    """Raises ValueError with the first problem of `values` (snake_case names)."""
    found = problems(values)
    if found:
        raise ValueError(found[0])
