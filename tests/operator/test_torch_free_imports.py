"""The operator and the tuner run without torch: their import graphs (and the tuner's
feasibility check at run time) load neither torch nor transformers, so the operator image
needs neither and `kvpilot operator --tuner` starts in seconds. Each check runs in a fresh
interpreter, since this test process may have loaded torch already."""
from __future__ import annotations

import json
import subprocess
import sys

from kube.tools import ROOT, Operator

HEAVY = ("torch", "transformers")
# the operator's and the tuner's entry points and every module they load on a path
ENTRY_MODULES = (
    "kvpilot.cli.main",
    "kvpilot.cli.operator",
    "kvpilot.operator.handlers",
    "kvpilot.tuner.cluster.slo_metrics",
    "kvpilot.tuner.cluster.daemon",
    "kvpilot.tuner.cli",
    "kvpilot.tuner.cluster.session",
    "kvpilot.tuner.local.session",
    "kvpilot.api.tuning_metrics",
)

PROBE = """
import importlib, json, sys
from kvpilot.cli.main import main
for name in {modules!r}:
    importlib.import_module(name)
for argv in (["operator", "--help"], ["tune", "--help"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
# what the daemon does with engine code at run time: size the builtin model against a pod
from kvpilot.tuner.search.feasibility import Hardware, check, resolve_model
from kvpilot.tuner.search.settings import EngineSettings
verdict = check(EngineSettings(max_model_len=512), resolve_model("builtin://smollm2-135m-instruct"),
                Hardware(4 << 30, shared_memory=True))
assert verdict.feasible and verdict.num_blocks > 0, verdict
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})))
"""


def imported_heavy(importtime_log: str) -> list[str]:
    """Top-level heavy packages named in `python -X importtime` output ('... | torch')."""
    names = {line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")}
    return sorted(n for n in names if n.split(".")[0] in HEAVY)


def test_operator_and_tuner_entry_points_and_feasibility_load_no_torch():
    r = subprocess.run([sys.executable, "-c", PROBE.format(modules=ENTRY_MODULES, heavy=HEAVY)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


def test_the_probe_would_see_torch_if_an_entry_point_loaded_it():
    # the check above can fail: the same probe over the engine's LLM module reports torch
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import kvpilot.engine.entrypoints.llm"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torch" in imported_heavy(r.stderr)


def test_the_running_operator_with_the_tuner_daemon_loads_no_torch(cluster, release, tmp_path):
    # the chart's command line (`kvpilot operator ... --tuner --metrics-port`), run until its
    # liveness endpoint answers, i.e. with the handlers, the daemon and the exporter loaded
    log = tmp_path / "operator.log"
    running = Operator(release.operator_kubeconfig(tmp_path / "kubeconfig"), log, cluster.namespace, release.name)
    assert "--tuner" in running.args
    running.env["PYTHONPROFILEIMPORTTIME"] = "1"  # = python -X importtime, to stderr (the log)
    running.start()
    try:
        text = log.read_text()
    finally:
        running.stop()
    assert "kvpilot.tuner.cluster.daemon" in text and "kopf" in text
    assert imported_heavy(text) == []
