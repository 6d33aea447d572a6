"""`kvpilot tune`: SLO autotuning of the engine's settings.

    kvpilot tune --local [--model M] [--trials 8] [--slo-ttft-ms 2000 --slo-itl-ms 200] ...
    kvpilot tune --local --runtime vllm --engine-arg=--kv-cache-memory-bytes=64M ...
    kvpilot tune --namespace NS --name NAME [--prometheus-url URL] [--target-url URL] ...
    kvpilot tune --local --continuous --port 8000 --live-seconds 60 [--watch-seconds 60] ...

Local mode restarts (or live-reconfigures) a `kvpilot serve` process per trial and drives
ShareGPT load at it (--runtime vllm: upstream vLLM's `vllm serve`, a restart per trial,
`kvpilot.tuner.local.vllm_runtime`); cluster mode patches the InferenceService's spec.engine, waits for the
rollout and measures through Prometheus (or a direct scrape). Both write a report folder
(report.json, report.txt) and print the table. Exit 0 when a feasible setting was found,
1 when none met the SLOs, 2 on bad flags (also an engine that is not found or lacks a flag the
trials need).

--continuous (local; in a cluster spec.tuning.mode continuous) keeps watching the live traffic
that others send to --port after the study and re-tunes when the SLOs break or the workload
moves (`kvpilot.tuner.continuous`); it runs until --max-windows watch windows or Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import secrets
import sys
import tempfile
from pathlib import Path

from kvpilot.engine.settings import BY_NAME, PERFORMANCE_MODES, RUNTIMES, SEARCH_RANGES, human_readable_int
from kvpilot.tuner.search.objective import LATENCIES, OBJECTIVES, SLO
from kvpilot.tuner.search.space import SearchSpace
from kvpilot.tuner.search.study import SAMPLERS
from kvpilot.tuner.watch import WatchConfig
from kvpilot.tuner.measure.workload import Workload
from kvpilot.engine.settings.env import VLLM_API_KEY

WATCH = WatchConfig()  # the watcher's defaults, which the continuous flags start from


def _range(kind):
    def parse(text: str):
        low, sep, high = text.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"write LOW:HIGH, got {text!r}")
        return kind(low), kind(high)
    return parse


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m for m in text.split(",") if m)
    if not modes or any(m not in PERFORMANCE_MODES for m in modes):
        raise argparse.ArgumentTypeError(f"choose among {', '.join(PERFORMANCE_MODES)}, got {text!r}")
    return modes


def _bools(text: str) -> tuple[bool, ...]:
    choices = {"both": (True, False), "on": (True,), "off": (False,)}
    if text not in choices:
        raise argparse.ArgumentTypeError(f"choose both, on or off, got {text!r}")
    return choices[text]


def build_parser() -> argparse.ArgumentParser:
    """`kvpilot tune`'s flags, in groups: where (local or cluster), model and engine, SLOs (ms),
    search, workload, output and continuous tuning."""
    p = argparse.ArgumentParser(prog="kvpilot tune", description=__doc__.split("\n\n")[0])
    mode = p.add_argument_group("where")
    mode.add_argument("--local", action="store_true", help="tune local engine processes")
    mode.add_argument("--namespace", help="the InferenceService's namespace (cluster mode)")
    mode.add_argument("--name", help="the InferenceService's name (cluster mode)")
    mode.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    mode.add_argument("--target-url", default=None, help="cluster mode: engine URL to load and scrape "
                      "(default: status.url's host)")
    mode.add_argument("--rollout-timeout", type=float, default=600.0, help="seconds to wait for a rollout")
    _add_engine_flags(p)
    _add_slo_flags(p)
    _add_search_flags(p)
    _add_workload_flags(p)
    _add_output_flags(p)
    _add_continuous_flags(p)
    return p


def _add_continuous_flags(p: argparse.ArgumentParser) -> None:
    """Continuous mode: the watcher's windows, triggers and guard rails (kvpilot.tuner.watch)."""
    c = p.add_argument_group("continuous tuning (local; a cluster reads spec.tuning)")
    c.add_argument("--continuous", action="store_true", help="after the study, watch the live traffic and re-tune "
                   "on an SLO breach or a workload shift (needs --live-seconds and --port)")
    c.add_argument("--live-seconds", type=float, default=0.0, help="measure each trial on the live traffic others "
                   "send to --port for this long instead of driving ShareGPT load")
    c.add_argument("--watch-seconds", type=float, default=WATCH.window_s, help="one watch window")
    c.add_argument("--breach-windows", type=int, default=WATCH.breach_windows, help="windows in a row breaking an SLO that re-tune")
    c.add_argument("--shift-ratio", type=float, default=WATCH.shift_ratio, help="a rate or length quantile moving by more than this "
                   "factor re-tunes")
    c.add_argument("--cooldown-s", type=float, default=WATCH.cooldown_s, help="no study within this long after the last")
    c.add_argument("--max-studies-per-hour", type=int, default=WATCH.max_studies_per_hour)
    c.add_argument("--retune-trials", type=int, default=6, help="trials of a study the watcher starts")
    c.add_argument("--pin", default="", metavar="SETTING[,SETTING]", help="settings no trial changes, e.g. "
                   "max_num_seqs,enable_chunked_prefill")
    c.add_argument("--max-windows", type=int, default=None, help="stop after this many watch windows")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The model and the engine flags every trial shares."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default="smollm2-135m-instruct", help="builtin alias or HF directory")
    g.add_argument(BY_NAME["max_model_len"].flag, type=int, default=1024)
    g.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="extra engine flag for every trial (repeat; e.g. --engine-arg=--num-gpu-blocks-override=256)")
    g.add_argument("--api-key", default=None, help="the engine's API key (local default: a random one)")
    g.add_argument("--port", type=int, default=0, help="fixed local engine port (for a Prometheus that scrapes it)")
    g.add_argument("--no-live", action="store_true", help="restart for every trial, never change settings live")
    g.add_argument("--runtime", choices=RUNTIMES, default="kvpilot",
                   help="--local: the engine every trial starts: kvpilot serve, or upstream vLLM's vllm serve (a "
                        "restart per trial; on CPU it needs --engine-arg=--kv-cache-memory-bytes=N and runs with "
                        "VLLM_CPU_NUM_OF_RESERVED_CPU=0 and VLLM_CPU_OMP_THREADS_BIND=nobind unless set)")
    g.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="--runtime vllm: the Python of an environment with vLLM (default: .venv-vllm's in this "
                        "checkout, made by `make vllm`, else `vllm` on PATH)")
    g.add_argument("--device-memory-gib", type=float, default=None, help="device memory for the KV-cache "
                   "prediction (default: this machine's)")
    g.add_argument("--num-devices", type=int, default=1)


