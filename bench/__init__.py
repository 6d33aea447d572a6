"""kvpilot's benchmarks, each a `kvpilot bench NAME` command (cli/main.py), grouped by role:

    serve, throughput, sweep, compare, dashboard, decode_step, shared_node,
    structured_outputs, sampling_params_cost, tensor_parallel
                  the benchmark commands; report.py, sweep_report.py, compare_report.py,
                  compare_peers.py, compare_vllm.py, compare_concurrency.py (compare's
                  vLLM peer and concurrency mode), compare_concurrency_report.py,
                  shared_node_report.py are their tables and parts
    reliability/  the reliability tools (`kvpilot bench reliability`, `fuzz-liveness`,
                  `slow-clients`) and the probes they share with tests/server
    harness/      what the benchmarks run servers in: server_process.py (a server on a free
                  port), cgroups.py (cpu cgroups), prometheus.py (a real Prometheus)

The load itself (datasets, tokenizers, the request client, the run loop, the metrics), the
process helpers (free port, CPU seconds, start and health-wait of `kvpilot serve`) and the
machine block every result records (loadgen/machine.py: CPU, cores, "loadavg") are the load
library kvpilot.loadgen, shared with the tuner; bench and tuner import nothing of
each other (.importlinter).
"""
