"""Wires a cluster tuning session from `kvpilot tune --namespace NS --name NAME` flags.

The resource says what to tune against: the model (`spec.model.source`), the SLOs
(`spec.slo`), the trial budget and workload (`spec.tuning.maxTrials`, `trialSeconds`,
`workload`: synthetic load driven by the tuner, or live traffic observed for trialSeconds),
with prompts cut by the engine's own tokenizer (its /tokenize, `kvpilot.tuner.cluster.remote_tokenizer`),
and the starting engine settings (`spec.engine`), which are trial 0, so the report says
how much better the best is than what ran before. Flags override the budget (--trials)
and give what the resource cannot: where to reach the engine from the tuner
(--target-url) and Prometheus (--prometheus-url; scoped to the resource's pods). The study
is kept in the cluster (ConfigMap `<name>-tuning`, see `kvpilot.tuner.cluster.journal`) unless
--storage names another Optuna storage, so a restarted tuner resumes it.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import functools
import sys
from collections.abc import Callable
from typing import Any

import optuna

from kvpilot.api.kube import KubeClient
from kvpilot.api.models import is_gguf_source
from kvpilot.api.spec import InferenceServiceSpec, service_url
from kvpilot.api.tuning_metrics import TunerMetrics
from kvpilot.engine.settings import BY_CRD, flag_value, resolve_quantization
from kvpilot.tuner.report import artifacts
from kvpilot.tuner.report import tuning_report as reports
from kvpilot.tuner.cluster.runner import KubernetesRunner
from kvpilot.tuner.search.feasibility import Hardware, resolve_model
from kvpilot.tuner.cluster.journal import configmap_storage
from kvpilot.tuner.measure.trial_window import WindowMeasurer
from kvpilot.tuner.search.loop import Tuner, TunerConfig, TuningStopped, best_measured
from kvpilot.tuner.search.objective import SLO
from kvpilot.tuner.measure.promql import PrometheusSource
from kvpilot.tuner.search.reseed import prepare, study_names
from kvpilot.tuner.cluster.remote_tokenizer import RemoteTokenizer
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.study import open_study
from kvpilot.tuner.measure.workload import load_requests

_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity ('4Gi', '512Mi', '1G', '1000') in bytes."""
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * _UNITS[suffix])
    return int(float(text))


