#!/usr/bin/env bash
# Samples `kvpilot serve` with py-spy under vLLM's serving benchmark load: ShareGPT, 128 output
# tokens, --max-concurrency C (default 64), NP requests (default 128), request rate inf; then
# profile_shares.py splits the engine thread's time into kernels and Python by phase.
#   benchmarks/results/serving_profile/run.sh OUT_DIR TAG [kvpilot serve flags...]
# py-spy is not a project dependency: pip install --target /tmp/pyspy py-spy (PYSPY= its path).
set -euo pipefail
OUT="$1"; TAG="$2"; shift 2
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
PYSPY="${PYSPY:-/tmp/pyspy/bin/py-spy}"
PORT="${PORT:-8100}"
mkdir -p "$OUT"
cd "$ROOT"
.venv/bin/kvpilot serve smollm2-135m-instruct --max-model-len 2048 --port "$PORT" \
    --disable-log-requests --disable-uvicorn-access-log "$@" > "$OUT/$TAG.server.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
bench() { .venv/bin/kvpilot bench serve --port "$PORT" --dataset-name sharegpt --sharegpt-output-len 128 \
    --request-rate inf --disable-tqdm "$@"; }
bench --num-prompts 8 --max-concurrency 8 > /dev/null  # warm-up, unmeasured
"$PYSPY" record --pid "$SERVER" --rate 200 --nonblocking --threads --idle -f raw -o "$OUT/$TAG.raw" \
    --duration "${PROFILE_S:-60}" > "$OUT/$TAG.pyspy.log" 2>&1 &
SPY=$!
{ echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"; echo "load before: $(cat /proc/loadavg)"; } > "$OUT/$TAG.machine.txt"
bench --num-prompts "${NP:-128}" --max-concurrency "${C:-64}" --save-result --result-dir "$OUT" \
    --result-filename "$TAG.bench.json" > "$OUT/$TAG.bench.txt"
echo "load after: $(cat /proc/loadavg)" >> "$OUT/$TAG.machine.txt"
wait $SPY || true
python3 -P "$ROOT/benchmarks/results/serving_profile/profile_shares.py" "$OUT/$TAG.raw" --json "$OUT/$TAG.shares.json" \
    | tee "$OUT/$TAG.shares.md"
