"""What the benchmarks run servers in and record beside their results: a server process on
a free port (server_process.py), cpu cgroups (cgroups.py), a real Prometheus (prometheus.py),
the CPU model and load average (machine.py)."""
