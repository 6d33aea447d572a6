"""What the benchmarks run servers in: a server process on a free port (server_process.py),
cpu cgroups (cgroups.py), a real Prometheus (prometheus.py). The process helpers under them and
the machine block recorded beside every result (CPU, cores, load average) are the load
library's, shared with the tuner: kvpilot.loadgen.process and kvpilot.loadgen.machine."""
