"""`kvpilot` command line: one entry point, subcommands routed to their packages.

    kvpilot demo                 chat replies for ShareGPT prompts, then a short tuning session (make demo)
    kvpilot serve MODEL [flags]  OpenAI-compatible server (vllm serve's flags)
    kvpilot tune [flags]         the SLO tuner: --local (one machine) or an InferenceService in a cluster
    kvpilot operator             the Kopf operator for InferenceService resources
    kvpilot crd [--write ROOT]   the InferenceService CRD, generated from the engine settings
    kvpilot bench throughput     offline throughput against HF generate()
    kvpilot bench serve          serving benchmark against any OpenAI-compatible server
    kvpilot bench sweep          bench serve over request rates and engine settings, with plots
    kvpilot bench compare        our server against peer engines on the same requests
    kvpilot bench dashboard      the Grafana dashboard's rows drawn as PNGs over a recorded load window
    kvpilot bench decode-step    one decode step's time per CPU decode path and row count
    kvpilot bench shared-node    one stream and a burst alone, beside busy neighbours and under a CPU limit
    kvpilot bench structured-outputs  output tokens/s with and without a JSON schema; grammar compile times
    kvpilot bench sampling-params  output tokens/s with penalties, logit_bias and bad_words on every request
    kvpilot bench reliability    API fuzz, overload, a disconnect storm and SIGTERM against a fresh server
    kvpilot bench fuzz-liveness  generated requests on every route, /health and a canary after each
    kvpilot bench slow-clients   stalled and idle connections against a fresh server
    kvpilot bench tuning {grid,replay,confirm}  the tuner against a measured grid, random search and the defaults
    kvpilot bench multinode      one process against one engine over several `kvpilot serve --nnodes` processes
    kvpilot bench retune         continuous tuning against a workload shift, beside tuning once

Each subcommand's module exposes `main(argv: list[str]) -> int`; bad flags exit 2.
tests/test_cli_and_packaging.py checks that this list names every command below.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": "kvpilot.cli.demo",
    "serve": "kvpilot.engine.entrypoints.serve",
    "operator": "kvpilot.cli.operator",
    "tune": "kvpilot.tuner.cli",
    "crd": "kvpilot.operator.render.crd",  # issue 13: the CRD, generated from kvpilot.engine.settings
}
BENCH_COMMANDS = {
    "throughput": "kvpilot.bench.throughput",
    "serve": "kvpilot.bench.serve",
    "sweep": "kvpilot.bench.sweep",
    "compare": "kvpilot.bench.compare",
    "dashboard": "kvpilot.bench.dashboard",  # issue 14: the Grafana dashboard's rows as PNGs
    "decode-step": "kvpilot.bench.decode_step",
    "shared-node": "kvpilot.bench.shared_node",  # issue 38: beside busy neighbours and under a CPU limit
    "structured-outputs": "kvpilot.bench.structured_outputs",  # issue 40: what a grammar costs
    "sampling-params": "kvpilot.bench.sampling_params_cost",  # issue 48: what penalties and logit bias cost
    # issue 39: the reliability tools (bench/reliability/)
    "reliability": "kvpilot.bench.reliability.run",
    "fuzz-liveness": "kvpilot.bench.reliability.fuzz_liveness",
    "slow-clients": "kvpilot.bench.reliability.slow_clients",
    "tuning": "kvpilot.tuner.benchmark.cli",  # issue 39: the tuning-quality benchmark (grid, replay, confirm)
    "multinode": "kvpilot.bench.multinode",  # issue 41: ready, tokens/s, comm share, restart over nodes
    "retune": "kvpilot.tuner.benchmark.retune",  # issue 50: continuous tuning against a workload shift
}


def _usage() -> str:
    return (
        "usage: kvpilot {" + ",".join(COMMANDS) + ",bench} ...\n"
        "       kvpilot bench {" + ",".join(BENCH_COMMANDS) + "} ...\n"
    )


def _run(module: str, argv: list[str]) -> int:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            sys.stderr.write(f"kvpilot: {module} is not available in this build\n")
            return 2
        raise
    return int(mod.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    """Routes `argv` (default sys.argv[1:]) to its subcommand's `main` and returns its exit status;
    with no arguments prints the usage and returns 2 (0 for -h/--help), 2 on an unknown command or a
    subcommand this build lacks."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(_usage() + __doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCH_COMMANDS:
            sys.stderr.write(_usage() + "kvpilot bench: choose a benchmark\n")
            return 2
        return _run(BENCH_COMMANDS[rest[0]], rest[1:])
    if cmd not in COMMANDS:
        sys.stderr.write(_usage() + f"kvpilot: unknown command {cmd!r}\n")
        return 2
    return _run(COMMANDS[cmd], rest)


if __name__ == "__main__":
    sys.exit(main())