def _add_slo_flags(p: argparse.ArgumentParser) -> None:
    """The SLOs a trial must meet."""
    s = p.add_argument_group("SLOs (milliseconds; 0 disables)")
    s.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    s.add_argument("--slo-itl-ms", type=float, default=200.0)
    s.add_argument("--slo-e2e-ms", type=float, default=0.0)
    s.add_argument("--max-preemptions-per-min", type=float, default=0.0)


def _add_search_flags(p: argparse.ArgumentParser) -> None:
    """The objective, sampler, budget and search ranges."""
    o = p.add_argument_group("search")
    o.add_argument("--objective", choices=OBJECTIVES, default=None,
                   help="default: goodput locally, spec.tuning.objective in a cluster")
    o.add_argument("--latency", choices=LATENCIES, default="e2e", help="the p95 that --objective multi minimises")
    o.add_argument("--capacity-range", type=_range(float), default=(0.1, 4.0), metavar="LOW:HIGH",
                   help="--objective capacity: request rates (req/s) to search between")
    o.add_argument("--capacity-steps", type=int, default=3, help="--objective capacity: bisection windows")
    o.add_argument("--sampler", choices=SAMPLERS, default="tpe")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--trials", type=int, default=None,
                   help="deployments to spend (pruned trials are free); default 8 locally, spec.tuning.maxTrials")
    o.add_argument("--remeasure-top", type=int, default=2, help="best trials to measure again")
    o.add_argument("--no-guide", dest="guide", action="store_false",
                   help="let the sampler propose every trial (default: memory-model points, SLO repairs and "
                        "neighbour moves first, kvpilot.tuner.search.guide)")
    for name, kind in (("max_num_batched_tokens", int), ("max_num_seqs", int), ("gpu_memory_utilization", float),
                       ("kv_cache_memory_bytes", human_readable_int)):  # search ranges, named as the setting
        bounds = SEARCH_RANGES.get(name)  # the one table of default ranges (kvpilot.engine.settings)
        o.add_argument(BY_NAME[name].flag, type=_range(kind), default=bounds, metavar="LOW:HIGH",
                       help=f"search range (default: {'%d to %d' % bounds if bounds else 'not searched'})")
    o.add_argument("--performance-modes", type=_modes, default=(), metavar="MODE[,MODE]",
                   help="performance modes to try (balanced, interactivity, throughput; default: not searched: on "
                        "kvpilot's engine the mode only doubles default limits that every trial sets)")
    o.add_argument("--chunked-prefill", type=_bools, default=(True, False), metavar="both|on|off")
    o.add_argument("--block-sizes", type=lambda t: tuple(int(x) for x in t.split(",")), default=())
    o.add_argument("--prefix-caching", type=_bools, default=(), metavar="both|on|off")
    o.add_argument("--parallel", action="store_true", help="search tensor/pipeline parallel sizes")
    o.add_argument("--nnodes", type=_range(int), default=None, metavar="LOW:HIGH",
                   help="pods one engine may span (spec.parallelism.nnodes, vLLM's --nnodes), searched with the "
                        "parallel layout; --num-devices is then per pod (default: not searched, the resource's own). "
                        "--local runs the nodes as processes on this machine")
    o.add_argument("--storage", default=None, help="Optuna storage, e.g. sqlite:///tune.db (resumes); in a cluster "
                   "the default is 'configmap' (ConfigMap <name>-tuning, owned by the resource)")
    o.add_argument("--study-name", default=None)


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    """The load each trial is measured under."""
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=32)
    w.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default: all at once)")
    w.add_argument("--burstiness", type=float, default=1.0, help="arrival gaps' gamma shape, as vllm bench serve's: "
                   "1 Poisson, below 1 burstier")
    w.add_argument("--max-concurrency", type=int, default=None)
    w.add_argument("--max-output-len", type=int, default=None, help="cap ShareGPT reply lengths (tokens)")
    w.add_argument("--max-prompt-len", type=int, default=None)
    w.add_argument("--trace", default=None, help="JSONL trace (timestamp, prompt_len, output_len) to replay")
    w.add_argument("--warmup-requests", type=int, default=2)


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """Where measurements come from and reports go."""
    m = p.add_argument_group("measurement and output")
    m.add_argument("--prometheus-url", default=None, help="measure through this Prometheus (default: scrape /metrics)")
    m.add_argument("--prometheus-selector", default="", help='extra PromQL matchers, e.g. job="engine"')
    m.add_argument("--metrics-port", type=int, default=None, help="export the tuner's own metrics on this port")
    m.add_argument("--report-dir", default=None, help="where report.json/report.txt go (default: a temp dir)")
    m.add_argument("-v", "--verbose", action="store_true")