def quantity_cpus(text: str) -> float:
    """A Kubernetes CPU quantity ('2', '1.5', '500m') in CPUs."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def slo_of(spec: InferenceServiceSpec) -> SLO:
    """The tuner's SLO from spec.slo: p95 TTFT, ITL and end-to-end latency (ms; 0: no limit) and
    preemptions per minute."""
    return SLO(ttft_p95_ms=spec.slo.ttftP95Ms, itl_p95_ms=spec.slo.itlP95Ms, e2e_p95_ms=spec.slo.e2eP95Ms,
               max_preemptions_per_min=spec.slo.maxPreemptionsPerMin)


def engine_api_key(kube: KubeClient, namespace: str, spec: InferenceServiceSpec, given: str | None) -> str | None:
    """The key the tuner sends to the engine: --api-key when given, else the one the pods
    get, read from the Secret `spec.engine.apiKeySecret` names (the operator's service account
    may `get` Secrets in the watched namespaces, the chart's RBAC); None when the engine has no
    key. The value is never logged. Raises SystemExit (with the Secret's name, not its data)
    when the Secret or its key is missing or not base64, since every request would get 401."""
    ref = spec.engine.apiKeySecret
    if given or ref is None:
        return given
    secret = kube.get(f"/api/v1/namespaces/{namespace}/secrets/{ref.name}")
    encoded = ((secret or {}).get("data") or {}).get(ref.key)
    if encoded is None:
        raise SystemExit(f"spec.engine.apiKeySecret: Secret {namespace}/{ref.name} "
                         f"{'has no key ' + repr(ref.key) if secret else 'does not exist'}; the tuner cannot "
                         f"reach the engine without its API key")
    try:
        # as the engine reads $VLLM_API_KEY: surrounding whitespace (a key file's newline) is not the key
        return base64.b64decode(encoded, validate=True).decode().strip()
    except (binascii.Error, UnicodeDecodeError):
        raise SystemExit(f"spec.engine.apiKeySecret: key {ref.key!r} of Secret {namespace}/{ref.name} is not "
                         f"base64-encoded UTF-8") from None


def hardware_of(spec: InferenceServiceSpec, a: argparse.Namespace) -> Hardware:
    """One pod's resources (spec.resources is per pod; with spec.parallelism.nnodes > 1
    each pod of a group has them): device memory from --device-memory-gib (one GPU per
    rank, --num-devices per pod), else the pod's memory limit and CPUs (CPU engines: the
    ranks of a pod share them); --num-gpu-blocks-override in extraArgs fixes the cache size."""
    memory = int(a.device_memory_gib * (1 << 30)) if a.device_memory_gib else quantity_bytes(spec.resources.memory)
    value = flag_value(spec.engine.extraArgs, "num_gpu_blocks_override")
    override = None if value is None else int(value)
    quantization = resolve_quantization(flag_value(spec.engine.extraArgs, "quantization"),
                                        is_gguf_source(spec.model.source), not a.device_memory_gib)
    return Hardware(device_memory_bytes=memory, num_devices=a.num_devices, num_gpu_blocks_override=override,
                    shared_memory=not a.device_memory_gib, quantization=quantization,
                    cpus=None if a.device_memory_gib else quantity_cpus(spec.resources.cpu))


def run_cluster(a: argparse.Namespace, kube: KubeClient | None = None, stop: Callable[[], bool] = lambda: False,
                on_event: Callable[..., None] | None = None) -> dict[str, Any]:
    """Tunes one InferenceService; returns the report (also written under a.report_dir).
    stop: checked between trials (raises TuningStopped; status.tuning stays Running so a
    restarted tuner resumes); on_event(reason, message[, type]): e.g. Kubernetes events.
    With spec.tuning.mode continuous the session then watches the live traffic and re-tunes
    (`kvpilot.tuner.cluster.continuous`) until stop() or the mode changes."""
    event = on_event or (lambda reason, message, type="Normal": None)
    kube = kube or KubeClient.from_environment(a.kubeconfig, user_agent="kvpilot-tuner")
    obj = kube.get_isvc(a.namespace, a.name)
    spec = InferenceServiceSpec.from_dict(obj.get("spec") or {})
    if not spec.tuning.enabled:
        raise SystemExit(f"{a.namespace}/{a.name}: spec.tuning.enabled is false; set it to let the tuner patch "
                         f"spec.engine")
    session = ClusterStudies(a, kube, obj, spec, event)
    original = EngineSettings.from_spec(obj["spec"])
    if spec.tuning.mode == "continuous":
        from kvpilot.tuner.cluster.continuous import run_watching

        return run_watching(session, original, stop)
    # after continuous mode: its last study (with the budget it started with), not the first
    name = (study_names(session.storage, session.base_name) or [session.base_name])[-1]
    n_trials = a.trials or (spec.tuning.maxTrials if name == session.base_name else spec.tuning.retuneTrials)
    return session.run_study(name, original, n_trials, stop)[0]


class ClusterStudies:
    """One InferenceService's tuning context (SLOs, objective, measurer, runner, the study
    storage, the tuner's metrics) and `run_study`, which the one-shot session runs once and the
    continuous one (`kvpilot.tuner.cluster.continuous`) once per study."""

    def __init__(self, a: argparse.Namespace, kube: KubeClient, obj: dict[str, Any], spec: InferenceServiceSpec,
                 event: Callable[..., None]):
        self.a, self.kube, self.obj, self.spec, self.event = a, kube, obj, spec, event
        self.slo = slo_of(spec)
        self.objective = a.objective or spec.tuning.objective
        # status.url once the operator has written it; before that (tuning on from the first apply,
        # when this session starts as the operator creates the children) the same Service URL
        url = (obj.get("status") or {}).get("url") or service_url(a.name, a.namespace, spec)
        self.target = (a.target_url or url.removesuffix("/v1")).rstrip("/")
        a.api_key = engine_api_key(kube, a.namespace, spec, a.api_key)
        self.headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        self.measurer = _window_measurer(a, spec, self.slo, EngineSettings.from_spec(obj["spec"]), self.target)
        self.runner = KubernetesRunner(kube, a.namespace, a.name,
                                       lambda n, s: self.measurer.measure(self.target, self.headers, s),
                                       rollout_timeout_s=a.rollout_timeout)
        self.storage = configmap_storage(kube, obj) if a.storage in (None, "configmap") else a.storage
        self.base_name = a.study_name or f"kvpilot-{a.namespace}-{a.name}"
        self.metrics = TunerMetrics(a.namespace, a.name)
        self.metrics.set_slo(self.slo)
        if a.metrics_port:
            self.metrics.serve(a.metrics_port)
        self.model = resolve_model(spec.model.source)
        # spec.tuning.pinned (spec.engine keys) and the tuner's own --pin (setting names)
        self.pinned = tuple(dict.fromkeys([*(BY_CRD[p].name for p in spec.tuning.pinned if p in BY_CRD),
                                           *getattr(a, "pinned", ())]))
        self.space = a.space.pin(self.pinned)

    def run_study(self, name: str, running: EngineSettings, n_trials: int, stop: Callable[[], bool] = lambda: False,
                  final_phase: str = "Done") -> tuple[dict[str, Any], EngineSettings, optuna.Study]:
        """Runs (or resumes) study `name` from `running`, seeded from the journal when the watcher
        started it (`kvpilot.tuner.search.reseed.prepare`; its best known settings are what a trial cut
        short restores), deploys the outcome and leaves status.tuning.phase `final_phase`.
        Returns the report, the settings deployed and the study."""
        a, slo, event = self.a, self.slo, self.event
        study = open_study(name, self.storage, self.objective, a.sampler, a.seed)
        best_known = prepare(study, self.storage, self.base_name, running, self.space, self.model, self.pinned)
        self.runner.best_settings, self.runner.best_trial = best_known, None

        def on_trial(t: optuna.trial.FrozenTrial) -> None:
            self.metrics.record_trial(t, best_measured(study))
            self.runner.record(study, t)
            if self.runner.best_settings is None:
                self.runner.best_settings = best_known
            line = f"trial {t.number}: {EngineSettings(**t.user_attrs['settings']).describe()} -> " \
                   f"{t.user_attrs.get('verdict')}"
            print(f"[{line}]", file=sys.stderr, flush=True)
            event("TuningTrial", line)

        tuner = Tuner(study, self.space, running, self.model, hardware_of(self.spec, a), slo, self.runner,
                      TunerConfig(objective=self.objective, latency=a.latency, n_trials=n_trials,
                                  remeasure_top=a.remeasure_top), on_trial=on_trial)
        event("TuningStarted", f"study {name}: tuning {n_trials} trials against {vars(slo)}")
        try:
            tuner.run(stop)
        except TuningStopped:
            raise
        except BaseException as e:
            self.runner.write_tuning(phase="Failed")
            event("TuningFailed", f"{type(e).__name__}: {e}"[:1000], "Warning")
            raise
        rep = reports.build(study, slo, self.objective, {"mode": "cluster", "namespace": a.namespace,
                                                         "name": a.name, "target": self.target})
        final = _apply_best(a, rep, study, self.runner, self.obj, self.spec, slo, running, event, final_phase)
        return rep, final, study


def _window_measurer(a: argparse.Namespace, spec: InferenceServiceSpec, slo: SLO,
                     original: EngineSettings, target: str) -> WindowMeasurer:
    """The trial measurer: Prometheus metrics of this resource's pods when a.prometheus_url is
    set, and a synthetic load when spec.tuning.workload asks for one, tokenized by the engine at
    `target` through vLLM's /tokenize (the operator image has no tokenizer of its own), built by
    the first trial once its engine answers."""
    source_for = None
    if a.prometheus_url:
        selector = ",".join(s for s in (f'namespace="{a.namespace}"', f'app_kubernetes_io_instance="{a.name}"',
                                        a.prometheus_selector) if s)
        source_for = lambda _url: PrometheusSource(a.prometheus_url, selector)  # noqa: E731
    load = None
    if spec.tuning.workload == "synthetic":
        tokenizer = RemoteTokenizer(target, spec.model.display_name, a.api_key)
        load = functools.cache(lambda: load_requests(tokenizer, a.workload, original.max_model_len))
    return WindowMeasurer(a.workload, load, slo, spec.model.display_name, source_for,
                          confirm_timeout_s=a.rollout_timeout, live_seconds=float(spec.tuning.trialSeconds))


def _apply_best(a: argparse.Namespace, rep: dict[str, Any], study: optuna.Study, runner: KubernetesRunner,
                obj: dict[str, Any], spec: InferenceServiceSpec, slo: SLO, original: EngineSettings,
                event: Callable[..., None], final_phase: str = "Done") -> EngineSettings:
    """Patches spec.engine with the best trial when it beats the original beyond the noise (else
    keeps the original), then writes the report (rep["applied"]: the spec.engine now), the tuned
    manifest and the plots; returns the settings deployed."""
    best = rep.get("best") if (rep.get("decision") or {}).get("replace", True) else None  # beyond the noise only
    final = runner.finish(EngineSettings(**best["settings"]) if best else None, original,
                          best["number"] if best else None, best["median"] if best else None, phase=final_phase)
    rep["applied"] = final.to_engine_spec()
    keep_reason = (rep.get("decision") or {}).get("reason", "no trial met the SLOs")
    event("TuningDone", f"spec.engine now {final.describe()}" + (f" (trial {best['number']})" if best else
                                                                  f" (kept the original settings: {keep_reason})"))
    reports.write(rep, a.report_dir)
    artifacts.write_manifest(a.report_dir, artifacts.tuned_inferenceservice(a.name, spec.model.source, final, slo,
                                                                            base=obj))
    artifacts.write_plots(a.report_dir, study, rep)
    print(reports.table(rep))
    print(f"\nspec.engine of {a.namespace}/{a.name} now: {final.describe()}; report: {a.report_dir}/report.json")
    return final
