"""The reliability tools, `kvpilot bench` commands that start a fresh `kvpilot serve` on
loopback and write benchmarks/results/reliability/:

    run.py            `kvpilot bench reliability`: API fuzz, overload, disconnect storm, SIGTERM
    fuzz_liveness.py  `kvpilot bench fuzz-liveness`: /health and a canary after every fuzz request
    slow_clients.py   `kvpilot bench slow-clients`: stalled and idle connections
    probes.py, fuzz_cases.py  the probes and generated requests, shared with tests/server
"""
