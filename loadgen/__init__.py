"""kvpilot's load library: the requests, the client and the arithmetic that both the
benchmarks (`kvpilot bench`) and the tuner's trials (`kvpilot tune`) drive a server with.
It imports neither of them (.importlinter), after vLLM's `vllm/benchmarks/` library:

    datasets.py        ShareGPT and random prompts (vllm/benchmarks/datasets.py)
    tokenizers.py      a tokenizer by model name, Hugging Face name or .gguf file
    request_client.py  one streamed, timed request; SSE parsing
                       (vllm/benchmarks/lib/endpoint_request_func.py)
    benchmark.py       arrival schedules and the run loop (`benchmark()` of vllm/benchmarks/serve.py)
    metrics.py         TTFT, TPOT, ITL, E2EL statistics, throughput and goodput
    process.py         the server process: `kvpilot serve`, a free port, spawn into a log, wait
                       for /health, stop; a process's CPU seconds; where vLLM's Python is
    machine.py         the machine block of benchmark JSON (CPU, flags, cores, "loadavg")

Torch-free at import: transformers and the engine load only inside `load_tokenizer`.
"""
