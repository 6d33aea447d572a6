"""The layering in .importlinter holds (`lint-imports` over the installed kvpilot.* packages),
and a forbidden import breaks it: each case copies the sources, adds one import to a copy,
and runs the same contracts over the copy."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "300"}
    if pythonpath is not None:  # first on sys.path: the copy shadows the installed packages
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def copy_sources(dest: Path) -> Path:
    """The kvpilot.* package folders (as pyproject.toml maps them) under dest/src/kvpilot/."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        shutil.copytree(ROOT / folder, dest / "src" / package.replace(".", "/"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / ".importlinter", dest / ".importlinter")
    return dest / "src"


def test_the_layering_contracts_hold():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout and "BROKEN" not in r.stdout


@pytest.mark.parametrize("module, added, broken", [
    ("tuner/cli.py", "import kvpilot.operator.handlers", "kvpilot.tuner is not allowed to import kvpilot.operator"),
    ("operator/render/builders.py", "import kvpilot.tuner.search.loop", "kvpilot.operator is not allowed to import kvpilot.tuner"),
    ("api/spec.py", "import kvpilot.tuner.search.settings", "kvpilot.api is not allowed to import kvpilot.tuner"),
    ("operator/render/builders.py", "import torch", "kvpilot.operator is not allowed to import torch"),
    # torch through the engine: the LLM class loads the model code at module level
    ("tuner/cli.py", "from kvpilot.engine.entrypoints.llm import LLM", "kvpilot.tuner is not allowed to import torch"),
    ("kernels/__init__.py", "import kvpilot.engine.config", "kvpilot.kernels is not allowed to import kvpilot.engine"),
    # issue 32: the CPU kernels' home is under the same contract, its build script stays stdlib-only,
    # and engine/layers never import engine/attention (the loop that used to run between them)
    ("kernels/cpu/attention.py", "import kvpilot.engine.cpu.info", "kvpilot.kernels is not allowed to import kvpilot.engine"),
    ("kernels/cpu/build.py", "import torch", "kvpilot.kernels.cpu.build is not allowed to import torch"),
    ("engine/layers/linear.py", "import kvpilot.engine.attention.backend",
     "kvpilot.engine.layers is not allowed to import kvpilot.engine.attention"),
    # issue 39: the settings package (table, Setting, serve parser) is a stdlib-only floor below the
    # engine core, which sits below the HTTP server; the operator reads the engine only through it
    ("engine/settings/cli_args.py", "import kvpilot.engine.config",
     "kvpilot.engine.settings is not allowed to import kvpilot.engine.config"),
    ("engine/arg_utils.py", "import kvpilot.engine.entrypoints.serve",
     "kvpilot.engine.arg_utils is not allowed to import kvpilot.engine.entrypoints"),
    ("engine/attention/backend.py", "from kvpilot.engine.entrypoints import errors",
     "kvpilot.engine.attention is not allowed to import kvpilot.engine.entrypoints"),
    ("operator/render/extra_args.py", "import kvpilot.engine.exit_codes",
     "kvpilot.operator is not allowed to import kvpilot.engine"),
    # issue 39: the load library sits below the benchmarks and the tuner, and loads no torch
    ("loadgen/metrics.py", "import kvpilot.bench.report", "kvpilot.loadgen is not allowed to import kvpilot.bench"),
    ("loadgen/datasets.py", "import kvpilot.tuner.search.objective", "kvpilot.loadgen is not allowed to import kvpilot.tuner"),
    ("loadgen/request_client.py", "import torch", "kvpilot.loadgen is not allowed to import torch"),
    # the engine sits below everything that drives it, the load library included
    ("engine/core/scheduler.py", "import kvpilot.loadgen.metrics", "kvpilot.engine is not allowed to import kvpilot.loadgen"),
    # issue 39: bench and tuner meet only in the load library and api/
    ("bench/dashboard.py", "import kvpilot.tuner.search.objective", "kvpilot.bench is not allowed to import kvpilot.tuner"),
    ("tuner/measure/workload.py", "import kvpilot.bench.serve", "kvpilot.tuner is not allowed to import kvpilot.bench"),
    # issue 51: the engine core is torch-free bookkeeping, the search runs nothing, the renderers are pure
    ("engine/core/sequence.py", "import torch", "kvpilot.engine.core is not allowed to import torch"),
    ("engine/core/scheduler.py", "import kvpilot.engine.worker.model_runner",
     "kvpilot.engine.core is not allowed to import kvpilot.engine.worker"),
    ("tuner/search/loop.py", "import kvpilot.loadgen.request_client",
     "kvpilot.tuner.search is not allowed to import kvpilot.loadgen"),
    ("tuner/search/space.py", "import kubernetes.client", "kvpilot.tuner.search is not allowed to import kubernetes"),
    ("tuner/search/objective.py", "import kvpilot.tuner.cluster.runner",
     "kvpilot.tuner.search is not allowed to import kvpilot.tuner.cluster"),
    ("operator/render/network.py", "import kopf", "kvpilot.operator.render is not allowed to import kopf"),
    ("operator/render/engine_args.py", "from kvpilot.api.kube import AsyncKubeClient",
     "kvpilot.operator.render is not allowed to import kvpilot.api.kube"),
    ("operator/render/crd.py", "import kubernetes.client", "kvpilot.operator.render is not allowed to import kubernetes"),
])
def test_a_forbidden_import_breaks_the_contract(tmp_path, module, added, broken):
    src = copy_sources(tmp_path)
    path = src / "kvpilot" / module
    path.write_text(path.read_text() + f"\n{added}  # added by the test\n")
    r = lint(tmp_path, src)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    assert broken in r.stdout, r.stdout[-3000:]  # only the copy has the import


