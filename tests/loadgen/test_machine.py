"""The one machine block of benchmark JSON (kvpilot.loadgen.machine, issue 51): the CPU, its
flags, the cores and the load average under one spelling ("loadavg", "loadavg_before" /
"loadavg_after"), written by every benchmark, and the readers that still read the spellings of
the results recorded before it."""

import argparse
import ast
import json
from pathlib import Path

import pytest

from kvpilot.loadgen.machine import load_1m, loadavg, machine_info, recorded_load, recorded_machine

REPO = Path(__file__).resolve().parents[2]
OLD_LOAD_KEYS = {"load_1m_before", "load_1m_after", "load_avg", "load_avg_at_start", "load_avg_at_end",
                 "load_at_start", "load_at_end", "load_average_before", "load_average"}


def test_the_block_has_the_cpu_its_flags_the_cores_and_one_load_key():
    block = machine_info()
    assert set(block) == {"cpu", "flags", "cores", "loadavg"}
    assert block["cpu"] and block["cores"] >= 1 and block["flags"] == sorted(block["flags"])
    assert len(block["loadavg"]) == 3 and all(isinstance(x, float) and x >= 0 for x in block["loadavg"])
    before = loadavg()
    around = machine_info(loadavg_before=before)
    assert set(around) == {"cpu", "flags", "cores", "loadavg_before", "loadavg_after"}
    assert around["loadavg_before"] == before and len(around["loadavg_after"]) == 3
    json.dumps(around)  # plain JSON


@pytest.mark.parametrize("record, before, after", [
    ({"loadavg_before": [1.5, 1.0, 0.5], "loadavg_after": [2.0, 1.2, 0.6]}, [1.5, 1.0, 0.5], [2.0, 1.2, 0.6]),
    ({"loadavg": [0.7, 0.6, 0.5]}, [0.7, 0.6, 0.5], [0.7, 0.6, 0.5]),
    ({"loadavg_before": "0.52 0.61 0.70 2/345 6789", "loadavg_after": "1.0 0.9 0.8 1/300 7000"},
     [0.52, 0.61, 0.70], [1.0, 0.9, 0.8]),  # /proc/loadavg's text (bench reliability, multinode)
    ({"load_1m_before": 1.0, "load_1m_after": 2.5}, 1.0, 2.5),  # compare's runs
    ({"load_avg_at_start": [0.1, 0.2, 0.3], "load_avg_at_end": [0.4, 0.5, 0.6]}, [0.1, 0.2, 0.3], [0.4, 0.5, 0.6]),
    ({"load_at_start": "0.3 0.2 0.1 1/2 3", "load_at_end": "0.6 0.5 0.4 1/2 3"}, [0.3, 0.2, 0.1], [0.6, 0.5, 0.4]),
    ({"load_avg": [3.0, 2.0, 1.0]}, [3.0, 2.0, 1.0], [3.0, 2.0, 1.0]),  # the tuner's grid windows
    ({"load_average_before": [0.9, 0.8, 0.7], "load_average": [1.9, 1.8, 1.7]}, [0.9, 0.8, 0.7],
     [1.9, 1.8, 1.7]),  # the operator's scale benchmark (benchmarks/results/operator)
    ({"load_average": [0.5, 0.4, 0.3]}, [0.5, 0.4, 0.3], [0.5, 0.4, 0.3]),  # its takeover benchmark
    ({}, None, None),
])
def test_every_recorded_spelling_reads_back(record, before, after):
    assert recorded_load(record, "before") == before and recorded_load(record, "after") == after
    first = before[0] if isinstance(before, list) else before
    assert load_1m(record) == first
    with pytest.raises(ValueError):
        load_1m(record, "during")


def test_an_old_records_loose_keys_read_as_the_block():
    old_shared_node = {"cpu": "AMD EPYC 9R14", "cpu_count": 2, "load_avg_at_start": [1, 2, 3]}
    assert recorded_machine(old_shared_node) == {"cpu": "AMD EPYC 9R14", "flags": None, "cores": 2,
                                                 "loadavg_before": [1.0, 2.0, 3.0], "loadavg_after": None}
    old_concurrency = {"machine": {"cpu": "X", "model_name": "X", "isa_flags": ["avx2"], "cpu_count": 4,
                                   "load_at_start": "0.5 0.4 0.3 1/2 3", "load_at_end": "0.9 0.8 0.7 1/2 3"}}
    got = recorded_machine(old_concurrency)
    assert got["flags"] == ["avx2"] and got["cores"] == 4 and got["loadavg_after"] == [0.9, 0.8, 0.7]
    new = {"machine": machine_info(loadavg_before=[0.1, 0.2, 0.3])}
    assert recorded_machine(new)["loadavg_before"] == [0.1, 0.2, 0.3] and recorded_machine(new)["cpu"]


def test_a_benchmark_writer_records_the_block():
    """compare's environment (compare.json's "environment", also shared-node's) carries it."""
    from kvpilot.bench.compare_peers import environment

    env = environment(argparse.Namespace(threads=2), ["kvpilot"])
    assert set(env["machine"]) == {"cpu", "flags", "cores", "loadavg"}
    assert not OLD_LOAD_KEYS & set(env) and "cpu" not in env


def _writer_files() -> list[Path]:
    """Every file that writes a benchmark's or a tuning run's JSON: bench/, the tuner's benchmarks,
    the local tuner's report and the operator's benchmarks (tests/operator/bench_operator*.py)."""
    files = [*sorted((REPO / "bench").rglob("*.py")), *sorted((REPO / "tuner" / "benchmark").glob("*.py")),
             *sorted((REPO / "tuner" / "local").glob("*.py")), *sorted((REPO / "tests" / "operator").glob("bench_*.py"))]
    return [p for p in files if "__pycache__" not in p.parts]


def test_no_benchmark_writes_the_load_its_own_way():
    """Every benchmark takes the load from kvpilot.loadgen.machine: no os.getloadavg() of its own
    and no old key spelled in code (docstrings may name them)."""
    found = []
    for path in _writer_files():
        tree = ast.parse(path.read_text())
        prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "getloadavg":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: getloadavg")
            if isinstance(node, ast.Constant) and id(node) not in prose and node.value in OLD_LOAD_KEYS:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
            if isinstance(node, ast.keyword) and node.arg in OLD_LOAD_KEYS:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.arg}=")
    assert not found, found