def parse(argv: list[str]) -> argparse.Namespace:
    """Parses and checks the flags; exits 2 (argparse) on a bad combination."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.local == bool(a.namespace or a.name):
        p.error("choose --local, or --namespace and --name for an InferenceService")
    if not a.local and not (a.namespace and a.name):
        p.error("cluster mode needs both --namespace and --name")
    if a.local and a.prometheus_url and not a.port:
        p.error("--local with --prometheus-url needs --port: the engine port your Prometheus scrapes")
    if a.runtime == "vllm" and not a.local:
        p.error("--runtime vllm is for --local; in a cluster the InferenceService's spec.engine.runtime decides")
    if a.runtime == "vllm" and a.nnodes and a.nnodes[1] > 1:
        p.error("--runtime vllm runs one process per trial here: drop --nnodes")
    if (a.trials is not None and a.trials < 1) or a.num_requests < 1 or a.remeasure_top < 0:
        p.error("--trials and --num-requests must be >= 1, --remeasure-top >= 0")
    try:
        a.space = SearchSpace(max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
                              gpu_memory_utilization=a.gpu_memory_utilization, enable_chunked_prefill=a.chunked_prefill,
                              parallel=a.parallel, num_devices=a.num_devices, block_size=a.block_sizes,
                              enable_prefix_caching=a.prefix_caching, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                              performance_mode=a.performance_modes, nnodes=a.nnodes)
        a.workload = Workload(dataset=a.trace or "sharegpt", num_requests=a.num_requests, request_rate=a.request_rate,
                              burstiness=a.burstiness, max_concurrency=a.max_concurrency, max_output_len=a.max_output_len,
                              max_prompt_len=a.max_prompt_len, warmup_requests=a.warmup_requests, seed=a.seed)
    except ValueError as e:
        p.error(str(e))
    a.pinned = tuple(n for n in a.pin.split(",") if n)
    try:
        a.space.pin(a.pinned)
    except ValueError as e:
        p.error(f"--pin: {e}")
    if a.continuous and not (a.local and a.live_seconds > 0 and a.port):
        p.error("--continuous needs --local, --live-seconds S (trials observe the live traffic) and --port P "
                "(where that traffic goes); in a cluster set spec.tuning.mode: continuous")
    if a.continuous and (a.watch_seconds < 1 or a.breach_windows < 1 or a.shift_ratio <= 1
                         or a.max_studies_per_hour < 1 or a.retune_trials < 1):
        p.error("--watch-seconds >= 1, --breach-windows >= 1, --shift-ratio > 1, --max-studies-per-hour >= 1 and "
                "--retune-trials >= 1")
    a.slo = SLO(a.slo_ttft_ms, a.slo_itl_ms, a.slo_e2e_ms, a.max_preemptions_per_min)
    a.engine_args = [part for arg in a.engine_arg for part in arg.split("=", 1)]
    a.serve_command = None  # kvpilot serve
    if a.runtime == "vllm":
        from kvpilot.tuner.local.vllm_runtime import VLLMNotFound, vllm_serve_command

        try:
            a.serve_command = vllm_serve_command(a.vllm_python)
        except VLLMNotFound as e:
            p.error(str(e))
        a.no_live = True  # vLLM has no live scheduler changes: every trial is a restart
    if a.local:
        a.api_key = a.api_key or os.environ.get(VLLM_API_KEY) or secrets.token_hex(8)  # as vllm serve reads it
        a.trials = a.trials or 8
        a.objective = a.objective or "goodput"
    a.report_dir = Path(a.report_dir or tempfile.mkdtemp(prefix="kvpilot-tune-"))
    return a


def main(argv: list[str]) -> int:
    """Runs one tuning session, local or against an InferenceService (the module docstring). Returns 0
    when a feasible setting (or a Pareto front) was found, 1 when none met the SLOs, 2 when the engine
    refuses a flag or lacks one the trials need (SetupError); bad flags exit 2 (argparse)."""
    a = parse(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    logging.getLogger("kvpilot.tuner").setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    import optuna

    optuna.logging.set_verbosity(optuna.logging.INFO if a.verbose else optuna.logging.WARNING)
    if a.local:
        from kvpilot.tuner.local.session import SetupError, run_local

        try:
            if a.continuous:
                from kvpilot.tuner.local.continuous import run_local_continuous

                run_local_continuous(a)
                return 0
            report = run_local(a)
        except SetupError as e:  # the engine refuses a flag, or the session lacks one it needs
            print(f"kvpilot tune: error: {e}", file=sys.stderr)
            return 2
    else:
        from kvpilot.tuner.cluster.session import run_cluster

        report = run_cluster(a)
    return 0 if report.get("best") or report.get("pareto_front") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
