#!/usr/bin/env bash
# Issue 51: throughput and single-stream ITL before and after the folder move, alternating.
# run.sh BEFORE_COMMIT OUT [ROUNDS]: BEFORE_COMMIT is checked out in /tmp/kvpilot-before (its C
# kernels copied from this checkout's build: the move changed no C source); each round starts
# `kvpilot serve -q none` (dense bf16) from each checkout in turn (order reversed every other
# round) and drives it with `kvpilot bench serve` (ShareGPT, seed 0, max_tokens 128, rate inf):
# 16 requests one at a time, then 128 at 64 concurrent.
set -euo pipefail
BEFORE=$1; OUT=$2; ROUNDS=${3:-2}
REPO=$(git rev-parse --show-toplevel); PY=$REPO/.venv/bin/python; HERE=$(dirname "$(readlink -f "$0")")
mkdir -p "$OUT"
if [ ! -d /tmp/kvpilot-before ]; then
  git -C "$REPO" worktree add -f /tmp/kvpilot-before "$BEFORE" >/dev/null
  cp -r "$REPO/kernels/cpu/lib" /tmp/kvpilot-before/kernels/cpu/lib
fi
{ lscpu | grep -E "Model name|^CPU\(s\)"; echo "load before: $(cat /proc/loadavg)"; echo "before: $BEFORE after: $(git -C "$REPO" rev-parse --short HEAD)"; } > "$OUT/machine.txt"
serve_and_bench() {  # side root round
  local side=$1 root=$2 round=$3 port=8771
  (cd /tmp && exec "$PY" -P "$HERE/kvpilot_at.py" "$root" serve smollm2-135m-instruct -q none \
     --max-model-len 2048 --port $port) > "$OUT/server_${side}_$round.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do curl -sf localhost:$port/health >/dev/null && break; kill -0 $pid || { echo "server $side exited"; exit 1; }; sleep 1; done
  for c in 1 64; do
    local n=16; [ $c = 64 ] && n=128
    "$REPO/.venv/bin/kvpilot" bench serve --base-url http://127.0.0.1:$port --dataset-name sharegpt \
      --num-prompts $n --sharegpt-output-len 128 --max-concurrency $c --seed 0 --disable-tqdm \
      --label "${side}_c${c}_r$round" --save-result --result-dir "$OUT" --result-filename "${side}_c${c}_r$round.json" > "$OUT/bench_${side}_c${c}_r$round.txt" 2>&1
  done
  kill $pid; wait $pid || true
  echo "load after $side round $round: $(cat /proc/loadavg)" >> "$OUT/machine.txt"
}
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="before after"; else order="after before"; fi
  for side in $order; do
    if [ $side = before ]; then serve_and_bench before /tmp/kvpilot-before $r; else serve_and_bench after "$REPO" $r; fi
  done
done
"$PY" -P "$HERE/summarize.py" "$OUT"
