"""Wires a local tuning session together from parsed `kvpilot tune --local` flags: the
model's shape, the hardware, the flag check against the engine's --help, the workload,
the engine process (`kvpilot serve`, or upstream `vllm serve` with --runtime vllm:
`kvpilot.tuner.local.vllm_runtime`), the measurement source, the study and the tuner; prints a line
per trial and the report at the end."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import optuna

from kvpilot.api.models import is_gguf_source
from kvpilot.api.tuning_metrics import TunerMetrics
from kvpilot.loadgen.machine import loadavg, machine_info
from kvpilot.engine.settings import BY_NAME, flag_value, flag_words, resolve_quantization
from kvpilot.tuner.report import artifacts
from kvpilot.tuner.report import tuning_report as reports
from kvpilot.tuner.local.engine_process import EngineProcess, check_flags
from kvpilot.tuner.search.feasibility import Hardware, resolve_model
from kvpilot.tuner.search.guide import RequestTokens
from kvpilot.tuner.local.runner import LocalRunner
from kvpilot.tuner.search.loop import Tuner, TunerConfig, best_measured
from kvpilot.tuner.measure.promql import PrometheusSource
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.study import open_study
from kvpilot.tuner.measure.workload import Load, load_requests


def hardware_for(a: argparse.Namespace) -> Hardware:
    """The device the trials run on: --device-memory-gib, else this machine's memory (or
    the first GPU's); --num-gpu-blocks-override among the engine args fixes the cache. On
    CPU (no GPU here) every rank of a parallel trial shares that memory, and so do the nodes of
    a multi-node trial, all on this machine."""
    import torch  # here, not at import: `kvpilot tune`'s import graph stays torch-free

    from kvpilot.engine.memory import GiB, total_device_memory_bytes

    on_gpu = torch.cuda.is_available()
    if a.device_memory_gib:
        memory = int(a.device_memory_gib * GiB)
    else:
        memory = total_device_memory_bytes(torch.device("cuda" if on_gpu else "cpu"))
    override = None
    if (value := flag_value(a.engine_args, "num_gpu_blocks_override")) is not None:
        override = int(value)
    gguf = is_gguf_source(a.model) and a.runtime == "kvpilot"  # vLLM serves the builtin model's safetensors
    quantization = resolve_quantization(flag_value(a.engine_args, "quantization"), gguf, not on_gpu)
    return Hardware(device_memory_bytes=memory, num_devices=a.num_devices, num_gpu_blocks_override=override,
                    shared_memory=not on_gpu, quantization=quantization, one_machine=True)


# settings that --engine-arg may set and the defaults trial takes as its own (base_settings): the
# engine as it runs before tuning, e.g. limits a deployment settled on
SETTINGS_FROM_ARGS = ("performance_mode", "kv_cache_memory_bytes", "block_size", "max_num_batched_tokens",
                      "max_num_seqs")


class SetupError(ValueError):
    """The session cannot start as asked (`kvpilot tune` exits 2): the message says what to change."""


def base_settings(a: argparse.Namespace) -> EngineSettings:
    """The defaults trial's settings: the engine's defaults at --max-model-len, with the
    --engine-arg values of the settings that move them or the KV cache (--performance-mode
    throughput doubles the default limits; --kv-cache-memory-bytes sizes the cache, --block-size
    divides it; --max-num-batched-tokens and --max-num-seqs: the limits running before tuning),
    so that trial 0 and the memory model see the engine that runs."""

    given = {name: (BY_NAME[name].parse or BY_NAME[name].type)(v)
             for name in SETTINGS_FROM_ARGS if (v := flag_value(a.engine_args, name)) is not None}
    return EngineSettings(max_model_len=a.max_model_len, **given)


def fixed_engine_args(engine_args: list[str]) -> list[str]:
    """--engine-arg values without the settings base_settings took from them: every trial's own
    flags carry those (the last flag wins, so a repeated fixed value would override the trial's,
    e.g. a searched --kv-cache-memory-bytes)."""

    flags = {BY_NAME[name].flag for name in SETTINGS_FROM_ARGS}
    out, skip = [], False
    for arg in engine_args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif arg.split("=", 1)[0] not in flags:
            out.append(arg)
    return out


def searched_flags(base: EngineSettings, a: argparse.Namespace) -> list[str]:
    """Every flag a trial may pass: both spellings of the booleans the space can flip."""
    flags = base.to_flags(a.runtime) + [f for f in a.engine_args if f.startswith("--")]
    flags += flag_words("enable_chunked_prefill", True) + flag_words("enable_chunked_prefill", False)
    if a.prefix_caching:
        flags += flag_words("enable_prefix_caching", True) + flag_words("enable_prefix_caching", False)
    if a.nnodes and a.nnodes[1] > 1:  # the nodes of a multi-node trial (EngineProcess)
        flags += [BY_NAME[name].flag for name in ("nnodes", "node_rank", "master_addr", "master_port", "headless")]
    return flags


def request_tokens(load: Load) -> RequestTokens:
    """The window's request sizes (prompt + output tokens) for the guide's memory-model points."""
    sizes = [r.prompt_len + r.expected_output_len for r in load.requests]
    return RequestTokens(mean=sum(sizes) / len(sizes), longest=max(sizes))


def progress_printer(total: int, metrics: TunerMetrics, study_ref: list[optuna.Study]):
    """A callback printing one line per finished trial and updating the tuner metrics."""
    def on_trial(t: optuna.trial.FrozenTrial) -> None:
        attrs = t.user_attrs
        m = attrs.get("measurement") or {}
        best = best_measured(study_ref[0])
        metrics.record_trial(t, best)
        how = (m.get("extra") or {}).get("applied", "")
        what = (f"goodput {m['goodput_rps']:.3f} req/s, p95 ttft {(m.get('ttft_p95_s') or 0) * 1000:.0f} ms, "
                f"itl {(m.get('itl_p95_s') or 0) * 1000:.0f} ms, {m.get('preemptions', 0):.0f} preemptions"
                if m else (attrs.get("pruned_reason") or attrs.get("failure_message") or "")[:120])
        settings = EngineSettings(**attrs["settings"]).describe() if attrs.get("settings") else ""
        print(f"[trial {t.number:>2}] {settings} {('(' + how + ') ') if how else ''}-> {attrs.get('verdict')}: {what}",
              file=sys.stderr, flush=True)
    return on_trial


def local_engine(a: argparse.Namespace, hardware: Hardware) -> tuple[EngineSettings, EngineProcess]:
    """The defaults trial's settings and the engine process every trial restarts, after checking
    that the engine's --help lists every flag a trial may pass. Raises SetupError (exit 2): a
    flag the engine lacks; --runtime vllm on CPU without --kv-cache-memory-bytes."""
    base, log = base_settings(a), a.report_dir / "engine.log"
    if a.runtime == "kvpilot":
        engine = EngineProcess(a.model, log, fixed_engine_args(a.engine_args), a.api_key, port=a.port)
        help_flag = "--help"
    else:
        from kvpilot.tuner.local.vllm_runtime import VLLM_CPU_BLOCK_SIZE, VLLM_HELP, vllm_engine

        if hardware.shared_memory and base.kv_cache_memory_bytes is None:
            raise SetupError("--runtime vllm on CPU: add --engine-arg=--kv-cache-memory-bytes=N (e.g. 256M), the KV "
                             "cache of the defaults trial; vLLM's --gpu-memory-utilization there is a fraction of the "
                             "whole machine's memory, which it refuses to take beside other processes")
        if hardware.shared_memory and flag_value(a.engine_args, "block_size") is None:
            base = base.replace(block_size=VLLM_CPU_BLOCK_SIZE)  # vLLM's CPU attention: multiples of 32
        engine, help_flag = vllm_engine(a.model, log, a.serve_command, fixed_engine_args(a.engine_args), a.api_key,
                                        a.port), VLLM_HELP
    try:
        check_flags(engine.serve_command, searched_flags(base, a), help_flag=help_flag, cwd=a.report_dir)
    except ValueError as e:
        raise SetupError(f"{e}; drop those flags (--engine-arg, the searched settings) or use another "
                         f"--runtime / --vllm-python") from e
    return base, engine


def run_local(a: argparse.Namespace, on_study: Any = None) -> dict[str, Any]:
    """Runs the session and returns the report dict (also written under a.report_dir). Raises
    SetupError (`local_engine`) before any trial when the engine cannot run the session."""
    model = resolve_model(a.model)
    hardware = hardware_for(a)
    base, engine = local_engine(a, hardware)
    from kvpilot.loadgen.tokenizers import load_tokenizer

    load = load_requests(load_tokenizer(a.model), a.workload, a.max_model_len)
    name = a.model.removeprefix("builtin://")
    source_for = None
    if a.prometheus_url:
        selector = ",".join(s for s in (f'model_name="{name}"', a.prometheus_selector) if s)
        source_for = lambda _url: PrometheusSource(a.prometheus_url, selector)  # noqa: E731
    capacity = (*a.capacity_range, a.capacity_steps) if a.objective == "capacity" else None
    runner = LocalRunner(engine, a.workload, load, a.slo, name, source_for=source_for, live=not a.no_live,
                         capacity=capacity)
    study = open_study(a.study_name or f"kvpilot-local-{name}", a.storage, a.objective, a.sampler, a.seed)
    metrics = TunerMetrics("local", name)
    metrics.set_slo(a.slo)
    if a.metrics_port:
        metrics.serve(a.metrics_port)
    tuner = Tuner(study, a.space, base, model, hardware, a.slo, runner,
                  TunerConfig(objective=a.objective, latency=a.latency, n_trials=a.trials,
                              remeasure_top=a.remeasure_top, guided=a.guide,
                              request_tokens=request_tokens(load)),
                  on_trial=progress_printer(a.trials, metrics, [study]))
    print(f"tuning {name} locally on {a.runtime}: {a.trials} trials of {a.workload.num_requests} ShareGPT requests; "
          f"SLOs {vars(a.slo)}; report in {a.report_dir}", file=sys.stderr, flush=True)
    load_before = loadavg()
    try:
        tuner.run()
    finally:
        runner.close()
    machine = machine_info(loadavg_before=load_before)  # the trials share this machine with whatever else runs
    meta = {"mode": "local", "model": name, "workload": vars(a.workload), "applied": runner.applied,
            "engine_args": a.engine_args, "runtime": a.runtime, "machine": machine}
    rep = reports.build(study, a.slo, a.objective, meta)
    path = reports.write(rep, a.report_dir)
    replace = rep.get("best") and (rep.get("decision") or {}).get("replace", True)  # beyond the noise only
    best = EngineSettings(**rep["best"]["settings"]) if replace else base
    manifest = artifacts.tuned_inferenceservice(
        name.split("-")[0], f"builtin://{name}" if not a.model.startswith("/") else a.model, best, a.slo,
        extra_args=fixed_engine_args(a.engine_args))
    if a.runtime != "kvpilot":
        manifest["spec"]["engine"]["runtime"] = a.runtime
    artifacts.write_manifest(a.report_dir, manifest)
    artifacts.write_plots(a.report_dir, study, rep)
    print(reports.table(rep))
    print(f"\nreport: {path}")
    return rep