ROOT_PACKAGES = ["kvpilot.api", "kvpilot.operator", "kvpilot.tuner", "kvpilot.engine", "kvpilot.bench", "kvpilot.cli",
                 "kvpilot.kernels", "kvpilot.loadgen"]


def import_cycles(pythonpath: Path | None = None) -> list[list[str]]:
    """The module-level import cycles among kvpilot's modules (every import statement, wherever it is, as
    import-linter sees them; annotations-only imports excluded): the strongly connected components of
    more than one module (Tarjan's algorithm), found by grimp in a fresh interpreter."""
    script = f"""
import grimp, json, sys
sys.setrecursionlimit(20000)
g = grimp.build_graph(*{ROOT_PACKAGES!r}, exclude_type_checking_imports=True)
adj = {{m: sorted(d for d in g.find_modules_directly_imported_by(m) if d in g.modules) for m in g.modules}}
index, low, stack, on, cycles = {{}}, {{}}, [], set(), []
def visit(v):
    index[v] = low[v] = len(index); stack.append(v); on.add(v)
    for w in adj[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        part = []
        while not part or part[-1] != v:
            part.append(stack.pop()); on.discard(part[-1])
        if len(part) > 1:
            cycles.append(sorted(part))
for m in sorted(adj):
    if m not in index:
        visit(m)
print(json.dumps(cycles))
"""
    env = {**os.environ}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                       cwd=pythonpath or ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    return json.loads(r.stdout)


def test_no_module_imports_itself_through_others():
    """issue 39: no file-level import cycle anywhere in kvpilot (a cycle is a floor that runs both ways)."""
    assert import_cycles() == []


def test_an_added_import_loop_is_found(tmp_path):
    src = copy_sources(tmp_path)
    path = src / "kvpilot" / "engine" / "core" / "block_manager.py"  # the scheduler imports the block manager
    path.write_text(path.read_text() + "\nimport kvpilot.engine.core.scheduler  # added by the test\n")
    cycles = import_cycles(src)
    assert ["kvpilot.engine.core.block_manager", "kvpilot.engine.core.scheduler"] in cycles, cycles
