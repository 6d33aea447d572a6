#!/usr/bin/env bash
# Issue 15's "What it must show", one run, alone on the machine (no test suite, no helper).
# Run from the repository root: bash benchmarks/results/throughput/avx2_idle/run.sh
set -euo pipefail
OUT=${OUT:-benchmarks/results/throughput/avx2_idle}   # the fourth session ran with OUT=benchmarks/results/throughput/avx2_idle_s4
LLAMA_PY=${LLAMA_PY:-/work/llamacpp-venv/bin/python}   # llama-cpp-python 0.3.36, GGML_NATIVE=ON (see bench/compare.py)
log() { echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" | tee -a "$OUT/load.txt"; }
grep -m1 'model name' /proc/cpuinfo > "$OUT/cpu.txt"; grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|avx2|fma|f16c|avx512.*|amx.*)$' | tr '\n' ' ' >> "$OUT/cpu.txt"
log "start $(git rev-parse --short HEAD)"
# 1. one stream at 0.1 req/s: kvpilot with the GGUF's own Q4_1/Q8_0 weights vs llama.cpp on the same file, 2 threads each
.venv/bin/kvpilot bench compare --request-rates 0.1 --num-prompts 8 --max-output-len 64 --threads 2 \
    --peers kvpilot,llama-cpp-python --llama-cpp-python "$LLAMA_PY" --output-dir "$OUT/compare_gguf" \
    --quantization gguf
log "compare gguf done"
# 1b. the same load on kvpilot's dense float32 weights (the default)
.venv/bin/kvpilot bench compare --request-rates 0.1 --num-prompts 8 --max-output-len 64 --threads 2 \
    --peers kvpilot --output-dir "$OUT/compare_dense"
log "compare dense done"
# 2. offline ShareGPT throughput vs HF generate() in the same dtype, the matmul peak of that dtype
.venv/bin/kvpilot bench throughput --num-prompts 32 --output-json "$OUT/throughput32.json"
log "throughput done"
# 2b. the same with kvpilot's float32 matmuls on the GGUF's blocks (float32 activations: the same
#     float32 arithmetic on the same weight values as HF's, README section 12)
.venv/bin/kvpilot bench throughput --num-prompts 32 --quantization gguf --output-json "$OUT/throughput32_gguf.json"
log "throughput gguf done"
# 3. kvpilot serve with defaults: process start -> /health 200, RSS
.venv/bin/python benchmarks/results/throughput/measure_startup.py --tree after= --rounds 1 --timeout-s 600 \
    --out "$OUT/startup.json"
log "startup done"
